"""Inbox retention on PostgreSQL beside a transaction that holds an old inbox entry (an
operator deleting it so that its message is applied again, a consumer's handler locking
it): the cleanup passes over that entry and deletes the others. It waited for the whole
transaction, holding the relay's connection and its cleanup loop."""

from __future__ import annotations

import asyncio

import psycopg

from outboxer.stores.postgres import PostgresStore

INBOX = "outboxer.inbox"
DAY = 86400.0


async def test_inbox_cleanup_skips_an_entry_an_open_transaction_holds(pg_url: str) -> None:
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(
            f"INSERT INTO {INBOX} (consumer, message_id, received_at) "
            "SELECT 'c', gen_random_uuid(), now() - interval '40 days' FROM generate_series(1, 3)"
        )
        [held] = conn.execute(f"SELECT message_id FROM {INBOX} LIMIT 1").fetchone() or [None]
    with psycopg.connect(pg_url) as operator:
        # Not yet committed: the entry is locked until this transaction ends.
        operator.execute(f"DELETE FROM {INBOX} WHERE message_id = %s", (held,))
        async with PostgresStore(pg_url) as store:
            deleted = await asyncio.wait_for(store.cleanup_inbox(7 * DAY, 100), timeout=3)
        assert deleted == 2, "the entries nobody holds go; the held one is left"
        operator.rollback()
    with psycopg.connect(pg_url) as conn:
        rows = conn.execute(f"SELECT message_id FROM {INBOX}").fetchall()
    assert [row[0] for row in rows] == [held], "a later round deletes it"
