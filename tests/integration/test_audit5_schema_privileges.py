"""Audit 5, schema lifecycle: `schema apply` by a role that owns its schema (a DBA made the
schema for the application's role) but may not create schemas in the database, the
CREATE privilege on a database being granted to nobody by default. CREATE SCHEMA IF NOT
EXISTS checks that privilege before it looks whether the schema exists, so every apply
failed with "permission denied for database", the first one and every later one alike."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from urllib.parse import urlsplit

import psycopg
import pytest

from outboxer.stores.pglog import PgLog
from outboxer.stores.pgpartitions import PARTITIONED
from outboxer.stores.postgres import PostgresStore
from outboxer.stores.sqlfiles import migrations

SCHEMAS = ("app", "app_partitioned", "app_log")


@pytest.fixture
def owner_url(pg_url: str) -> Iterator[str]:
    """The URL of a role that owns the (empty) schemas SCHEMAS of the database, and has no
    other privilege there."""
    role = f"outboxer_owner_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_url, autocommit=True) as admin:
        admin.execute(f"CREATE ROLE {role} LOGIN")
        for schema in SCHEMAS:
            admin.execute(f"CREATE SCHEMA {schema} AUTHORIZATION {role}")
    parts = urlsplit(pg_url)
    try:
        yield parts._replace(netloc=f"{role}@{parts.hostname}:{parts.port}").geturl()
    finally:
        with psycopg.connect(pg_url, autocommit=True) as admin:
            admin.execute(f"DROP OWNED BY {role} CASCADE")
            admin.execute(f"DROP ROLE {role}")


def test_schema_owner_applies_and_reapplies(owner_url: str) -> None:
    async def run() -> None:
        async with PostgresStore(owner_url, schema="app") as store:
            assert await store.apply_schema() == [m.name for m in migrations("postgres")]
            assert await store.apply_schema() == []
            await store.check_schema()
        async with PostgresStore(owner_url, schema="app_partitioned") as store:
            applied = await store.apply_schema(partitioned=True)
            assert applied == [m.name for m in migrations("postgres", PARTITIONED)]
            assert await store.apply_schema() == []
            assert await store.is_partitioned()
        log = PgLog(owner_url, schema="app_log")
        try:
            assert await log.apply_schema() == ["0001_log", "0002_claim_check_index", "0001_stream"]
            assert await log.apply_schema() == []
        finally:
            await log.close()

    asyncio.run(run())
