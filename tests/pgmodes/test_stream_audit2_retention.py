"""Log mode retention racing a writer: a partition is dropped only if no reader still
needs a row of it, including a row whose transaction commits while the drop waits."""

from __future__ import annotations

import asyncio
import datetime as dt
import time

import psycopg
import pytest

from outboxer.cli import main
from outboxer.enqueue import Outbox
from outboxer.stores.pglog import PgLog
from outboxer.streamtesting import drain, numbers
from tests.pgmodes.test_log_mode import LogHarness


@pytest.fixture
async def harness(pg_url: str) -> LogHarness:
    async with PgLog(pg_url) as log:
        await log.apply_schema()
    return LogHarness(pg_url, Outbox(mode="log"))


async def _wait_for_lock(url: str, pid: int) -> None:
    """Until the session ``pid`` waits for a lock (the drop behind the open writer)."""
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as watcher:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            cursor = await watcher.execute(
                "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)
            )
            row = await cursor.fetchone()
            if row is not None and row[0] == "Lock":
                return
            await asyncio.sleep(0.01)
    raise AssertionError("the partition drop never waited for the open writer")


async def test_retention_keeps_a_row_committed_while_the_drop_waits(harness: LogHarness) -> None:
    """drop_partitions checked for unread rows, then ran DROP TABLE, which waits for the
    writers of the partition: a row a writer committed during that wait (invisible to the
    check) was dropped with the partition, never published to any reader."""
    today = dt.datetime.now(dt.UTC).date()
    outbox = Outbox(mode="log")
    with psycopg.connect(harness.url) as conn:
        outbox.enqueue(conn, "orders", {"n": 1})
    assert numbers(await drain(harness, "default", 1)) == [1]
    async with PgLog(harness.url) as log:
        writer = psycopg.connect(harness.url)
        try:
            outbox.enqueue(writer, "orders", {"n": 2})  # not committed: the check cannot see it
            drop = asyncio.create_task(log.drop_partitions(today + dt.timedelta(days=1)))
            await _wait_for_lock(harness.url, log.conn.get_server_pid())
            writer.commit()
        finally:
            writer.close()
        dropped = await drop
        assert dropped == []
        count = await log.conn.fetchval("SELECT count(*) FROM outboxer.outbox_log")
        assert count == 2
    assert numbers(await drain(harness, "default", 1)) == [2]


def test_status_escapes_a_hostile_reader_name(
    pg_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`stream-relay status` printed log reader names (rows of the offsets table, anyone's
    --destination) raw: an ESC in one cleared the operator's screen or forged a line."""

    async def setup() -> None:
        async with PgLog(pg_url) as log:
            await log.apply_schema()
            await log.seek("evil\x1b[2J\nlog reader forged:")

    asyncio.run(setup())
    code = main(["stream-relay", "status", "--mode", "log", "--db", pg_url])
    out = capsys.readouterr().out
    assert code == 0
    assert "\x1b" not in out and "\nlog reader forged:" not in out
    assert "log reader evil\\x1b[2J\\x0alog reader forged::" in out


async def test_partition_created_by_another_relay_meanwhile_is_no_error(
    harness: LogHarness,
) -> None:
    """Each log reader's relay creates the coming days' partitions while idle, at its
    start first. Two of them (two destinations, restarted together) both saw a day's
    partition missing; the second CREATE waited for the first and failed (relation
    already exists): not an outage, so that relay stopped. The partition exists: fine."""
    day = dt.datetime.now(dt.UTC).date() + dt.timedelta(days=40)
    async with PgLog(harness.url) as log:
        other = psycopg.connect(harness.url)  # the other relay, its CREATE not committed yet
        try:
            other.execute(
                f"CREATE TABLE outboxer.{log.partition_name(day)} PARTITION OF "
                f"outboxer.outbox_log FOR VALUES FROM ('{day} 00:00+00') "
                f"TO ('{day + dt.timedelta(days=1)} 00:00+00')"
            )
            create = asyncio.create_task(log.ensure_partitions(0, today=day))
            await _wait_for_lock(harness.url, log.conn.get_server_pid())
            other.commit()
        finally:
            other.close()
        assert await create == []
        assert log.partition_name(day) in [name for name, _ in await log.partitions()]


async def test_partition_dropped_by_another_relay_meanwhile_is_no_error(
    harness: LogHarness,
) -> None:
    """Two readers' relays apply retention while idle, both at their start: the second
    listed a partition the first was dropping, its check waited for the drop and failed
    (relation does not exist), and that relay stopped. The partition is gone: fine."""
    today = dt.datetime.now(dt.UTC).date()
    async with PgLog(harness.url) as log:
        name = log.partition_name(today)
        other = psycopg.connect(harness.url)  # the other relay, its DROP not committed yet
        try:
            other.execute(f"DROP TABLE outboxer.{name}")
            drop = asyncio.create_task(log.drop_partitions(today + dt.timedelta(days=1)))
            await _wait_for_lock(harness.url, log.conn.get_server_pid())
            other.commit()
        finally:
            other.close()
        assert await drop == []
        assert name not in [found for found, _ in await log.partitions()]
