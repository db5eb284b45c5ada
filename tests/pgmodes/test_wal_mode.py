"""The WAL outbox against a private PostgreSQL with wal_level=logical."""

from __future__ import annotations

import psycopg
import pytest

from outboxer.enqueue import Outbox
from outboxer.errors import StoreError
from outboxer.stores.pgwal import PgWal
from outboxer.streamrelay import StreamSource
from outboxer.streamtesting import StreamContract, StreamHarness, drain, numbers


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
    with psycopg.connect(harness.url) as conn:
        harness.outbox.enqueue(conn, "orders", {"n": 1})
        tables = conn.execute(
            "SELECT count(*) FROM pg_tables WHERE schemaname NOT IN ('pg_catalog', 'information_schema')"
        ).fetchone()
    assert tables == (0,)
    assert numbers(await drain(harness, "default", 1)) == [1]


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
