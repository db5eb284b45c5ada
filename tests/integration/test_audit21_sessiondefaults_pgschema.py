"""Schema changes on PostgreSQL run without the database's ``statement_timeout`` (ALTER
DATABASE … SET statement_timeout, a DBA's guard for the application's queries): cancelled
by it, an index built over a big table, or the partitioned layout's copy, could never
complete, every try."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from outboxer.stores import create_store
from tests.conftest import _admin_execute, _pg_url


@pytest.fixture
def empty_database() -> Iterator[str]:
    name = f"outboxer_t_cap_{uuid.uuid4().hex[:10]}"
    _admin_execute(f"CREATE DATABASE {name}")
    try:
        yield name
    finally:
        _admin_execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


async def test_the_schema_applies_under_a_one_millisecond_statement_timeout(
    empty_database: str,
) -> None:
    async with create_store(_pg_url(empty_database)) as store:
        # Capped once the store's pool is open (its connections made before keep their
        # settings): the schema's own connection, made for the change, meets the cap.
        _admin_execute(f"ALTER DATABASE {empty_database} SET statement_timeout = '1ms'")
        applied = await store.apply_schema()
        assert applied, "nothing was applied to an empty database"
        assert await store.apply_schema() == []  # and again: nothing left to apply
