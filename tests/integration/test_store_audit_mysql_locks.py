"""MariaDB: a settle that waits too long for a lock (error 1205) and a claim on a table of
many PUBLISHED rows, against the real server."""

from __future__ import annotations

from typing import Any

import pytest

from outboxer.errors import StoreError
from outboxer.stores.base import Failure, StoreDataError
from outboxer.stores.mysql import MySQLStore
from tests.conftest import mysql_connect


async def _on_the_store_session(store: MySQLStore, *statements: str) -> list[Any]:
    """Run ``statements`` on the pool's one idle connection (the next call takes it); the
    rows of the last one."""
    await store.connect()
    assert store._pool.size == 1 and store._pool.freesize == 1
    async with store._pool.acquire() as conn, conn.cursor() as cursor:
        for statement in statements:
            await cursor.execute(statement)
        found: list[Any] = list(await cursor.fetchall())
    return found


def _insert(url: str, sql: str) -> None:
    conn = mysql_connect(url, autocommit=True)
    try:
        with conn.cursor() as cursor:
            cursor.execute(sql)
    finally:
        conn.close()


async def test_a_settle_that_times_out_on_a_lock_can_be_retried(mysql_url: str) -> None:
    # 1205 is an outage the relay retries (StoreError, not StoreDataError), the settle is
    # rolled back whole (MariaDB undoes only the statement that timed out), no attempt is
    # counted, and the rows stay in flight under the lease until the retry settles them.
    _insert(
        mysql_url,
        "INSERT INTO outbox (id, destination, topic, payload, content_type) "
        "SELECT UUID(), 'default', 't', 'x', 'a' FROM seq_1_to_2",
    )
    store = MySQLStore(mysql_url, pool_size=1)
    holder = mysql_connect(mysql_url)
    try:
        claim = await store.claim("default", "r1", 10, 60, True)
        first, second = (m.stored_seq for m in claim)
        await _on_the_store_session(store, "SET SESSION innodb_lock_wait_timeout = 1")
        with holder.cursor() as cursor:
            cursor.execute(f"SELECT seq FROM outbox WHERE seq = {second} FOR UPDATE")
        with pytest.raises(StoreError) as raised:
            await store.settle(
                "default", claim.lease, [first], [Failure(second, "x", 0, False)], [], 5
            )
        assert not isinstance(raised.value, StoreDataError)
        assert raised.value.__cause__ is not None and raised.value.__cause__.args[0] == 1205
        holder.rollback()
        with holder.cursor() as cursor:
            cursor.execute("SELECT status, attempts, lease FROM outbox ORDER BY seq")
            assert cursor.fetchall() == ((("PROCESSING", 0, claim.lease.token),) * 2)
        holder.rollback()
        result = await store.settle(
            "default", claim.lease, [first], [Failure(second, "x", 0, False)], [], 5
        )
        assert (result.published, result.failed, result.lost) == (1, 1, 0)
    finally:
        holder.rollback()
        holder.close()
        await store.close()


async def test_a_claim_reads_no_published_row(mysql_url: str) -> None:
    # The claim walks ready_idx (destination, unfinished, seq): the published history that
    # retention keeps is not read, however long it is.
    _insert(
        mysql_url,
        "INSERT INTO outbox (id, destination, topic, `key`, payload, content_type, status) "
        "SELECT UUID(), 'default', 't', CONCAT('k', seq % 50), 'x', 'a', 'PUBLISHED' "
        "FROM seq_1_to_30000",
    )
    _insert(
        mysql_url,
        "INSERT INTO outbox (id, destination, topic, `key`, payload, content_type) "
        "SELECT UUID(), 'default', 't', CONCAT('k', seq % 50), 'x', 'a' FROM seq_1_to_10",
    )
    _insert(mysql_url, "ANALYZE TABLE outbox")
    store = MySQLStore(mysql_url, pool_size=1)
    try:
        await _on_the_store_session(store, "FLUSH STATUS")
        claim = await store.claim("default", "r1", 100, 60, True)
        assert len(claim) == 10
        counters = dict(
            await _on_the_store_session(
                store,
                "SELECT VARIABLE_NAME, VARIABLE_VALUE FROM information_schema.SESSION_STATUS "
                "WHERE VARIABLE_NAME LIKE 'HANDLER_READ%'",
            )
        )
        read = sum(int(value) for value in counters.values())
        assert read < 1000, counters
    finally:
        await store.close()
