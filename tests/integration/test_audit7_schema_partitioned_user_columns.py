"""Audit 7, schema safety: `schema migrate-partitioned` rebuilt the outbox with outboxer's
columns only: a column a user had added (a tenant, say) was gone from the live table, the
unfinished rows moved without its values, and writers setting it failed. Now the move
refuses, naming the columns and their types, and changes nothing."""

from __future__ import annotations

import asyncio

import psycopg
import pytest

from outboxer.enqueue import Outbox
from outboxer.errors import SchemaError
from outboxer.stores.postgres import PostgresStore


def test_migrate_partitioned_refuses_user_columns(pg_url: str) -> None:
    with psycopg.connect(pg_url) as conn:
        conn.execute("ALTER TABLE outboxer.outbox ADD COLUMN tenant text")
        conn.execute("ALTER TABLE outboxer.outbox ADD COLUMN region varchar(8)")
        message = Outbox().enqueue(conn, "t", {"n": 1}, key="k")
        conn.execute("UPDATE outboxer.outbox SET tenant = 'acme', region = 'eu'")

    with pytest.raises(SchemaError, match=r"tenant \(text\), region \(character varying\(8\)\)"):
        asyncio.run(PostgresStore(pg_url).migrate_to_partitioned())

    with psycopg.connect(pg_url) as conn:
        kind = conn.execute(
            "SELECT relkind FROM pg_class WHERE oid = 'outboxer.outbox'::regclass"
        ).fetchone()
        assert kind == ("r",), "still the plain table"
        assert conn.execute("SELECT to_regclass('outboxer.outbox_plain')").fetchone() == (None,)
        rows = conn.execute("SELECT id, tenant, region FROM outboxer.outbox").fetchall()
        assert rows == [(message.id, "acme", "eu")]


def test_migrate_partitioned_without_user_columns_still_moves(pg_url: str) -> None:
    with psycopg.connect(pg_url) as conn:
        Outbox().enqueue(conn, "t", {"n": 1})
    report = asyncio.run(PostgresStore(pg_url).migrate_to_partitioned())
    assert report.moved == 1
