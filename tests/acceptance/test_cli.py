"""The real ``outboxer`` command in subprocesses: crash, restart, drain, verify."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

import outboxer
from tests.rabbit import RabbitConsumer

OUTBOXER = [sys.executable, "-m", "outboxer.cli"]


def cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*OUTBOXER, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def spawn_relay(db: str, broker: str, relay_id: str, log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            *OUTBOXER,
            "relay",
            "--db",
            db,
            "--broker",
            broker,
            "--relay-id",
            relay_id,
            "--batch-size",
            "40",
            "--lock-timeout",
            "3",
            "--poll-interval",
            "0.2",
            "--concurrency",
            "2",
        ],
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
    )


def statuses(db: str) -> dict[str, int]:
    with psycopg.connect(db) as conn:
        return dict(
            conn.execute("SELECT status, count(*) FROM outboxer.outbox GROUP BY status").fetchall()
        )


async def test_sigkill_mid_batch_loses_nothing_and_keeps_key_order(
    pg_url: str, rabbit_consumer: RabbitConsumer, tmp_path: Path
) -> None:
    total_keys, per_key = 25, 120
    with psycopg.connect(pg_url) as conn:
        outboxer.enqueue_many(
            conn,
            [
                {"topic": "order.placed", "payload": {"key": f"k{k}", "n": n}, "key": f"k{k}"}
                for n in range(per_key)
                for k in range(total_keys)
            ],
        )
    total = total_keys * per_key
    log = tmp_path / "relays.log"
    victim = spawn_relay(pg_url, rabbit_consumer.broker_url, "relay-victim", log)
    survivor = spawn_relay(pg_url, rabbit_consumer.broker_url, "relay-survivor", log)
    restarted = None
    try:
        await rabbit_consumer.wait_for(total // 4, timeout=60)
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        with psycopg.connect(pg_url) as conn:
            in_flight = {
                str(row[0])
                for row in conn.execute(
                    "SELECT id FROM outboxer.outbox WHERE status = 'PROCESSING' AND locked_by = 'relay-victim'"
                )
            }
        restarted = spawn_relay(pg_url, rabbit_consumer.broker_url, "relay-restarted", log)
        deadline = time.monotonic() + 120
        # The SIGTERM below is meant for a running relay: the survivor may drain everything
        # while this one is still starting.
        while "relay relay-restarted started" not in log.read_text() and restarted.poll() is None:
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            await asyncio.sleep(0.05)
        while statuses(pg_url) != {"PUBLISHED": total} and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert statuses(pg_url) == {"PUBLISHED": total}, log.read_text()[-3000:]
        for process in (survivor, restarted):
            process.send_signal(signal.SIGTERM)
        assert survivor.wait(30) == 0 and restarted.wait(30) == 0, "SIGTERM ends a relay cleanly"
    finally:
        for process in (victim, survivor, restarted):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()

    delivered = await rabbit_consumer.wait_for(total, timeout=30, distinct=True)
    ids = [d.message_id for d in delivered]
    assert len(set(ids)) == total, "nothing lost"
    duplicates = {i for i in ids if ids.count(i) > 1}
    assert duplicates <= in_flight, "only messages in flight at the kill may arrive twice"
    first_seen: dict[str, list[int]] = {}
    seen: set[str] = set()
    for item in delivered:
        if item.message_id in seen:
            continue
        seen.add(item.message_id)
        body = json.loads(item.body)
        first_seen.setdefault(body["key"], []).append(body["n"])
    assert all(order == list(range(per_key)) for order in first_seen.values()), "per-key order"


def test_sigterm_exits_zero_and_releases_nothing_half_done(pg_url: str, tmp_path: Path) -> None:
    out = tmp_path / "events.jsonl"
    with psycopg.connect(pg_url) as conn:
        outboxer.enqueue(conn, "t", {"n": 1})
    process = subprocess.Popen(
        [*OUTBOXER, "relay", "--db", pg_url, "--broker", f"file://{out}", "--poll-interval", "0.1"],
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 30
    while statuses(pg_url) != {"PUBLISHED": 1} and time.monotonic() < deadline:
        time.sleep(0.1)
    process.send_signal(signal.SIGTERM)
    assert process.wait(20) == 0
    assert statuses(pg_url) == {"PUBLISHED": 1}
    assert json.loads(out.read_text().splitlines()[0])["payload"] == {"n": 1}


def test_exit_when_idle_status_cleanup_and_schema(pg_url: str, tmp_path: Path) -> None:
    out = tmp_path / "events.jsonl"
    assert (
        cli(
            "enqueue",
            "--db",
            pg_url,
            "--topic",
            "t",
            "--key",
            "k",
            "--payload",
            '{"a": 1}',
            "--header",
            "h=v",
        ).returncode
        == 0
    )
    done = cli("relay", "--db", pg_url, "--broker", f"file://{out}", "--exit-when-idle")
    assert done.returncode == 0, done.stderr
    [line] = out.read_text().splitlines()
    assert json.loads(line)["headers"] == {"h": "v"}
    report = json.loads(cli("status", "--db", pg_url, "--json").stdout)
    [destination] = report["destinations"]
    assert destination["counts"] == {"PUBLISHED": 1} and destination["abandoned"] == 0
    kept = cli("cleanup", "--db", pg_url)
    assert "deleted 0" in kept.stdout
    gone = cli("cleanup", "--db", pg_url, "--published-retention", "0")
    assert "deleted 1" in gone.stdout
    ddl = cli("schema", "sql").stdout
    assert "CREATE TABLE" in ddl and "outboxer" in ddl
    assert cli("schema", "apply", "--db", pg_url).stdout.strip() == "schema is up to date"


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (
            ["relay", "--db", "postgresql://x/y", "--broker", "nope://x"],
            {},
            "unknown broker URL scheme",
        ),
        (["relay", "--broker", "memory://"], {}, "no database"),
        (["relay", "--broker", "memory://"], {"OUTBOXER_DB": ""}, "OUTBOXER_DB is set but empty"),
        (
            ["relay", "--db", "postgresql://x/y", "--broker", "memory://", "--batch-size", "0"],
            {},
            "--batch-size",
        ),
        (["status", "--db", "mysql2://x"], {}, "unknown database URL scheme"),
        (
            ["relay", "--db", "sqlite:///x.db", "--broker", "memory://"],
            {"OUTBOXER_LOCK_TIMEOUT": "soon"},
            "OUTBOXER_LOCK_TIMEOUT",
        ),
    ],
)
def test_bad_configuration_is_a_clear_error(
    args: list[str], env: dict[str, Any], message: str
) -> None:
    result = cli(*args, env=env)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


def test_relay_refuses_a_database_without_the_schema(tmp_path: Path) -> None:
    result = cli(
        "relay",
        "--db",
        f"sqlite:///{tmp_path / 'empty.db'}",
        "--broker",
        "memory://",
        "--exit-when-idle",
    )
    assert result.returncode == 2, result.stderr
    assert "no SQLite database" in result.stderr and "outboxer schema apply" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "empty.db").exists(), "the relay made an empty database"


def test_sigterm_under_load_finishes_in_flight_and_exits_zero(pg_url: str, tmp_path: Path) -> None:
    out = tmp_path / "events.jsonl"
    with psycopg.connect(pg_url) as conn:
        outboxer.enqueue_many(
            conn, [{"topic": "t", "payload": {"n": n}, "key": f"k{n % 50}"} for n in range(20000)]
        )
    process = subprocess.Popen(
        [
            *OUTBOXER,
            "relay",
            "--db",
            pg_url,
            "--broker",
            f"file://{out}?fsync=false",
            "--batch-size",
            "100",
        ],
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 60
    while statuses(pg_url).get("PUBLISHED", 0) < 1000 and time.monotonic() < deadline:
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    assert process.wait(30) == 0
    counts = statuses(pg_url)
    assert "PROCESSING" not in counts, (
        f"in-flight batches are settled or released on SIGTERM: {counts}"
    )
    published = counts.get("PUBLISHED", 0)
    assert 1000 <= published < 20000, counts
    lines = out.read_text().splitlines()
    assert len({json.loads(line)["id"] for line in lines}) == published == len(lines)


def test_demo_runs_the_pattern_end_to_end(tmp_path: Path) -> None:
    result = cli("demo", "--dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "published 3, failed 0" in out
    assert "the first event came twice: 1 duplicate skipped by the inbox" in out
    assert "shipments created: 3 (one per order, despite the duplicate)" in out
    assert "second relay run published 0." in out
    alice = [line for line in out.splitlines() if "key=alice" in line]
    assert ['"order_id": 1' in alice[0], '"order_id": 3' in alice[1]] == [True, True]
