"""The idle relay's wake-up probe on MariaDB (queries.sql: pending_mark) runs every 50 ms:
its cost must not grow with the backlog (it counted every PENDING row, e.g. thousands
held behind an abandoned row), and it must still see every kind of commit of a PENDING row."""

from __future__ import annotations

from typing import Any

import outboxer
from outboxer.stores.mysql import MySQLStore
from tests.conftest import mysql_connect

BACKLOG = 5000


def handler_reads(cursor: Any) -> int:
    cursor.execute("SHOW SESSION STATUS LIKE 'Handler_read%'")
    return sum(int(value) for _, value in cursor.fetchall())


def insert(cursor: Any, count: int) -> None:
    cursor.execute(
        "INSERT INTO outbox (id, topic, `key`, payload, content_type) "
        f"SELECT UUID(), 't', 'k', 'x', 'text/plain' FROM seq_1_to_{count}"
    )


async def test_the_probe_reads_a_bounded_number_of_rows_whatever_the_backlog(
    mysql_url: str,
) -> None:
    conn = mysql_connect(mysql_url, autocommit=True)
    try:
        with conn.cursor() as cursor:
            insert(cursor, BACKLOG)
            async with outboxer.create_store(mysql_url) as store:
                assert isinstance(store, MySQLStore)
                probe = store._sql["pending_mark"]
            # What SHOW STATUS itself reads, to take off.
            own = -handler_reads(cursor) + handler_reads(cursor)
            before = handler_reads(cursor)
            cursor.execute(probe)
            cursor.fetchall()
            read = handler_reads(cursor) - before - own
    finally:
        conn.close()
    # The last 1024 seqs and a few index dives, not the 5000 PENDING rows.
    assert read < 1100, read


async def test_every_commit_of_a_pending_row_wakes_the_relay(mysql_url: str) -> None:
    early = mysql_connect(mysql_url)
    late = mysql_connect(mysql_url, autocommit=True)
    try:
        async with outboxer.create_store(mysql_url) as store:
            assert not await store.wait_for_wakeup("default", 0)  # empty
            with early.cursor() as cursor:
                insert(cursor, 1)  # takes its seq now, commits last
            with late.cursor() as cursor:
                insert(cursor, 1)
            assert await store.wait_for_wakeup("default", 1)
            assert not await store.wait_for_wakeup("default", 0.1)  # nothing new
            early.commit()  # a smaller seq than the last one seen
            assert await store.wait_for_wakeup("default", 1)
            assert not await store.wait_for_wakeup("default", 0.1)
            with late.cursor() as cursor:
                cursor.execute("UPDATE outbox SET status = 'ABANDONED'")
            assert await store.wait_for_wakeup("default", 1)  # the PENDING rows went
            with late.cursor() as cursor:  # an operator's requeue
                cursor.execute(
                    "UPDATE outbox SET status = 'PENDING', updated_at = UTC_TIMESTAMP(6)"
                )
            assert await store.wait_for_wakeup("default", 1)
    finally:
        early.close()
        late.close()
