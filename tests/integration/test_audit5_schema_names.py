"""Audit 5, schema lifecycle: custom schema and table names that the settings accept
(upper case, reserved words, the longest) through `schema migrate-partitioned`. The move
renamed the old table without quoting its new name: an upper-case name was folded to lower
case, the next statement looked for the quoted one, and every table or schema named with
a capital letter could not be migrated at all."""

from __future__ import annotations

import asyncio

import psycopg
import pytest

from outboxer.enqueue import Outbox
from outboxer.stores.postgres import PostgresStore
from outboxer.stores.sqlfiles import quote_ident

NAMES = [
    ("Billing", "Orders"),
    ("select", "order"),
    ("S" * 41, "T" * 41),
]


@pytest.mark.parametrize(("schema", "table"), NAMES)
def test_migrate_partitioned_with_custom_names(pg_url: str, schema: str, table: str) -> None:
    outbox = Outbox(schema=schema, table=table)

    async def run() -> None:
        async with PostgresStore(pg_url, schema=schema, table=table) as store:
            await store.apply_schema()
        with psycopg.connect(pg_url) as conn:
            published = outbox.enqueue(conn, "t", {"n": 0}, key="k")
        async with PostgresStore(pg_url, schema=schema, table=table) as store:
            claim = await store.claim("default", "relay", 1, 60, False)
            assert [m.id for m in claim] == [published.id]
            await store.settle("default", claim.lease, [claim[0].stored_seq], [], [], 5)
        with psycopg.connect(pg_url) as conn:
            pending = outbox.enqueue(conn, "t", {"n": 1}, key="k")

        report = await PostgresStore(pg_url, schema=schema, table=table).migrate_to_partitioned()
        assert (report.moved, report.kept_as) == (1, f"{table}_plain")

        with psycopg.connect(pg_url) as conn:
            after = outbox.enqueue(conn, "t", {"n": 2}, key="k")
            history = conn.execute(
                f"SELECT id FROM {quote_ident(schema)}.{quote_ident(report.kept_as)}"
            ).fetchall()
            assert [row[0] for row in history] == [published.id, pending.id]
        async with PostgresStore(pg_url, schema=schema, table=table) as store:
            await store.check_schema()
            assert await store.is_partitioned()
            assert await store.apply_schema() == []
            claim = await store.claim("default", "relay", 10, 60, False)
            assert [m.id for m in claim] == [pending.id, after.id], "the key's order"

    asyncio.run(run())
