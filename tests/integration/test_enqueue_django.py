"""The write path on Django connections and on psycopg2, against the real PostgreSQL, SQLite
and MariaDB; what they wrote is read back through outboxer's own store, as the relay claims it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

import outboxer
from outboxer.message import Message
from outboxer.stores import create_store
from outboxer.stores.mysql import mysql_connect_args
from outboxer.stores.sqlite import sqlite_path


def claimed(url: str) -> list[Message]:
    """Every due message, in publish order, as a relay's claim returns them."""

    async def claim() -> list[Message]:
        async with create_store(url) as store:
            return await store.claim("default", "test-relay", 100, 30.0, False)

    return asyncio.run(claim())


def pending(url: str) -> list[dict[str, object]]:
    """The PENDING rows as `outboxer` lists them (a read: no lock waits behind a writer)."""

    async def read() -> list[dict[str, object]]:
        async with create_store(url) as store:
            return await store.list_messages(["PENDING"], 100)

    return asyncio.run(read())


@pytest.fixture(scope="module")
def django_setup() -> None:
    import django
    from django.conf import settings

    # Django's MySQL backend runs on mysqlclient (MySQLdb), its recommended driver, which the
    # dev group installs; PyMySQL in its place would also shadow MySQLdb for the other tests.
    if not settings.configured:
        settings.configure(INSTALLED_APPS=[], USE_TZ=True, DATABASES={})
        django.setup()


def django_settings(vendor: str, url: str) -> dict[str, Any]:
    if vendor == "postgresql":
        return {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": url.rsplit("/", 1)[1],
            "USER": "postgres",
            "HOST": "127.0.0.1",
            "PORT": "5432",
        }
    if vendor == "sqlite":
        return {"ENGINE": "django.db.backends.sqlite3", "NAME": str(sqlite_path(url))}
    args = mysql_connect_args(url)
    return {
        "ENGINE": "django.db.backends.mysql",
        "NAME": args["database"],
        "USER": args["user"],
        "PASSWORD": args.get("password", ""),
        "HOST": args["host"],
        "PORT": str(args["port"]),
    }


@contextlib.contextmanager
def django_database(vendor: str, url: str) -> Iterator[str]:
    """A Django alias for the test's database, gone afterwards; yields the alias."""
    from django.db import connections

    alias = f"outboxer_{uuid.uuid4().hex[:8]}"
    connections.settings[alias] = connections.configure_settings(
        {"default": {}, alias: django_settings(vendor, url)}
    )[alias]
    try:
        yield alias
    finally:
        connections[alias].close()
        del connections[alias]
        del connections.settings[alias]


VENDOR_FIXTURES = {"postgresql": "pg_url", "sqlite": "sqlite_url", "mysql": "mysql_url"}


@pytest.mark.parametrize("vendor", list(VENDOR_FIXTURES))
@pytest.mark.parametrize("handle", ["connections[alias]", "ConnectionProxy"])
def test_django_enqueue_commits_and_rolls_back_with_atomic(
    request: pytest.FixtureRequest, django_setup: None, vendor: str, handle: str
) -> None:
    from django.db import connections, transaction
    from django.utils.connection import ConnectionProxy

    url = request.getfixturevalue(VENDOR_FIXTURES[vendor])
    with django_database(vendor, url) as alias:
        # django.db.connection is a ConnectionProxy of the default alias
        conn = (
            connections[alias]
            if handle == "connections[alias]"
            else ConnectionProxy(connections, alias)
        )
        with transaction.atomic(using=alias):
            first = outboxer.enqueue(
                conn,
                "order.placed",
                {"id": 1, "note": "ünïcode"},
                key="order-1",
                headers={"trace": "t-1"},
            )
            many = outboxer.enqueue_many(
                conn,
                [
                    {"topic": "order.paid", "payload": {"id": n}, "key": f"order-{n % 2}"}
                    for n in range(3)
                ]
                + [{"topic": "blob", "payload": b"\x00raw"}],
            )
            assert pending(url) == [], "not visible before the atomic block commits"
        with pytest.raises(RuntimeError, match="business rule"), transaction.atomic(using=alias):
            outboxer.enqueue(conn, "order.placed", {"id": 2})
            raise RuntimeError("a business rule failed: the block rolls back")
        with pytest.raises(outboxer.DuplicateMessageError), transaction.atomic(using=alias):
            outboxer.enqueue(conn, "order.placed", {"again": True}, message_id=first.id)
        with pytest.raises(TypeError, match="atomic"):
            outboxer.enqueue(conn, "order.placed", {"id": 3})  # autocommit: refused
    messages = claimed(url)
    assert [m.id for m in messages] == [first.id] + [m.id for m in many]
    assert [(m.topic, m.key, m.payload) for m in messages] == [
        (m.topic, m.key, m.payload) for m in [first, *many]
    ]
    assert json.loads(messages[0].payload) == {"id": 1, "note": "ünïcode"}
    assert dict(messages[0].headers) == {"trace": "t-1"}
    assert messages[-1].payload == b"\x00raw"


def test_django_queries_show_in_djangos_query_log(pg_url: str, django_setup: None) -> None:
    """outboxer's SQL runs on Django's cursor: debug tools and the query log see it."""
    from django.db import connections, transaction

    with django_database("postgresql", pg_url) as alias:
        conn = connections[alias]
        conn.force_debug_cursor = True
        with transaction.atomic(using=alias):
            outboxer.enqueue(conn, "order.placed", {"id": 1}, key="order-1")
        assert any(
            "INSERT INTO" in query["sql"] and "outbox" in query["sql"] for query in conn.queries
        )


def test_psycopg2_commit_rollback_and_duplicates(pg_url: str) -> None:
    import psycopg2

    conn = psycopg2.connect(pg_url)
    try:
        first = outboxer.enqueue(conn, "order.placed", {"id": 1}, key="order-1", headers={"h": "v"})
        assert pending(pg_url) == [], "not visible before the caller commits"
        conn.commit()
        outboxer.enqueue(conn, "order.placed", {"id": 2})
        conn.rollback()
        many = outboxer.enqueue_many(
            conn,
            [
                {"topic": "t", "payload": {"n": n}, "key": None if n == 2 else f"k{n % 2}"}
                for n in range(4)
            ]
            + [{"topic": "blob", "payload": b"\x00raw"}],
        )
        conn.commit()
        with pytest.raises(outboxer.DuplicateMessageError):
            outboxer.enqueue(conn, "order.placed", {"again": True}, message_id=first.id)
        conn.rollback()
    finally:
        conn.close()
    messages = claimed(pg_url)
    assert [m.id for m in messages] == [first.id] + [m.id for m in many]
    assert [(m.key, m.payload) for m in messages] == [(m.key, m.payload) for m in [first, *many]]
    assert dict(messages[0].headers) == {"h": "v"}


def test_django_enqueue_many_over_the_key_lock_limit_locks_the_table(
    pg_url: str, django_setup: None
) -> None:
    from django.db import connections, transaction

    from outboxer.enqueue import Outbox

    outbox = Outbox(max_key_locks=2)
    with django_database("postgresql", pg_url) as alias:
        connection = connections[alias]
        with transaction.atomic(using=alias):
            outbox.enqueue_many(
                connection, [{"topic": "t", "payload": {"n": n}, "key": f"k{n}"} for n in range(3)]
            )
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT locktype, mode FROM pg_locks WHERE pid = pg_backend_pid() "
                    "AND (locktype = 'advisory' OR mode = 'ShareRowExclusiveLock')"
                )
                held = cursor.fetchall()
    assert held == [("relation", "ShareRowExclusiveLock")]
    assert sorted(str(row["key"]) for row in pending(pg_url)) == ["k0", "k1", "k2"]
