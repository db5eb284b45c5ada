"""A relay beside an application on one SQLite file bounds its -wal file.

SQLite never shrinks the -wal file while a connection is open: after one large transaction
of the application's (an outbox burst, or its own data with a few messages), the file kept
that size for as long as the application's connection lived, beside a relay that ran for
weeks. The relay's cleanup now checkpoints and truncates it (SqliteStore.bound_wal); a
reader holding an old snapshot makes that impossible, which the relay says in a warning
without waiting for the reader, and it truncates once the reader has ended.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import outboxer
from outboxer.brokers.memory import memory_broker
from outboxer.stores import sqlite as sqlite_store
from outboxer.stores.sqlite import sqlite_path
from tests.relaying import relay, until

#: A -wal file truncated by the cleanup holds at most the few settles written after it.
NEAR_ZERO = 256 * 1024
#: sqlite.WAL_TRUNCATE_ABOVE (read so, the tests run, and fail, on a relay without it).
WAL_TRUNCATE_ABOVE: int = getattr(sqlite_store, "WAL_TRUNCATE_ABOVE", 8 * 1024 * 1024)


def wal_size(path: str) -> int:
    wal = Path(path + "-wal")
    return wal.stat().st_size if wal.exists() else 0


@pytest.fixture
def application(sqlite_url: str) -> Iterator[sqlite3.Connection]:
    """The application's connection (Python's defaults), open through the whole test as a
    long-lived application's is: SQLite deletes the -wal file when its last one closes."""
    conn = sqlite3.connect(sqlite_path(sqlite_url))
    conn.execute("CREATE TABLE ledger (id INTEGER PRIMARY KEY, entry BLOB NOT NULL)")
    yield conn
    conn.close()


def large_transaction(conn: sqlite3.Connection, messages: int) -> list[outboxer.Message]:
    """One transaction of the application's that grows the -wal past the truncation bound:
    12 MB of its own rows and ``messages`` outbox rows."""
    conn.executemany("INSERT INTO ledger (entry) VALUES (?)", [(bytes(4096),) for _ in range(3000)])
    sent = [
        outboxer.enqueue(conn, "audit17.wal", {"n": n}, key=f"k{n % 4}") for n in range(messages)
    ]
    conn.commit()
    return sent


def fresh_broker() -> str:
    name = f"audit17-wal-{uuid.uuid4().hex[:8]}"
    memory_broker(name).clear()
    return f"memory://{name}"


async def test_the_relays_cleanup_truncates_the_wal_after_a_burst(
    sqlite_url: str, application: sqlite3.Connection
) -> None:
    path = sqlite_path(sqlite_url)
    large_transaction(application, 200)
    burst = wal_size(path)
    assert burst > WAL_TRUNCATE_ABOVE, f"the burst left a -wal of {burst} bytes only"
    broker = fresh_broker()
    running = relay(sqlite_url, broker, cleanup_interval=0.2)
    task = asyncio.create_task(running.run())
    try:
        await until(
            lambda: len(memory_broker(broker.removeprefix("memory://")).messages) == 200,
            "the relay published the burst",
            5,
        )
        await until(
            lambda: wal_size(path) < NEAR_ZERO,
            f"the relay's cleanup truncated the -wal file (still {wal_size(path)} bytes)",
            5,
        )
        assert running.metrics is not None
        registry = running.metrics.registry

        def gauge_near_zero() -> bool:
            size = registry.get_sample_value("outboxer_sqlite_wal_bytes", {"database": "default"})
            return size is not None and size < NEAR_ZERO

        # Set once the round's checkpoint has answered, a moment after the file shrank.
        await until(gauge_near_zero, "the gauge of the -wal file near zero", 2)
    finally:
        running.stop()
        await asyncio.wait_for(task, 5)
    # The application's connection is still open: the file was truncated, not deleted.
    assert application.execute("SELECT count(*) FROM ledger").fetchone()[0] == 3000


async def test_a_reader_on_an_old_snapshot_is_warned_about_and_waited_for_by_no_one(
    sqlite_url: str,
    application: sqlite3.Connection,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The reader's snapshot predates the burst: its frames cannot be copied into the
    database, the relay's cleanup rounds leave the file, publish on meanwhile, warn naming
    the snapshot, and truncate the file once the reader has ended."""
    caplog.set_level(logging.DEBUG, logger="outboxer.relay")
    monkeypatch.setattr(sqlite_store, "WAL_STUCK_WARNING", 0.3, raising=False)
    path = sqlite_path(sqlite_url)
    reader = sqlite3.connect(path, isolation_level=None)
    reader.execute("BEGIN")
    reader.execute("SELECT count(*) FROM ledger").fetchone()  # its snapshot, held
    large_transaction(application, 10)
    broker = fresh_broker()
    received = memory_broker(broker.removeprefix("memory://")).messages
    running = relay(sqlite_url, broker, cleanup_interval=0.05)
    task = asyncio.create_task(running.run())
    try:
        await until(
            lambda: "old snapshot" in caplog.text, "a warning about the reader's snapshot", 5
        )
        [warning] = [
            r.getMessage()
            for r in caplog.records
            if r.levelno == logging.WARNING and "-wal" in r.getMessage()
        ]
        assert "could not be truncated" in warning and "old snapshot" in warning
        assert wal_size(path) > WAL_TRUNCATE_ABOVE
        # The relay's loop goes on while the reader holds the WAL: a message enqueued now
        # is published at once, between cleanup rounds that keep failing to truncate.
        await until(lambda: len(received) == 10, "the burst published", 5)
        outboxer.enqueue(application, "audit17.wal", {"n": "after"}, key="k0")
        application.commit()
        started = time.monotonic()
        await until(lambda: len(received) == 11, "a message published beside the reader", 2)
        assert time.monotonic() - started < 1.0
        # Each round gives up at once (PASSIVE): no truncation waiting on the reader.
        assert isinstance(running.store, sqlite_store.SqliteStore)
        round_started = time.monotonic()
        await running.store.bound_wal()
        assert time.monotonic() - round_started < 1.0
        assert wal_size(path) > WAL_TRUNCATE_ABOVE
        reader.execute("COMMIT")
        await until(
            lambda: wal_size(path) < NEAR_ZERO,
            f"the -wal file truncated once the reader ended (still {wal_size(path)} bytes)",
            5,
        )
        assert "truncated" in caplog.text
    finally:
        reader.close()
        running.stop()
        await asyncio.wait_for(task, 5)


async def test_a_truncation_waits_for_a_current_reader_a_bounded_time(
    sqlite_url: str, application: sqlite3.Connection
) -> None:
    """A reader whose snapshot has every frame (copied into the database by the PASSIVE
    checkpoint) still keeps the WAL from restarting: the truncation waits for it at most
    WAL_TRUNCATE_WAIT, holding the application's writers no longer, and succeeds once it
    has ended."""
    path = sqlite_path(sqlite_url)
    large_transaction(application, 1)
    # The application's commit checkpointed the burst; its next one restarts the WAL at the
    # file's start, and the reader's snapshot is that frame, in the WAL.
    application.execute("INSERT INTO ledger (entry) VALUES (x'00')")
    application.commit()
    before = wal_size(path)
    reader = sqlite3.connect(path, isolation_level=None)
    reader.execute("BEGIN")
    reader.execute("SELECT count(*) FROM ledger").fetchone()
    async with outboxer.create_store(sqlite_url) as store:
        assert isinstance(store, sqlite_store.SqliteStore)
        started = time.monotonic()
        size = await store.bound_wal()
        took = time.monotonic() - started
        assert size == before == wal_size(path)
        assert took < sqlite_store.WAL_TRUNCATE_WAIT + 0.9, f"the truncation waited {took:.2f}s"
        # The relay's connection is back to its usual busy timeout after the short one.
        assert await store._run(lambda c: c.execute("PRAGMA busy_timeout").fetchone()[0]) == (
            sqlite_store.BUSY_TIMEOUT_MS
        )
        # The application writes on beside the reader after the refused truncation.
        outboxer.enqueue(application, "audit17.wal", {"n": "beside"}, key="k0")
        application.commit()
        reader.execute("COMMIT")
        reader.close()
        assert await store.bound_wal() == 0 == wal_size(path)
