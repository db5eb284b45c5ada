"""The reader lock that refuses a second relay on one log reader or slot, when the
connection holding it is lost while the relay keeps running."""

from __future__ import annotations

import psycopg
import pytest

from outboxer.enqueue import Outbox
from outboxer.errors import StoreError
from outboxer.stores.pglog import BEGINNING, PgLog
from outboxer.stores.pgwal import PgWal
from outboxer.streamtesting import StreamHarness, numbers, running_stream_relay, wait_until
from tests.pgmodes.test_log_mode import LogHarness
from tests.pgmodes.test_wal_mode import WalHarness

VISIBLE = 15.0


@pytest.fixture(params=["log", "wal"])
def mode_url(request: pytest.FixtureRequest) -> tuple[str, str]:
    """A mode and a fresh database for it (the WAL outbox needs the private server)."""
    mode = str(request.param)
    return mode, str(request.getfixturevalue("pg_url" if mode == "log" else "logical_url"))


@pytest.fixture
async def harness(mode_url: tuple[str, str]) -> StreamHarness:
    mode, url = mode_url
    if mode == "log":
        async with PgLog(url) as log:
            await log.apply_schema()
        return LogHarness(url, Outbox(mode="log"))
    prefix = url.rsplit("/", 1)[1]
    wal_harness = WalHarness(url, Outbox(mode="wal", destinations=("default",)), prefix)
    async with wal_harness.wal() as wal:
        assert isinstance(wal, PgWal)
        assert await wal.create_slot("default")
    return wal_harness


def _lock_holders(url: str, key: str) -> list[int]:
    """The sessions holding the advisory lock of ``key`` in this (test-private) database.

    By its key: the relay takes other advisory locks for moments (the log's partition
    upkeep, its transaction's lock), and one of them beside the reader lock made a list
    of all of them two long (CI, once)."""
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 1 "
            "AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
            "AND (classid::bigint << 32 | objid::bigint) = hashtextextended(%s, 0)",
            (key,),
        ).fetchall()
    return [int(row[0]) for row in rows]


def _reader_lock_key(harness: StreamHarness) -> str:
    return str(harness.source("default")._lock.key)  # type: ignore[attr-defined]


def _enqueue(harness: StreamHarness, n: int) -> None:
    with psycopg.connect(harness.url) as conn:
        harness.outbox.enqueue(conn, "orders", {"n": n}, key="k")


async def test_reader_lock_lost_is_taken_again(harness: StreamHarness) -> None:
    """The lock lived on an idle connection of its own, never looked at again: when that
    session ended (idle_session_timeout, a proxy dropping idle connections, an operator's
    pg_terminate_backend) the relay went on without it, and a second relay on the same
    reader or slot was no longer refused: both published everything. The relay notices,
    reconnects and takes the lock again, so a second one is still refused."""
    _enqueue(harness, 1)
    async with running_stream_relay(harness, "default") as (broker, relay):
        assert await wait_until(lambda: numbers(broker.messages) == [1], VISIBLE)
        key = _reader_lock_key(harness)
        [holder] = _lock_holders(harness.url, key)
        with psycopg.connect(harness.url, autocommit=True) as admin:
            assert admin.execute("SELECT pg_terminate_backend(%s)", (holder,)).fetchone() == (True,)
        assert await wait_until(
            lambda: _lock_holders(harness.url, key) not in ([], [holder]), VISIBLE
        )
        second = harness.source("default")
        with pytest.raises(StoreError, match="already being read"):
            await second.connect()
        await second.close()
        _enqueue(harness, 2)
        assert await wait_until(lambda: numbers(broker.messages) == [1, 2], VISIBLE)
    assert relay.stats.published == 2


async def test_seek_beside_a_running_relay_is_refused(pg_url: str) -> None:
    """PgLog.seek wrote the stored offset while the reader's relay ran: the relay reads
    from the offset it keeps in memory and stores it forward only, so a seek back (a
    replay) was silently undone by its next commit, and nothing was replayed. It is
    refused while a relay holds the reader; once the relay stops it works."""
    async with PgLog(pg_url) as log:
        await log.apply_schema()
    harness = LogHarness(pg_url, Outbox(mode="log"))
    _enqueue(harness, 1)
    async with running_stream_relay(harness, "default") as (broker, _relay):
        assert await wait_until(lambda: numbers(broker.messages) == [1], VISIBLE)
        async with PgLog(pg_url) as log:
            read_to = await log.offset("default")
            with pytest.raises(StoreError, match="running relay"):
                await log.seek("default")  # back to the beginning: a replay
            assert await log.offset("default") == read_to
    async with PgLog(pg_url) as log:
        assert await log.seek("default") == BEGINNING
    async with running_stream_relay(harness, "default") as (broker, _relay):
        assert await wait_until(lambda: numbers(broker.messages) == [1], VISIBLE)


async def test_message_of_a_rolled_back_savepoint_is_never_published(
    harness: StreamHarness,
) -> None:
    """A message written in a savepoint that rolls back is gone with it; the messages of
    the same transaction before and after the savepoint are published, in order."""
    with psycopg.connect(harness.url) as conn:
        harness.outbox.enqueue(conn, "orders", {"n": 1}, key="k")
        with pytest.raises(RuntimeError), conn.transaction():  # a savepoint
            harness.outbox.enqueue(conn, "orders", {"n": 99}, key="k")
            raise RuntimeError("rolled back to the savepoint")
        harness.outbox.enqueue(conn, "orders", {"n": 2}, key="k")
    _enqueue(harness, 3)
    async with running_stream_relay(harness, "default") as (broker, _relay):
        assert await wait_until(lambda: numbers(broker.messages)[-1:] == [3], VISIBLE)
    assert numbers(broker.messages) == [1, 2, 3]
