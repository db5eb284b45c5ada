"""A row abandoned when its lease expires (its relay died at its last attempt) while later
rows of its key were in flight under the same dead relay: the key's order must survive an
operator's requeue of the abandoned row, and the later rows must not stay PROCESSING for
good. MariaDB here; test_store_audit_sqlite_recovery runs the same on SQLite, and
test_store_audit_pg_recovery on PostgreSQL's two layouts."""

from __future__ import annotations

from typing import Any

import pytest

import outboxer
from tests.conftest import mysql_connect
from tests.relaying import enqueue, rows

MAX_ATTEMPTS = 2


def expire_leases(url: str) -> None:
    """Every lease ran out an hour ago (its relay died)."""
    if url.startswith("postgres"):
        import psycopg

        with psycopg.connect(url, autocommit=True) as pg:
            pg.execute(
                "UPDATE outboxer.outbox SET locked_until = locked_until - interval '1 hour' "
                "WHERE status = 'PROCESSING'"
            )
        return
    if url.startswith("sqlite"):
        import sqlite3

        from outboxer.stores.sqlite import sqlite_path

        conn: Any = sqlite3.connect(sqlite_path(url))
        sql = "UPDATE outbox SET locked_until = locked_until - 3600 WHERE status = 'PROCESSING'"
    else:
        conn = mysql_connect(url)
        sql = (
            "UPDATE outbox SET locked_until = locked_until - INTERVAL 3600 SECOND "
            "WHERE status = 'PROCESSING'"
        )
    try:
        conn.cursor().execute(sql)
        conn.commit()
    finally:
        conn.close()


async def check_order_after_abandoned_recovery(url: str, abandoned_blocks: bool) -> None:
    first, second = enqueue(url, ("t", "k"), ("t", "k"))
    async with outboxer.create_store(url) as store:

        async def claim(relay: str) -> Any:
            return await store.claim(
                "default", relay, 10, 60, abandoned_blocks, max_attempts=MAX_ATTEMPTS
            )

        assert [m.id for m in await claim("dies-1")] == [first.id, second.id]
        expire_leases(url)
        recovered = await claim("dies-2")  # the key's first row, alone, its second attempt
        assert recovered.recovered and [m.id for m in recovered] == [first.id]
        expire_leases(url)
        gave_up = await claim("r3")
        assert [row.id for row in gave_up.abandoned] == [first.id]
        # Its relay died: the second row must not stay in flight under it for good.
        for _ in range(3):
            await claim("r4")
        held = {row["id"]: row for row in await rows(url)}[second.id]
        assert held["status"] != "PROCESSING" or held["locked_by"] in ("r3", "r4"), held
        if abandoned_blocks:
            # An operator requeues the abandoned row: it goes first, then the second.
            assert await store.requeue(["default"], ["ABANDONED"], None) == 1
            taken = [m.id for m in await claim("r5")]
            assert taken[:1] == [first.id], f"the key's second row went first: {taken}"


@pytest.mark.parametrize("abandoned_blocks", [True, False])
async def test_mysql_key_order_after_a_row_abandoned_at_recovery(
    mysql_url: str, abandoned_blocks: bool
) -> None:
    await check_order_after_abandoned_recovery(mysql_url, abandoned_blocks)
