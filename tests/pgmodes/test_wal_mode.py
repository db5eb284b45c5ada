"""The WAL outbox against a private PostgreSQL with wal_level=logical."""

from __future__ import annotations

import psycopg
import pytest

from outboxer.enqueue import Outbox
from outboxer.errors import StoreError
from outboxer.stores.pgwal import PgWal
from outboxer.streamrelay import StreamSource
from outboxer.streamtesting import (
    StreamContract,
    StreamHarness,
    drain,
    numbers,
    running_stream_relay,
    stream_book,
    wait_until,
)


class WalHarness(StreamHarness):
    def __init__(self, url: str, outbox: Outbox, slot_prefix: str) -> None:
        super().__init__(url, outbox)
        self.slot_prefix = slot_prefix

    def wal(self) -> PgWal:
        return PgWal(self.url, slot_prefix=self.slot_prefix, keepalive_seconds=0.05)

    def source(self, destination: str) -> StreamSource:
        return self.wal().reader(destination)

    def relay_args(self, destination: str) -> list[str]:
        return [
            "--mode",
            "wal",
            "--database",
            self.url,
            "--destination",
            destination,
            "--slot-prefix",
            self.slot_prefix,
        ]


@pytest.fixture
async def harness(logical_url: str) -> WalHarness:
    prefix = logical_url.rsplit("/", 1)[1]
    result = WalHarness(
        logical_url, Outbox(mode="wal", destinations=("default", "alpha", "beta")), prefix
    )
    async with result.wal() as wal:
        assert isinstance(wal, PgWal)
        for destination in ("default", "alpha", "beta"):
            assert await wal.create_slot(destination)
    return result


class TestWalContract(StreamContract):
    pass


async def test_wal_mode_writes_no_table(harness: WalHarness) -> None:
    """No outbox table: the only tables are the stream relay's own (failures, dead letters,
    their migrations), and a message that is published leaves no row in them."""
    with psycopg.connect(harness.url) as conn:
        harness.outbox.enqueue(conn, "orders", {"n": 1})
        tables = conn.execute(
            "SELECT tablename FROM pg_tables "
            "WHERE schemaname NOT IN ('pg_catalog', 'information_schema') ORDER BY 1"
        ).fetchall()
    assert tables == [
        ("outbox_pgstream_migrations",),
        ("outbox_stream_dead_letters",),
        ("outbox_stream_failures",),
    ]
    assert numbers(await drain(harness, "default", 1)) == [1]
    with psycopg.connect(harness.url) as conn:
        rows = conn.execute(
            "SELECT (SELECT count(*) FROM outboxer.outbox_stream_failures) + "
            "(SELECT count(*) FROM outboxer.outbox_stream_dead_letters)"
        ).fetchone()
    assert rows == (0,)


async def test_slot_moves_only_after_the_broker_confirmed(harness: WalHarness) -> None:
    with psycopg.connect(harness.url) as conn:
        harness.outbox.enqueue(conn, "orders", {"n": 1})
    slot = f"{harness.slot_prefix}_default"
    with psycopg.connect(harness.url, autocommit=True) as conn:
        before = conn.execute(
            "SELECT confirmed_flush_lsn FROM pg_replication_slots WHERE slot_name = %s", (slot,)
        ).fetchone()
        reader = harness.wal().reader("default")
        await reader.connect()
        try:
            entries = await reader.read(100)  # read, not yet confirmed
        finally:
            await reader.close()
        assert [e.message.topic for e in entries if e.message] == ["orders"]
        unmoved = conn.execute(
            "SELECT confirmed_flush_lsn FROM pg_replication_slots WHERE slot_name = %s", (slot,)
        ).fetchone()
        assert unmoved == before
        assert numbers(await drain(harness, "default", 1)) == [1]
        moved = conn.execute(
            "SELECT confirmed_flush_lsn > %s FROM pg_replication_slots WHERE slot_name = %s",
            (before[0] if before else None, slot),
        ).fetchone()
        assert moved == (True,)


async def test_missing_slot_is_a_clear_error(harness: WalHarness) -> None:
    with pytest.raises(StoreError, match="does not exist"):
        await harness.wal().reader("nowhere").connect()


async def test_keepalive_lets_the_slot_pass_other_writes(harness: WalHarness) -> None:
    """Transactions without outbox messages send nothing through pgoutput: without the
    keepalive the slot would hold the WAL of every other write forever."""
    with psycopg.connect(harness.url) as conn:
        conn.execute("CREATE TABLE business (n int)")
        conn.execute("INSERT INTO business SELECT generate_series(1, 1000)")
    slot = f"{harness.slot_prefix}_default"
    with psycopg.connect(harness.url, autocommit=True) as conn:
        wal_now = conn.execute("SELECT pg_current_wal_lsn()").fetchone()
        assert await drain(harness, "default", 1, timeout=0.5) == []
        passed = conn.execute(
            "SELECT confirmed_flush_lsn >= %s FROM pg_replication_slots WHERE slot_name = %s",
            (wal_now[0] if wal_now else None, slot),
        ).fetchone()
    assert passed == (True,)


async def test_slot_of_another_database_is_refused(harness: WalHarness, logical_pg: str) -> None:
    other = harness.url.rsplit("/", 1)[0] + "/postgres"
    with pytest.raises(StoreError, match="another database"):
        async with PgWal(other, slot_prefix=harness.slot_prefix) as wal:
            assert isinstance(wal, PgWal)
            await wal.create_slot("default")


async def test_failure_rows_behind_the_slot_are_dropped_at_start(harness: WalHarness) -> None:
    """A relay that died after advancing the slot, before deleting the failure rows of the
    messages it passed, leaves rows no read reaches: the next start drops them, and keeps
    those of messages still ahead of the slot."""
    insert = (
        "INSERT INTO outboxer.outbox_stream_failures "
        "(mode, destination, seq, message_id, attempts, last_error, pass_lsn) "
        "VALUES ('wal', 'default', %s, gen_random_uuid(), 3, 'x', %s)"
    )
    with psycopg.connect(harness.url) as conn:
        conn.execute(insert, (1, 1))  # behind the slot: stale
        conn.execute(insert, (2, 2**62))  # ahead of it: its message is still to come
    async with running_stream_relay(harness, "default", max_attempts=3) as (_, relay):
        assert await wait_until(lambda: relay.stats.commits >= 1, 10)  # a keepalive passed
        assert relay.failing == 1
    _, failures = await stream_book(harness, "default")
    assert list(failures) == [2]
    with psycopg.connect(harness.url) as conn:
        left = conn.execute("SELECT seq FROM outboxer.outbox_stream_failures").fetchall()
    assert left == [(2,)]


async def test_second_relay_on_one_slot_is_refused(harness: WalHarness) -> None:
    first = harness.wal().reader("default")
    await first.connect()
    try:
        with pytest.raises(StoreError, match="already being read"):
            await harness.wal().reader("default").connect()
    finally:
        await first.close()
    again = harness.wal().reader("default")
    await again.connect()  # the lock went with the first relay's session
    await again.close()
