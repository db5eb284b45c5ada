"""Retention of the consumer's suspect rows (inbox_suspects) on the real SQLite, PostgreSQL
and MariaDB. A suspect row whose message is never delivered again (the broker dropped it,
an operator purged the queue) was kept for ever: nothing but that message's next delivery
deletes it. The inbox's retention now deletes rows first seen longer ago than
``inbox_retention``, in bounded batches, and passes over a row a consumer's upsert in
flight holds instead of waiting for it."""

from __future__ import annotations

import asyncio
import sqlite3
import uuid
from typing import Any

import psycopg
import pytest

from outboxer.config import load_settings
from outboxer.relay import delete_finished
from outboxer.stores import create_store
from tests.conftest import mysql_connect

DAY = 86400.0
GROUP = "billing"
KINDS = {"sqlite": "sqlite_url", "postgres": "pg_url", "mysql": "mysql_url"}

#: first_seen this long ago, as each database writes it.
OLD = {
    "sqlite": "(julianday('now') - 2440587.5) * 86400.0 - 40 * 86400.0",
    "postgres": "now() - interval '40 days'",
    "mysql": "UTC_TIMESTAMP(6) - INTERVAL 40 DAY",
}
#: The upsert of Session.suspect_attempt (consumer.sql), as a consumer's transaction runs it.
UPSERT = {
    "postgres": "INSERT INTO outboxer.inbox_suspects AS s (consumer, message_id) "
    "VALUES (%s, %s) ON CONFLICT (consumer, message_id) DO UPDATE SET deaths = s.deaths + 1",
    "mysql": "INSERT INTO inbox_suspects (consumer, message_id) VALUES (%s, %s) "
    "ON DUPLICATE KEY UPDATE deaths = deaths + 1",
}


def _table(kind: str) -> str:
    return "outboxer.inbox_suspects" if kind == "postgres" else "inbox_suspects"


def _run(kind: str, db: str, sql: str, rows: list[tuple[Any, ...]] | None = None) -> list[Any]:
    """``sql`` once (or once per row of ``rows``), committed; the rows it returned."""
    if kind == "sqlite":
        with sqlite3.connect(db.removeprefix("sqlite:///")) as lite:
            if rows is not None:
                lite.executemany(sql.replace("%s", "?"), rows)
                return []
            return lite.execute(sql).fetchall()
    if kind == "postgres":
        with psycopg.connect(db) as conn:
            if rows is not None:
                conn.cursor().executemany(sql, rows)
                return []
            return conn.execute(sql).fetchall()
    conn = mysql_connect(db)
    try:
        with conn.cursor() as cursor:
            if rows is not None:
                cursor.executemany(sql, rows)
                result: list[Any] = []
            else:
                cursor.execute(sql)
                result = list(cursor.fetchall())
        conn.commit()
        return result
    finally:
        conn.close()


def _fill(kind: str, db: str, old: int, young: int) -> tuple[list[str], list[str]]:
    """``old`` suspect rows first seen 40 days ago, ``young`` ones just now; their ids."""
    old_ids = [str(uuid.uuid4()) for _ in range(old)]
    young_ids = [str(uuid.uuid4()) for _ in range(young)]
    _run(
        kind,
        db,
        f"INSERT INTO {_table(kind)} (consumer, message_id, deaths, first_seen) "
        f"VALUES (%s, %s, 1, {OLD[kind]})",
        [(GROUP, i) for i in old_ids],
    )
    _run(
        kind,
        db,
        f"INSERT INTO {_table(kind)} (consumer, message_id) VALUES (%s, %s)",
        [(GROUP, i) for i in young_ids],
    )
    return old_ids, young_ids


def _left(kind: str, db: str) -> set[str]:
    return {str(row[0]) for row in _run(kind, db, f"SELECT message_id FROM {_table(kind)}")}


@pytest.mark.parametrize("kind", list(KINDS))
def test_retention_deletes_old_suspect_rows_in_bounded_batches(
    kind: str, request: pytest.FixtureRequest
) -> None:
    db: str = request.getfixturevalue(KINDS[kind])
    _, young = _fill(kind, db, old=5, young=2)
    settings = load_settings({"db": db, "inbox_retention": "7d", "cleanup_batch": "2"}, environ={})

    async def scenario() -> int:
        async with create_store(db) as store:
            # Each statement deletes at most cleanup_batch rows: one round of the relay's
            # loop (cleanup_inbox) takes 2 here, and the loop goes on while a batch is full.
            assert await store.cleanup_inbox(settings.inbox_retention, 2) == 2
            return await delete_finished(store, settings)

    assert asyncio.run(asyncio.wait_for(scenario(), timeout=8)) == 3
    assert _left(kind, db) == set(young), "only the rows first seen past the retention go"


@pytest.mark.parametrize("kind", ["postgres", "mysql"])
def test_retention_passes_over_a_suspect_row_a_consumer_upsert_holds(
    kind: str, request: pytest.FixtureRequest
) -> None:
    db: str = request.getfixturevalue(KINDS[kind])
    old, young = _fill(kind, db, old=3, young=1)
    held = old[0]
    consumer = psycopg.connect(db) if kind == "postgres" else mysql_connect(db)
    try:
        # The message comes again: its consumer's suspect_attempt upsert, not committed yet,
        # holds the row's lock.
        consumer.cursor().execute(UPSERT[kind], (GROUP, held))

        async def cleanup() -> int:
            async with create_store(db) as store:
                return await asyncio.wait_for(store.cleanup_inbox(7 * DAY, 100), timeout=3)

        assert asyncio.run(cleanup()) == 2, "the rows nobody holds go; the held one is left"
        consumer.commit()
    finally:
        consumer.close()
    assert _left(kind, db) == {held, *young}, "a later round deletes it"
