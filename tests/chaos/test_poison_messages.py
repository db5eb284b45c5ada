"""Scenario 5: poison messages at a webhook receiver. One is refused for good (HTTP 422), one
SIGKILLs the relay that delivers it, every time, and one is answered with hostile error text
(NUL bytes, invalid UTF-8, megabytes). Neither may hold up the rest, nor stay PROCESSING."""

from __future__ import annotations

import json
import os
import secrets
import signal
import time
from collections.abc import Callable

import psycopg
import pytest

from tests.chaos.harness import (
    Answer,
    RelayFleet,
    WebhookRequest,
    WebhookSink,
    Workload,
    finish,
    pid_of_peer,
    relay_args,
    report,
    retried,
    statuses,
)

KEYS = [f"key-{k}" for k in range(10)]
MAX_ATTEMPTS = 3
#: One relay, restarted by the test as a supervisor would: each death takes down only the
#: batch that holds the killer.
RELAYS = 1
#: Relay starts allowed after the first: the killer may end MAX_ATTEMPTS relays, plus a
#: margin for deaths that come before a takeover is counted.
RESTARTS = 3 * MAX_ATTEMPTS
RELAY_ARGS = relay_args(
    batch_size=20,
    concurrency=1,
    lock_timeout=1,
    max_attempts=MAX_ATTEMPTS,
    backoff_base=0.1,
    backoff_max=0.5,
    poll_interval=0.1,
)
#: What a broken receiver might answer: NUL bytes, bytes that are no UTF-8 (an encoded lone
#: surrogate among them), and 2 MB of it.
HOSTILE = (b"\x00NUL\x00 \xff\xfe not utf-8 \xed\xa0\x80 lone surrogate \xc3\x28 " * 50_000)[
    :2_000_000
]


@pytest.mark.timeout(180)
def test_poison_messages_are_isolated(
    chaos_db: str,
    make_fleet: Callable[..., RelayFleet],
) -> None:
    workload = Workload()
    poison: dict[str, str] = {}
    # 50 messages before, between and after the poisons: far enough apart to be claimed in
    # different batches, so that each poison's own effect shows.
    for seed, (kind, key) in enumerate(
        (("refuse", "key-1"), ("kill", "key-2"), ("hostile", "key-3"))
    ):
        workload.write_backlog(chaos_db, KEYS, 50, transaction_size=10, rollback_every=4, seed=seed)
        poison[kind] = workload.write_poison(chaos_db, key, kind)
    workload.write_backlog(chaos_db, KEYS, 50, transaction_size=10, rollback_every=4, seed=9)

    fleet: RelayFleet | None = None

    def respond(request: WebhookRequest) -> Answer:
        kind = json.loads(request.body).get("poison")
        if kind == "refuse":
            return 422, b"unprocessable: this event is refused for good"
        if kind == "hostile":
            return 500, HOSTILE
        if kind == "kill":  # the receiver's bug takes the relay down with it, every time
            assert fleet is not None
            pid = pid_of_peer(request.peer_port, [r.process.pid for r in fleet.alive])
            relay = fleet.by_pid(pid) if pid is not None else None
            if relay is not None:
                fleet.kill(relay)
            elif pid is not None:
                os.kill(pid, signal.SIGKILL)
            return None
        return 200, b"ok"

    sink = WebhookSink(respond).start()
    webhook_secret = "whsec-" + secrets.token_hex(12)
    try:
        fleet = make_fleet(
            chaos_db, f"http://127.0.0.1:{sink.port}/events?secret={webhook_secret}", RELAY_ARGS
        )
        started = time.monotonic()
        fleet.start(RELAYS)
        expected = set(workload.committed) - set(poison.values())

        def done() -> bool:
            counts = statuses(chaos_db)
            return set(counts) <= {"PUBLISHED", "ABANDONED"} and sink.received(expected)

        abandoned_at: dict[str, float] = {}
        while not done():
            for kind, message_id in poison.items():
                if kind not in abandoned_at and _row(chaos_db, message_id)[0] == "ABANDONED":
                    abandoned_at[kind] = time.monotonic() - started
            # A supervisor restarts dead relays; a message that kills every relay that takes
            # it must not make that go on forever.
            while len(fleet.alive) < RELAYS:
                assert len(fleet.relays) < RELAYS + RESTARTS, _stuck(
                    chaos_db, poison, fleet, sink.count(), len(expected)
                )
                fleet.spawn()
            assert time.monotonic() - started < 60, _stuck(
                chaos_db, poison, fleet, sink.count(), len(expected)
            )
            time.sleep(0.1)
        drained = time.monotonic() - started
        verdict = finish(
            fleet,
            workload,
            sink,
            in_flight_at_faults=fleet.in_flight_at_kills | retried(chaos_db),
            final={"PUBLISHED": len(expected), "ABANDONED": len(poison)},
            never_delivered=set(poison.values()),
        )
    finally:
        sink.stop()

    refused, killer, hostile = (_row(chaos_db, poison[k]) for k in ("refuse", "kill", "hostile"))
    assert refused[1] == 1 and "422" in refused[2], f"refused for good at once: {refused}"
    assert killer[1] >= MAX_ATTEMPTS, killer
    assert "died" in killer[2] or "stalled" in killer[2], (
        f"the killer's last_error says its relay died: {killer}"
    )
    assert hostile[1] == MAX_ATTEMPTS and "500" in hostile[2], hostile
    assert len(hostile[2]) < 10_000, "a megabyte answer is not stored whole in last_error"
    report(
        "poison_messages",
        faults=len(poison),
        relay_deaths=len(fleet.kills),
        relays_started=len(fleet.relays),
        messages=verdict.messages,
        rolled_back=verdict.rolled_back,
        duplicates=verdict.duplicates,
        recover_s=abandoned_at.get("kill", drained),
        seconds=drained,
        log_lines=verdict.log_lines,
    )


def _row(db_url: str, message_id: str) -> tuple[str, int, str]:
    with psycopg.connect(db_url) as conn:
        row = conn.execute(
            "SELECT status, attempts, coalesce(last_error, '') FROM outboxer.outbox WHERE id = %s",
            (message_id,),
        ).fetchone()
    assert row is not None
    return str(row[0]), int(row[1]), str(row[2])


def _stuck(
    db_url: str, poison: dict[str, str], fleet: RelayFleet, received: int, expected: int
) -> str:
    rows = {kind: _row(db_url, message_id) for kind, message_id in poison.items()}
    shown = {
        kind: (status, attempts, error[:120]) for kind, (status, attempts, error) in rows.items()
    }
    return (
        f"poison messages not isolated after {len(fleet.kills)} relay death(s) and "
        f"{len(fleet.relays)} relay start(s): outbox {statuses(db_url)}, receiver accepted "
        f"{received} of {expected}; poison rows (status, attempts, last_error): {shown}"
    )
