"""An enqueue whose key ring's source (a KMS) is silent, against the real databases: the
enqueue fails within ``Outbox.key_fetch_timeout`` with EnqueueKeyUnavailableError before
outboxer sends any SQL, so no row is written, no key lock is taken (another writer of the
same message key commits meanwhile), and the caller's transaction stays usable (it rolls
back, and its next enqueue works once the key has come). Before, the enqueue waited for
the KMS for ever, inside the caller's transaction.
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from outboxer import Outbox
from outboxer.crypto import EnqueueKeyUnavailableError, KeyRing
from outboxer.stores.sqlite import sqlite_path
from tests.conftest import mysql_connect
from tests.waiting import wait_for, within

BOUND = 0.5
SLACK = 2.0
KEY = os.urandom(32)


class SilentKms:
    """A key source whose calls wait for ``answer`` (set at the test's end) and then return
    the key."""

    def __init__(self) -> None:
        self.answer = threading.Event()
        self.calls: list[str] = []

    def __call__(self, key_id: str) -> bytes:
        self.calls.append(key_id)
        self.answer.wait(30)
        return KEY

    def outbox(self) -> Outbox:
        return Outbox(encryption=KeyRing.from_callable(self, "k2"), key_fetch_timeout=BOUND)


def fetch_threads() -> int:
    return sum(1 for thread in threading.enumerate() if thread.name == "outboxer-key-fetch")


@pytest.fixture
def kms() -> Iterator[SilentKms]:
    source = SilentKms()
    try:
        yield source
    finally:
        source.answer.set()
        wait_for(lambda: fetch_threads() == 0, 5, "key fetch threads did not end")


@pytest.fixture(params=["postgres", "mysql", "sqlite"])
def db_url(request: pytest.FixtureRequest) -> str:
    fixture = {"postgres": "pg_url", "mysql": "mysql_url", "sqlite": "sqlite_url"}[request.param]
    url: str = request.getfixturevalue(fixture)
    return url


def connect(url: str) -> Any:
    if url.startswith("sqlite"):
        return sqlite3.connect(sqlite_path(url), check_same_thread=False)
    if url.startswith("mysql"):
        return mysql_connect(url)
    import psycopg

    return psycopg.connect(url)


def table(url: str) -> str:
    return "outboxer.outbox" if url.startswith("postgres") else "outbox"


def count(conn: Any, url: str, topic: str) -> int:
    """Rows of ``topic`` as the connection's own transaction sees them."""
    cursor = conn.cursor()
    try:
        cursor.execute(f"SELECT count(*) FROM {table(url)} WHERE topic = '{topic}'")
        return int(cursor.fetchone()[0])
    finally:
        cursor.close()


def in_transaction(conn: Any, url: str) -> bool:
    """Whether the connection's transaction is open and usable (PostgreSQL: not aborted)."""
    if url.startswith("sqlite"):
        return bool(conn.in_transaction)
    if url.startswith("mysql"):
        return bool(conn.server_status & 1)  # SERVER_STATUS_IN_TRANS
    from psycopg.pq import TransactionStatus

    return bool(conn.info.transaction_status == TransactionStatus.INTRANS)


def stored(url: str) -> list[tuple[str, str | None, dict[str, str]]]:
    conn = connect(url)
    try:
        headers = "headers::text" if url.startswith("postgres") else "headers"
        key = "`key`" if url.startswith("mysql") else "key"  # a reserved word there
        cursor = conn.cursor()
        cursor.execute(f"SELECT topic, {headers}, {key} FROM {table(url)} ORDER BY seq")
        return [(topic, key, json.loads(headers)) for topic, headers, key in cursor.fetchall()]
    finally:
        conn.close()


def test_a_silent_kms_fails_the_enqueue_before_any_sql_and_the_transaction_stays_usable(
    kms: SilentKms, db_url: str
) -> None:
    outbox = kms.outbox()
    writer, other = connect(db_url), connect(db_url)
    try:
        if db_url.startswith("sqlite"):
            writer.execute("BEGIN")
        elif db_url.startswith("mysql"):
            writer.begin()  # a read alone leaves MariaDB's in-transaction flag unset
        assert count(writer, db_url, "a") == 0  # the caller's transaction, opened by its read
        assert in_transaction(writer, db_url)
        outcome: list[object] = []
        began = time.monotonic()
        waiting = threading.Thread(
            target=lambda: outcome.append(
                within(
                    BOUND + SLACK,
                    "the enqueue",
                    lambda: outbox.enqueue(writer, "a", {"n": 1}, key="order-1"),
                )
            ),
            daemon=True,
        )
        waiting.start()
        wait_for(lambda: kms.calls == ["k2"], 5, "the enqueue did not ask the KMS")

        def other_writer() -> None:
            Outbox().enqueue(other, "b", {"n": 2}, key="order-1")
            other.commit()

        # The same message key, while the first writer waits for its KMS: no key lock (nor,
        # on SQLite, the write lock) was taken before the key.
        assert within(3, "the other writer of the key", other_writer) is None
        waiting.join(BOUND + SLACK + 1)
        took = time.monotonic() - began
        [error] = outcome
        assert isinstance(error, EnqueueKeyUnavailableError), error
        assert "'k2'" in str(error) and f"key_fetch_timeout={BOUND:g} s" in str(error)
        assert BOUND <= took < BOUND + SLACK, took

        # Nothing written, the transaction still open and usable: the caller rolls it back.
        assert in_transaction(writer, db_url)
        assert count(writer, db_url, "a") == 0
        assert in_transaction(writer, db_url)
        writer.rollback()

        # The KMS answers at last: the ring keeps the key, and the caller's next enqueue works.
        kms.answer.set()
        wait_for(lambda: fetch_threads() == 0, 5, "the late call did not end")
        outbox.enqueue(writer, "a", {"n": 3}, key="order-1")
        writer.commit()
    finally:
        writer.close()
        other.close()
    rows = stored(db_url)
    assert [(topic, key) for topic, key, _ in rows] == [("b", "order-1"), ("a", "order-1")]
    assert rows[1][2]["outboxer-key-id"] == "k2"
    assert kms.calls == ["k2"]


async def _connect_async(driver: str, url: str) -> Any:
    if driver == "asyncpg":
        import asyncpg

        return await asyncpg.connect(url)
    import psycopg

    return await psycopg.AsyncConnection.connect(url)


async def _begin(driver: str, conn: Any) -> Any:
    """Open the caller's transaction with a read of its own; asyncpg's Transaction object."""
    if driver == "asyncpg":
        transaction = conn.transaction()
        await transaction.start()
        await conn.fetchval("SELECT count(*) FROM outboxer.outbox")
        return transaction
    await conn.execute("SELECT count(*) FROM outboxer.outbox")
    return None


async def _own_count(driver: str, conn: Any, topic: str) -> int:
    sql = "SELECT count(*) FROM outboxer.outbox WHERE topic = $1"
    if driver == "asyncpg":
        return int(await conn.fetchval(sql, topic))
    row = await (await conn.execute(sql.replace("$1", "%s"), (topic,))).fetchone()
    return int(row[0])


def _usable(driver: str, conn: Any) -> bool:
    if driver == "asyncpg":
        return bool(conn.is_in_transaction())
    from psycopg.pq import TransactionStatus

    return bool(conn.info.transaction_status == TransactionStatus.INTRANS)


@pytest.mark.parametrize("driver", ["asyncpg", "psycopg"])
def test_enqueue_async_fails_within_its_bound_off_the_event_loop(
    kms: SilentKms, pg_url: str, driver: str
) -> None:
    outbox = kms.outbox()

    async def main() -> float:
        writer = await _connect_async(driver, pg_url)
        other = await _connect_async(driver, pg_url)
        try:
            transaction = await _begin(driver, writer)
            began = time.monotonic()
            task = asyncio.create_task(outbox.enqueue_async(writer, "a", {"n": 1}, key="order-1"))
            while not kms.calls:  # the event loop runs while the KMS is asked
                await asyncio.sleep(0.005)
            assert not task.done()

            async def other_writer() -> None:
                async with other.transaction():
                    await Outbox().enqueue_async(other, "b", {"n": 2}, key="order-1")

            # On the same event loop, while the first writer waits: the same message key.
            await asyncio.wait_for(other_writer(), 3)
            with pytest.raises(EnqueueKeyUnavailableError, match=r"'k2'.*key_fetch_timeout=0.5 s"):
                await task
            took = time.monotonic() - began
            assert _usable(driver, writer)
            assert await _own_count(driver, writer, "a") == 0
            if transaction is not None:
                await transaction.rollback()
            else:
                await writer.rollback()

            kms.answer.set()
            deadline = time.monotonic() + 5
            while fetch_threads():
                assert time.monotonic() < deadline, "the late call did not end"
                await asyncio.sleep(0.01)
            async with writer.transaction():
                await outbox.enqueue_async(writer, "a", {"n": 3}, key="order-1")
            return took
        finally:
            await writer.close()
            await other.close()

    took = within(BOUND + SLACK + 6, "asyncio.run of the writers", lambda: asyncio.run(main()))
    if isinstance(took, BaseException):
        raise took
    assert isinstance(took, float) and BOUND <= took < BOUND + SLACK, took
    rows = stored(pg_url)
    assert [(topic, key) for topic, key, _ in rows] == [("b", "order-1"), ("a", "order-1")]
    assert rows[1][2]["outboxer-key-id"] == "k2"
    assert kms.calls == ["k2"]
