"""MariaDB: the relay's store under a session time zone that is not the server's system one
(a server configured with ``default-time-zone = '+00:00'`` on a host whose clock is local)."""

from __future__ import annotations

import pytest

from outboxer.stores.mysql import MySQLStore
from tests.conftest import mysql_connect


async def _session_time_zone(store: MySQLStore, zone: str) -> None:
    """Set the time zone of the pool's one idle connection, the one the next call takes."""
    await store.connect()
    assert store._pool.size == 1 and store._pool.freesize == 1
    async with store._pool.acquire() as conn, conn.cursor() as cursor:
        await cursor.execute("SET SESSION time_zone = %s", (zone,))


@pytest.mark.parametrize("zone", ["+05:00", "-07:00"])
async def test_oldest_transaction_age_ignores_the_session_time_zone(
    mysql_url: str, zone: str
) -> None:
    # INFORMATION_SCHEMA.INNODB_TRX.trx_started is in the server's system time zone, NOW() in
    # the session's: compared as they are, a transaction open for a second was reported as
    # open for hours (or for a negative time).
    holder = mysql_connect(mysql_url)
    store = MySQLStore(mysql_url, pool_size=1)
    try:
        with holder.cursor() as cursor:
            cursor.execute("INSERT INTO outbox_destinations (destination) VALUES ('held')")
        await _session_time_zone(store, zone)
        age = await store.oldest_transaction()
        assert 0.0 <= age < 60.0, f"a transaction open for under a minute reported as {age}s"
    finally:
        holder.rollback()
        holder.close()
        await store.close()
