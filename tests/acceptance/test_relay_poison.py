"""A message that kills the relay every time it is published: the real ``outboxer relay``
in a subprocess, restarted after each death, a real local webhook receiver."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psycopg

import outboxer
from tests.receiver import Delivery, Receiver

MAX_ATTEMPTS = 3


def statuses(db: str) -> dict[str, int]:
    with psycopg.connect(db) as conn:
        return dict(
            conn.execute("SELECT status, count(*) FROM outboxer.outbox GROUP BY status").fetchall()
        )


def spawn_relay(db: str, broker: str, relay_id: str, log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            *(sys.executable, "-m", "outboxer.cli", "relay"),
            *("--db", db, "--broker", broker, "--relay-id", relay_id),
            # A lease of 3 s, not 1: with 1 s a relay starved of CPU on a loaded box lost
            # its lease before a renewal got through, and the row it held was charged a
            # second attempt ("stalled"), which this test then took for the poison's.
            *("--lock-timeout", "3", "--max-attempts", str(MAX_ATTEMPTS)),
            *("--batch-size", "100", "--concurrency", "2", "--poll-interval", "0.1"),
        ],
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
    )


async def test_a_message_that_kills_the_relay_is_abandoned_and_its_batch_mates_published(
    pg_url: str, tmp_path: Path
) -> None:
    """One poison message among 50 others on 5 keys, claimed in one batch: the receiver
    SIGKILLs the relay whenever the poison arrives. After each death the rows' leases
    expire and the restarted relay takes them over one at a time, alone in flight: the 50
    are published (in order per key, each attempt counted once), the poison kills the relay
    once per attempt and ends ABANDONED, saying why. (Before: the whole batch died with it,
    every time, and none of the 50 was ever published.)"""
    keys = [f"k{k}" for k in range(5)]
    items = [
        {"topic": "order.placed", "payload": {"key": key, "n": n}, "key": key}
        for n in range(10)
        for key in keys
    ]
    with psycopg.connect(pg_url) as conn:
        sent = outboxer.enqueue_many(conn, items[:27])
        poison = outboxer.enqueue(conn, "order.placed", {"key": "k2", "n": "poison"}, key="k2")
        sent += outboxer.enqueue_many(conn, items[27:])
    relay: dict[str, subprocess.Popen[bytes]] = {}

    def answer(delivery: Delivery) -> tuple[int, bytes]:
        if delivery.id == str(poison.id):
            os.kill(relay["now"].pid, signal.SIGKILL)
            return 500, b"the relay is gone"
        return 200, b"ok"

    receiver = Receiver(answer=answer).start()
    log = tmp_path / "relay.log"
    deaths = 0
    try:
        relay["now"] = spawn_relay(pg_url, receiver.url, "relay-1", log)
        deadline = time.monotonic() + 120
        while statuses(pg_url) != {"PUBLISHED": 50, "ABANDONED": 1}:
            assert time.monotonic() < deadline, f"{statuses(pg_url)}\n{log.read_text()[-3000:]}"
            if relay["now"].poll() is not None:
                assert relay["now"].returncode == -signal.SIGKILL, log.read_text()[-3000:]
                deaths += 1
                assert deaths <= MAX_ATTEMPTS, f"killed too often\n{log.read_text()[-3000:]}"
                relay["now"] = spawn_relay(pg_url, receiver.url, f"relay-{deaths + 1}", log)
            await asyncio.sleep(0.1)
        relay["now"].send_signal(signal.SIGTERM)
        assert relay["now"].wait(30) == 0, "the last relay lives on and ends cleanly"
    finally:
        if relay["now"].poll() is None:
            relay["now"].kill()
            relay["now"].wait()
        receiver.stop()

    assert deaths == MAX_ATTEMPTS, "one death per attempt of the poison, no more"
    with psycopg.connect(pg_url) as conn:
        rows = conn.execute(
            "SELECT id, status, attempts, last_error, locked_by FROM outboxer.outbox ORDER BY seq"
        ).fetchall()
    [(status, attempts, error, holder)] = [row[1:] for row in rows if row[0] == poison.id]
    assert (status, attempts, holder) == ("ABANDONED", MAX_ATTEMPTS, None)
    assert re.fullmatch(
        r"abandoned after 3 attempts: relay relay-3 died or stalled while publishing this "
        r"message \(its lease expired\)",
        error,
    ), error
    others = [row for row in rows if row[0] != poison.id]
    assert {row[1] for row in others} == {"PUBLISHED"}
    assert {row[2] for row in others} == {1}, "each counted the first death only, not the poison's"
    assert "abandoned after 3 attempts" in log.read_text(), "the relay says so in its log"

    deliveries = sorted(receiver.received(), key=lambda d: d.arrived)
    assert {d.id for d in deliveries} == {str(m.id) for m in [*sent, poison]}
    assert sum(d.id == str(poison.id) for d in deliveries) == MAX_ATTEMPTS
    first_seen: dict[str, list[int]] = {}
    seen: set[str] = set()
    for delivery in deliveries:
        body = json.loads(delivery.body)
        if delivery.id in seen or body["n"] == "poison":
            continue
        seen.add(delivery.id)
        first_seen.setdefault(body["key"], []).append(body["n"])
    assert first_seen == {key: list(range(10)) for key in keys}, "per-key order"
