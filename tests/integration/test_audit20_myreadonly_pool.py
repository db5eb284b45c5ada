"""A read-only answer (here 1792, a session whose transactions are READ ONLY: no server-wide
setting, so the shared server serves) closes the connection that gave it and every pooled
connection handed out before it: they reach the server that is no primary (see
test_audit20_myreadonly_failover for the failover itself). The next claim connects anew.

Before, each went back to the pool after its rollback, and the pool handed them out in
turn: every claim failed on them for ever."""

from __future__ import annotations

import pytest

from outboxer.errors import StoreError
from outboxer.stores.mysql import MySQLStore
from tests.conftest import mysql_connect
from tests.relaying import enqueue, until


def _alive(url: str, ids: set[int]) -> set[int]:
    conn = mysql_connect(url)
    try:
        with conn.cursor() as cursor:
            cursor.execute("SELECT id FROM information_schema.processlist")
            return {int(row[0]) for row in cursor.fetchall()} & ids
    finally:
        conn.close()


async def test_a_read_only_answer_replaces_every_pooled_connection(mysql_url: str) -> None:
    [message] = enqueue(mysql_url, ("t", "k"))
    store = MySQLStore(mysql_url)
    await store.connect()
    try:
        ids: set[int] = set()
        # Two pooled connections at once, each read-only from its next transaction on.
        async with store._transaction() as one, store._transaction() as two:
            for cursor in (one, two):
                await cursor.execute("SET SESSION TRANSACTION READ ONLY")
                await cursor.execute("SELECT CONNECTION_ID() AS id")
                ids.add(int((await cursor.fetchone())["id"]))
        assert len(ids) == 2
        with pytest.raises(StoreError) as refused:
            await store.claim("default", "r1", 10, 60.0, False)
        assert refused.value.__cause__ is not None
        assert refused.value.__cause__.args[0] == 1792
        # The other connection answered nothing yet: it goes all the same.
        claim = await store.claim("default", "r1", 10, 60.0, False)
        assert [m.id for m in claim] == [message.id]
        async with store._transaction() as cursor:
            await cursor.execute("SELECT CONNECTION_ID() AS id")
            assert int((await cursor.fetchone())["id"]) not in ids
        await until(lambda: not _alive(mysql_url, ids), "the read-only sessions stayed", 5)
    finally:
        await store.close()
