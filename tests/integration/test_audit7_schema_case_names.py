"""Audit 7, schema safety: PostgreSQL outbox tables whose names differ only in case
("Outbox" next to outbox). The migrations name the table's indexes, constraints and
functions unquoted, folded to lower case, so the second `schema apply` failed on an
obscure "relation outbox_pkey already exists". Now a clear SchemaError, nothing created.
(MariaDB with lower_case_table_names=0 keeps the two apart, indexes being per table;
SQLite's names ignore case, so both spellings are one and the same outbox.)"""

from __future__ import annotations

import asyncio

import psycopg
import pytest

from outboxer.errors import SchemaError
from outboxer.stores import create_store


def _apply(url: str, table: str) -> list[str]:
    async def run() -> list[str]:
        async with create_store(url, table=table) as store:
            return await store.apply_schema()

    return asyncio.run(run())


@pytest.mark.parametrize("table", ["Outbox", "OUTBOX"])
def test_postgres_refuses_a_table_differing_only_in_case(pg_url: str, table: str) -> None:
    with pytest.raises(SchemaError, match=r"outboxer\.outbox, outboxer\.outbox_migrations differ"):
        _apply(pg_url, table)
    with psycopg.connect(pg_url) as conn:
        found = conn.execute(
            "SELECT to_regclass(%s), to_regclass(%s)",
            (f'outboxer."{table}"', f'outboxer."{table}_migrations"'),
        ).fetchone()
    assert found == (None, None), "nothing was created"


def test_postgres_refuses_lower_case_next_to_upper_case(pg_url: str) -> None:
    assert _apply(pg_url, "Orders")
    with pytest.raises(SchemaError, match=r"outboxer\.Orders, outboxer\.Orders_migrations"):
        _apply(pg_url, "orders")
    assert _apply(pg_url, "Orders") == [], "the first one is untouched"
