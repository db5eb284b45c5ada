"""Fixtures: a fresh database per test (PostgreSQL clones a template that has the schema)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from outboxer.stores import create_store
from tests.services import require

PG_ADMIN = os.environ.get("OUTBOXER_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
# One template per pytest process: several runs (a developer's and CI's, or parallel
# worktrees) share the server, and one run must not drop the template another is cloning.
TEMPLATE = f"outboxer_test_template_{os.getpid()}"
MYSQL_ADMIN = os.environ.get("OUTBOXER_TEST_MYSQL", "mysql://root@127.0.0.1:3306/test")


def _apply_schema(url: str) -> None:
    async def apply() -> None:
        async with create_store(url) as store:
            await store.apply_schema()

    asyncio.run(apply())


def _pg_url(database: str) -> str:
    return PG_ADMIN.rsplit("/", 1)[0] + "/" + database


def _admin_execute(*statements: str) -> None:
    import psycopg

    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        for statement in statements:
            conn.execute(statement)


@pytest.fixture(scope="session")
def pg_template() -> Iterator[str]:
    """A database with the outbox schema applied, cloned by every test that needs PostgreSQL."""
    require("postgresql")
    _admin_execute(f"DROP DATABASE IF EXISTS {TEMPLATE}", f"CREATE DATABASE {TEMPLATE}")
    _apply_schema(_pg_url(TEMPLATE))
    yield TEMPLATE
    _admin_execute(f"DROP DATABASE IF EXISTS {TEMPLATE} WITH (FORCE)")


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
    _apply_schema(url)
    yield url


def mysql_connect(url: str, **options: Any) -> Any:
    """A PyMySQL connection to the database of a mysql:// URL (not in autocommit)."""
    import pymysql

    from outboxer.stores.mysql import mysql_connect_args

    return pymysql.connect(**mysql_connect_args(url), **options)


async def aiomysql_connect(url: str) -> Any:
    """An aiomysql connection to the database of a mysql:// URL (not in autocommit)."""
    import aiomysql

    from outboxer.stores.mysql import mysql_connect_args

    args = mysql_connect_args(url)
    return await aiomysql.connect(db=args.pop("database"), **args)


@pytest.fixture
def mysql_empty_url() -> Iterator[str]:
    """URL of a fresh, empty MySQL database (MySQL cannot clone one), dropped afterwards."""
    require("mariadb")
    name = f"outboxer_t_{uuid.uuid4().hex[:12]}"
    admin = mysql_connect(MYSQL_ADMIN, autocommit=True)
    try:
        admin.cursor().execute(f"CREATE DATABASE {name}")
    finally:
        admin.close()
    try:
        yield MYSQL_ADMIN.rsplit("/", 1)[0] + "/" + name
    finally:
        _drop_mysql_database(name)


def _drop_mysql_database(name: str) -> None:
    """DROP DATABASE, first ending the sessions still in it (a failed test may leave one open
    in a transaction, and DROP would wait for it), like PostgreSQL's WITH (FORCE)."""
    import pymysql

    admin = mysql_connect(MYSQL_ADMIN, autocommit=True)
    try:
        with admin.cursor() as cursor:
            cursor.execute(
                "SELECT ID FROM information_schema.PROCESSLIST "
                "WHERE DB = %s AND ID <> CONNECTION_ID()",
                (name,),
            )
            for (session,) in cursor.fetchall():
                with contextlib.suppress(pymysql.err.OperationalError):  # it ended meanwhile
                    cursor.execute(f"KILL {int(session)}")
            cursor.execute(f"DROP DATABASE IF EXISTS {name}")
    finally:
        admin.close()


@pytest.fixture
def mysql_url(mysql_empty_url: str) -> str:
    """URL of a fresh MySQL database holding an empty outbox (the schema applied, ~40 ms)."""
    _apply_schema(mysql_empty_url)
    return mysql_empty_url


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


@pytest.fixture
def exporter() -> Iterator[Any]:
    """The OpenTelemetry SDK's in-memory span exporter, empty at the start of the test."""
    from tests.otel import memory_exporter

    spans = memory_exporter()
    spans.clear()
    yield spans
    spans.clear()
