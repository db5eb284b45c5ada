"""Audit 5, schema lifecycle: `schema apply` of several outbox tables of one PostgreSQL
schema at once (two services deploying together, each with its own table) must all
succeed: they share the schema, the inbox and the dead letters, which each creates IF NOT
EXISTS, and two such creations at once made one fail with a duplicate key of the catalog."""

from __future__ import annotations

import asyncio

import psycopg

from outboxer.stores.pglog import PgLog
from outboxer.stores.postgres import PostgresStore
from outboxer.stores.sqlfiles import migrations


async def _apply_together(*stores: PostgresStore | PgLog) -> list[list[str]]:
    try:
        return list(await asyncio.gather(*(store.apply_schema() for store in stores)))
    finally:
        for store in stores:
            await store.close()


def _tables(url: str, schema: str) -> set[str]:
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = %s", (schema,)
        ).fetchall()
    return {row[0] for row in rows}


def test_two_tables_of_a_new_schema_applied_at_once(pg_url: str) -> None:
    """Both create the schema (CREATE SCHEMA IF NOT EXISTS): one failed with
    pg_namespace_nspname_index."""
    stores = [PostgresStore(pg_url, schema="svc", table=name) for name in ("orders", "billing")]
    applied = asyncio.run(_apply_together(*stores))
    every = [m.name for m in migrations("postgres")]
    assert applied == [every, every]
    assert {"orders", "billing", "inbox", "dead_letters"} <= _tables(pg_url, "svc")


def test_two_tables_of_an_existing_schema_applied_at_once(pg_url: str) -> None:
    """Both create the shared inbox (CREATE TABLE IF NOT EXISTS): one failed with
    pg_type_typname_nsp_index."""
    with psycopg.connect(pg_url) as conn:
        conn.execute("CREATE SCHEMA svc")
    stores = [PostgresStore(pg_url, schema="svc", table=name) for name in ("orders", "billing")]
    asyncio.run(_apply_together(*stores))
    assert {"orders", "billing", "inbox", "dead_letters"} <= _tables(pg_url, "svc")


def test_log_mode_and_default_table_of_a_new_schema_applied_at_once(pg_url: str) -> None:
    """A mode's schema (its own migrations) and an outbox table of the same new schema."""
    asyncio.run(
        _apply_together(
            PostgresStore(pg_url, schema="svc", table="orders"),
            PgLog(pg_url, schema="svc", table="events"),
        )
    )
    assert {"orders", "inbox", "events_log"} <= _tables(pg_url, "svc")


def test_one_modes_schema_applied_twice_at_once_under_repeatable_read(pg_url: str) -> None:
    """Two `stream-relay --apply-schema` of one log-mode outbox, on a database whose default
    isolation is REPEATABLE READ: the second waited for the first's lock, but its snapshot,
    taken by the lock's query before the wait, did not show the first's recorded
    migrations, and it ran them again (DuplicateTableError)."""
    with psycopg.connect(pg_url, autocommit=True) as conn:
        database = conn.execute("SELECT current_database()").fetchone()
        assert database is not None
        conn.execute(
            f"ALTER DATABASE {database[0]} SET default_transaction_isolation = 'repeatable read'"
        )
    applied = asyncio.run(_apply_together(PgLog(pg_url), PgLog(pg_url)))
    # Each folder's migrations in a transaction of their own: either may apply either.
    assert sorted(applied[0] + applied[1]) == ["0001_log", "0001_stream", "0002_claim_check_index"]
