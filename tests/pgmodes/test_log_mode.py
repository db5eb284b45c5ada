"""Log mode against the shared PostgreSQL: the stream contract, offsets, replay, retention."""

from __future__ import annotations

import asyncio
import datetime as dt

import psycopg
import pytest

from outboxer.enqueue import Outbox
from outboxer.errors import ConfigError, StoreError
from outboxer.stores.pglog import BEGINNING, LogOffset, PgLog
from outboxer.streamrelay import StreamSource
from outboxer.streamtesting import StreamContract, StreamHarness, drain, numbers


class LogHarness(StreamHarness):
    key_writers_wait = True

    def source(self, destination: str) -> StreamSource:
        return PgLog(self.url).reader(destination)

    def relay_args(self, destination: str) -> list[str]:
        return ["--mode", "log", "--database", self.url, "--destination", destination]


@pytest.fixture
async def harness(pg_url: str) -> LogHarness:
    async with PgLog(pg_url) as log:
        assert await log.apply_schema() == ["0001_log", "0002_claim_check_index", "0001_stream"]
    return LogHarness(pg_url, Outbox(mode="log"))


class TestLogContract(StreamContract):
    pass


def _write(url: str, *numbers_: int, key: str | None = None) -> None:
    with psycopg.connect(url) as conn:
        for n in numbers_:
            Outbox(mode="log").enqueue(conn, "orders", {"n": n}, key=key)


async def test_log_rows_are_never_updated(harness: LogHarness) -> None:
    """Append-only: publishing changes no row of the log (its xmin stays the writer's)."""
    _write(harness.url, 1, 2, 3)
    with psycopg.connect(harness.url) as conn:
        before = conn.execute(
            "SELECT xmin::text, position FROM outboxer.outbox_log ORDER BY position"
        ).fetchall()
    assert numbers(await drain(harness, "default", 3)) == [1, 2, 3]
    with psycopg.connect(harness.url) as conn:
        after = conn.execute(
            "SELECT xmin::text, position FROM outboxer.outbox_log ORDER BY position"
        ).fetchall()
        stats = conn.execute(
            "SELECT coalesce(sum(n_tup_upd + n_tup_del), 0) FROM pg_stat_user_tables WHERE relname LIKE 'outbox_log_p%'"
        ).fetchone()
    assert before == after
    assert stats is not None and stats[0] == 0


async def test_replay_from_offset_and_from_time(harness: LogHarness) -> None:
    _write(harness.url, 1, 2)
    async with PgLog(harness.url) as log:
        assert numbers(await drain(harness, "default", 2)) == [1, 2]
        middle = await log.offset("default")
        assert middle is not None and middle > BEGINNING
        await asyncio.sleep(0.05)
        since = dt.datetime.now(dt.UTC)
        _write(harness.url, 3, 4)
        assert numbers(await drain(harness, "default", 2)) == [3, 4]
        await log.seek("default", since=since)
        assert numbers(await drain(harness, "default", 2)) == [3, 4]
        await log.seek("default")  # the beginning
        assert numbers(await drain(harness, "default", 4)) == [1, 2, 3, 4]
        await log.seek("default", offset=middle)
        assert numbers(await drain(harness, "default", 2)) == [3, 4]
        with pytest.raises(ConfigError):
            await log.seek("default", since=dt.datetime(2020, 1, 1))  # naive time


async def test_offset_never_moves_back_on_commit(harness: LogHarness) -> None:
    _write(harness.url, 1, 2)
    assert len(await drain(harness, "default", 2)) == 2
    async with PgLog(harness.url) as log:
        reached = await log.offset("default")
        reader = log.reader("other")
        await reader.connect()
        try:
            await reader.commit(LogOffset(1, 1))
            log2 = PgLog(harness.url)
            async with log2:
                assert await log2.offset("other") == LogOffset(1, 1)
                await reader.commit(BEGINNING)  # a late, older confirm
                assert await log2.offset("other") == LogOffset(1, 1)
                assert await log2.offset("default") == reached
        finally:
            await reader.close()


async def test_second_relay_on_one_reader_is_refused(harness: LogHarness) -> None:
    first = PgLog(harness.url).reader("default")
    await first.connect()
    try:
        with pytest.raises(StoreError, match="already being read"):
            await PgLog(harness.url).reader("default").connect()
    finally:
        await first.close()
    again = PgLog(harness.url).reader("default")
    await again.connect()  # the lock went with the first relay's session
    await again.close()


async def test_retention_drops_read_partitions_only(harness: LogHarness) -> None:
    today = dt.datetime.now(dt.UTC).date()
    async with PgLog(harness.url) as log:
        names = [name for name, _ in await log.partitions()]
        assert log.partition_name(today) in names
        assert log.partition_name(today + dt.timedelta(days=7)) in names
        _write(harness.url, 1)
        await log.seek("slow")  # a reader that has read nothing
        tomorrow = today + dt.timedelta(days=1)
        assert await log.drop_partitions(tomorrow) == []  # "slow" has not read today's
        await log.seek("slow", offset=await log.offset("slow") or BEGINNING)
        assert numbers(await drain(harness, "slow", 1)) == [1]
        assert numbers(await drain(harness, "default", 1)) == [1]
        assert await log.drop_partitions(tomorrow) == [log.partition_name(today)]
        count = await log.conn.fetchval("SELECT count(*) FROM outboxer.outbox_log")
        assert count == 0


def test_log_mode_refuses_sqlite(tmp_path: object) -> None:
    import sqlite3

    conn = sqlite3.connect(":memory:")
    with pytest.raises(TypeError, match="needs PostgreSQL"):
        Outbox(mode="log").enqueue(conn, "orders", {"n": 1})


def test_unknown_mode_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="mode must be one of"):
        Outbox(mode="queue")


async def test_idle_reader_keeps_partitions_ahead_and_applies_retention(
    harness: LogHarness,
) -> None:
    today = dt.datetime.now(dt.UTC).date()
    async with PgLog(harness.url) as log:
        for name, _ in await log.partitions():  # as if schema apply ran yesterday, once
            await log.conn.execute(f"DROP TABLE outboxer.{name}")
        await log.ensure_partitions(0, today=today - dt.timedelta(days=1))
        reader = log.reader("default", retention_days=0, maintenance_seconds=0)
        await reader.connect()
        try:
            await reader.idle()
        finally:
            await reader.close()
    async with PgLog(harness.url) as log:
        days = [day for _, day in await log.partitions()]
    # Yesterday's (read to the end, older than retention 0) is gone; today and a week on exist.
    assert days == [today + dt.timedelta(days=n) for n in range(8)]
