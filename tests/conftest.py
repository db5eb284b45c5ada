"""Fixtures: a fresh database per test (cloned from a template that has the schema)."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest

from outboxer.stores import create_store
from tests.services import require

PG_ADMIN = os.environ.get("OUTBOXER_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
TEMPLATE = "outboxer_test_template"


def _pg_url(database: str) -> str:
    return PG_ADMIN.rsplit("/", 1)[0] + "/" + database


def _admin_execute(*statements: str) -> None:
    import psycopg

    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        for statement in statements:
            conn.execute(statement)


@pytest.fixture(scope="session")
def pg_template() -> str:
    """A database with the outbox schema applied, cloned by every test that needs PostgreSQL."""
    require("postgresql")
    _admin_execute(f"DROP DATABASE IF EXISTS {TEMPLATE}", f"CREATE DATABASE {TEMPLATE}")

    async def apply() -> None:
        async with create_store(_pg_url(TEMPLATE)) as store:
            await store.apply_schema()

    asyncio.run(apply())
    return TEMPLATE


@pytest.fixture
def pg_url(pg_template: str) -> Iterator[str]:
    """URL of a fresh PostgreSQL database holding an empty outbox."""
    name = f"outboxer_t_{uuid.uuid4().hex[:12]}"
    _admin_execute(f"CREATE DATABASE {name} TEMPLATE {pg_template}")
    yield _pg_url(name)
    _admin_execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture
def sqlite_url(tmp_path: object) -> Iterator[str]:
    import pathlib

    assert isinstance(tmp_path, pathlib.Path)
    url = f"sqlite:///{tmp_path / 'outbox.db'}"

    async def apply() -> None:
        async with create_store(url) as store:
            await store.apply_schema()

    asyncio.run(apply())
    yield url


@pytest.fixture
async def rabbit_consumer() -> AsyncIterator[object]:
    """A RabbitMQ consumer on a fresh exchange; its ``broker_url`` publishes there."""
    from tests.rabbit import RabbitConsumer

    require("rabbitmq")
    consumer = await RabbitConsumer().start()
    yield consumer
    await consumer.stop()


@pytest.fixture
async def pg_store(pg_url: str) -> AsyncIterator[object]:
    store = create_store(pg_url)
    await store.connect()
    yield store
    await store.close()
