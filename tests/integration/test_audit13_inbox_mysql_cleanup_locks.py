"""Inbox retention on MariaDB beside consumer batches in flight. The cleanup was one
`DELETE … ORDER BY received_at LIMIT`, for which InnoDB scanned the table (or a whole
consumer's entries) and locked every entry it read: it waited for any batch in flight (its
fresh, uncommitted claims), up to innodb_lock_wait_timeout, holding the relay's connection
and cleanup loop. Now it locks only old entries, passing over those a transaction holds (a
redelivery's duplicate check, as PostgreSQL's SKIP LOCKED does), and deletes them by their
primary key."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from outboxer.inbox import Inbox
from outboxer.stores.mysql import MySQLStore
from tests.conftest import mysql_connect

DAY = 86400.0
GROUP = "billing"


def _fill(url: str, old: int, young: int) -> list[str]:
    """``old`` entries of GROUP past a 7-day retention, ``young`` recent ones; the old ids."""
    ids = [str(uuid.uuid4()) for _ in range(old)]
    conn = mysql_connect(url)
    try:
        with conn.cursor() as cursor:
            cursor.executemany(
                "INSERT INTO inbox (consumer, message_id, received_at) "
                "VALUES (%s, %s, UTC_TIMESTAMP(6) - INTERVAL 40 DAY)",
                [(GROUP, i) for i in ids],
            )
            if young:
                cursor.executemany(
                    "INSERT INTO inbox (consumer, message_id) VALUES (%s, %s)",
                    [(GROUP, str(uuid.uuid4())) for _ in range(young)],
                )
        conn.commit()
    finally:
        conn.close()
    return ids


async def _cleanup(url: str) -> int:
    async with MySQLStore(url) as store:
        return await asyncio.wait_for(store.cleanup_inbox(7 * DAY, 1000), timeout=3)


def _count(url: str) -> int:
    conn = mysql_connect(url)
    try:
        with conn.cursor() as cursor:
            cursor.execute("SELECT COUNT(*) FROM inbox")
            return int(cursor.fetchone()[0])
    finally:
        conn.close()


@pytest.mark.parametrize(("old", "young"), [(3, 0), (300, 300)])
def test_inbox_cleanup_does_not_wait_for_a_batch_in_flight(
    mysql_url: str, old: int, young: int
) -> None:
    _fill(mysql_url, old, young)
    batch = mysql_connect(mysql_url)
    try:
        batch.begin()
        fresh = uuid.uuid4()
        assert Inbox().claim(batch, GROUP, fresh)  # a consumer's batch, not committed yet
        assert asyncio.run(_cleanup(mysql_url)) == old
        batch.commit()
    finally:
        batch.close()
    assert _count(mysql_url) == young + 1, "only the old entries went"


def test_inbox_cleanup_passes_over_an_old_entry_a_transaction_holds(mysql_url: str) -> None:
    ids = _fill(mysql_url, 3, 2)
    batch = mysql_connect(mysql_url)
    try:
        batch.begin()
        # A late redelivery of an old message: the duplicate check holds its entry until
        # the batch (whose other handlers may be slow) ends.
        assert not Inbox().claim(batch, GROUP, ids[1])
        assert asyncio.run(_cleanup(mysql_url)) == 2
        batch.commit()
    finally:
        batch.close()
    assert asyncio.run(_cleanup(mysql_url)) == 1, "a later round deletes it"
    assert _count(mysql_url) == 2
