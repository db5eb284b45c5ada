"""outboxer's Django app: its migrations against `outboxer schema apply` on the real PostgreSQL,
MariaDB and SQLite, and the app's own tests under Django's test runner on each.

Django runs in subprocesses (tests/contrib/django_project): its settings are process-wide,
and other tests of this suite configure Django their own way.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
import sqlite3
import subprocess
import sys
import uuid
from typing import Any

import psycopg
import pytest

from outboxer.stores import create_store
from outboxer.stores.sqlfiles import migrations
from outboxer.stores.sqlite import sqlite_path
from tests.conftest import mysql_connect
from tests.services import free_port

ROOT = pathlib.Path(__file__).resolve().parents[2]
SETTINGS = "tests.contrib.django_project.settings"


def django(
    url: str,
    *args: str,
    test_database: str | None = None,
    environ: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """``python -m django ARGS`` in the test project, on the database at ``url``."""
    env = dict(os.environ, OUTBOXER_TEST_DJANGO_DB=url, PYTHONPATH=str(ROOT), **(environ or {}))
    if test_database:
        env["OUTBOXER_TEST_DJANGO_TEST_DB"] = test_database
    return subprocess.run(
        [sys.executable, "-m", "django", *args, f"--settings={SETTINGS}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def check(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result.stdout + result.stderr


@pytest.fixture
def empty_pg_url(pg_url: str) -> str:
    """A fresh PostgreSQL database without the outbox schema."""
    with psycopg.connect(pg_url) as conn:
        conn.execute("DROP SCHEMA outboxer CASCADE")
    return pg_url


@pytest.fixture
def empty_sqlite_url(tmp_path: pathlib.Path) -> str:
    return f"sqlite:///{tmp_path / 'django.db'}"


# ----- the schema the migrations create -------------------------------------------------------


def pg_catalog(url: str) -> dict[str, Any]:
    with psycopg.connect(url) as conn:

        def rows(sql: str) -> list[tuple[Any, ...]]:
            return sorted(conn.execute(sql).fetchall(), key=repr)

        return {
            "columns": rows(
                "SELECT table_name, column_name, data_type, is_nullable, column_default, "
                "is_identity FROM information_schema.columns WHERE table_schema = 'outboxer'"
            ),
            "indexes": rows("SELECT indexdef FROM pg_indexes WHERE schemaname = 'outboxer'"),
            "constraints": rows(
                "SELECT conrelid::regclass::text, conname, pg_get_constraintdef(oid) "
                "FROM pg_constraint WHERE connamespace = 'outboxer'::regnamespace"
            ),
            "functions": rows(
                "SELECT pg_get_functiondef(oid) FROM pg_proc "
                "WHERE pronamespace = 'outboxer'::regnamespace"
            ),
            "triggers": rows(
                "SELECT pg_get_triggerdef(t.oid) FROM pg_trigger t JOIN pg_class c "
                "ON c.oid = t.tgrelid WHERE c.relnamespace = 'outboxer'::regnamespace "
                "AND NOT t.tgisinternal"
            ),
            "unlogged": rows(
                "SELECT relname, relpersistence FROM pg_class "
                "WHERE relnamespace = 'outboxer'::regnamespace"
            ),
            "recorded": rows("SELECT version, name FROM outboxer.outbox_migrations"),
        }


OUTBOXER_MYSQL_TABLES = (
    "outbox",
    "outbox_migrations",
    "outbox_destinations",
    "outbox_keys",
    "inbox",
    "dead_letters",
)


def mysql_catalog(url: str) -> dict[str, Any]:
    conn = mysql_connect(url)
    try:
        with conn.cursor() as cursor:
            tables = {}
            for table in OUTBOXER_MYSQL_TABLES:
                cursor.execute(f"SHOW CREATE TABLE `{table}`")
                tables[table] = cursor.fetchone()[1]
            cursor.execute("SELECT version, name FROM outbox_migrations ORDER BY version")
            return {"tables": tables, "recorded": cursor.fetchall()}
    finally:
        conn.close()


def sqlite_catalog(url: str) -> dict[str, Any]:
    conn = sqlite3.connect(sqlite_path(url))
    try:
        found = conn.execute(
            "SELECT type, name, sql FROM sqlite_master WHERE name NOT LIKE 'django%' "
            "AND name NOT LIKE 'auth%' AND name NOT LIKE 'shop%' AND name <> 'sqlite_sequence' "
            "ORDER BY name"
        ).fetchall()
        recorded = conn.execute("SELECT version, name FROM outbox_migrations").fetchall()
        return {"objects": found, "recorded": recorded}
    finally:
        conn.close()


CATALOGS = {"postgres": pg_catalog, "mysql": mysql_catalog, "sqlite": sqlite_catalog}
EMPTY = {"postgres": "empty_pg_url", "mysql": "mysql_empty_url", "sqlite": "empty_sqlite_url"}


def drop_outboxer(dialect: str, url: str) -> None:
    """Remove what migrate created for outboxer, and Django's record of it."""
    statements = {
        "postgres": ["DROP SCHEMA outboxer CASCADE"],
        "mysql": [f"DROP TABLE `{table}`" for table in OUTBOXER_MYSQL_TABLES],
        "sqlite": [
            f"DROP TABLE {table}"
            for table in ("outbox", "outbox_migrations", "inbox", "dead_letters")
        ],
    }[dialect] + ["DELETE FROM django_migrations WHERE app = 'outboxer'"]
    if dialect == "postgres":
        with psycopg.connect(url) as conn:
            for statement in statements:
                conn.execute(statement)
    elif dialect == "mysql":
        conn = mysql_connect(url, autocommit=True)
        try:
            for statement in statements:
                conn.cursor().execute(statement)
        finally:
            conn.close()
    else:
        with contextlib.closing(sqlite3.connect(sqlite_path(url))) as lite, lite:
            for statement in statements:
                lite.execute(statement)


def schema_apply(url: str, *, check_first: bool = False) -> list[str]:
    """`outboxer schema apply`: the migrations it applied (after the relay's start-up check)."""

    async def apply() -> list[str]:
        async with create_store(url) as store:
            if check_first:
                await store.check_schema()  # raises SchemaError if a migration is missing
            return await store.apply_schema()

    return asyncio.run(apply())


@pytest.mark.parametrize("dialect", ["postgres", "mysql", "sqlite"])
def test_migrate_creates_what_schema_apply_creates(
    request: pytest.FixtureRequest, dialect: str
) -> None:
    url: str = request.getfixturevalue(EMPTY[dialect])
    catalog = CATALOGS[dialect]
    check(django(url, "migrate", "outboxer"))
    by_django = catalog(url)
    assert schema_apply(url, check_first=True) == [], "the relay's check passes, none missing"
    drop_outboxer(dialect, url)
    assert schema_apply(url)  # `outboxer schema apply` on the same, empty database ...
    assert catalog(url) == by_django  # ... creates the very same schema
    # And migrate on a database that `outboxer schema apply` set up first: nothing changes.
    output = check(django(url, "migrate", "outboxer"))
    assert "Applying outboxer.0001_initial... OK" in output
    assert catalog(url) == by_django


def test_the_django_migrations_bring_every_outboxer_migration() -> None:
    """When outboxer gains a migration file, this app needs a Django migration that applies it."""
    import importlib
    import pkgutil

    from outboxer.contrib.django import migrations as package
    from outboxer.contrib.django.schema import ApplyOutboxerSchema

    pins: dict[str, int] = {}
    for module in sorted(name for _, name, _ in pkgutil.iter_modules(package.__path__)):
        migration = importlib.import_module(f"{package.__name__}.{module}").Migration
        for operation in migration.operations:
            if isinstance(operation, ApplyOutboxerSchema):
                pins = operation.versions
    assert pins == {dialect: migrations(dialect)[-1].version for dialect in CATALOGS}, (
        "add a Django migration with ApplyOutboxerSchema pinned to the newest versions"
    )


# ----- the app's own tests, under Django's test runner ------------------------------------------


def test_migrate_creates_the_partitioned_outbox_that_schema_apply_creates(
    empty_pg_url: str,
) -> None:
    """OUTBOXER["partitioned"] (here OUTBOXER_PARTITIONED): migrate creates the partitioned
    layout; the relay's upkeep (schema apply runs the same) then makes its partitions."""
    url = empty_pg_url

    def partitioned_apply() -> list[str]:
        async def apply() -> list[str]:
            async with create_store(url) as store:
                return await store.apply_schema(partitioned=True)

        return asyncio.run(apply())

    check(django(url, "migrate", "outboxer", environ={"OUTBOXER_PARTITIONED": "true"}))
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT relkind FROM pg_class WHERE oid = 'outboxer.outbox'::regclass")
        assert row.fetchone() == ("p",)
    assert partitioned_apply() == [], "every migration of the layout applied and recorded"
    by_django = pg_catalog(url)
    drop_outboxer("postgres", url)
    assert partitioned_apply()
    assert pg_catalog(url) == by_django
    # A later migrate finds the partitioned table and keeps its layout, setting or not.
    with psycopg.connect(url) as conn:
        conn.execute("DELETE FROM outboxer.outbox_migrations WHERE version = 8")
        conn.execute("DROP INDEX outboxer.outbox_status_idx")
        conn.execute("DELETE FROM django_migrations WHERE name = '0005_status_index'")
    check(django(url, "migrate", "outboxer"))
    assert pg_catalog(url) == by_django


def test_migrate_refuses_to_make_a_plain_outbox_partitioned(empty_pg_url: str) -> None:
    check(django(empty_pg_url, "migrate", "outboxer", "0001"))
    result = django(empty_pg_url, "migrate", "outboxer", environ={"OUTBOXER_PARTITIONED": "true"})
    assert result.returncode != 0
    assert "exists as a plain table" in result.stderr
    assert "outboxer schema migrate-partitioned" in result.stderr


@pytest.mark.parametrize("vendor", ["postgres", "mysql", "sqlite"])
def test_django_test_runner(
    request: pytest.FixtureRequest, vendor: str, tmp_path: pathlib.Path
) -> None:
    url: str = request.getfixturevalue(EMPTY[vendor])  # Django creates its test database beside it
    name = f"test_outboxer_{uuid.uuid4().hex[:12]}"
    if vendor == "sqlite":
        name = str(tmp_path / f"{name}.db")
    output = check(
        django(url, "test", "tests.contrib.django_project.shop", "--noinput", test_database=name)
    )
    assert "OK" in output


# ----- outboxer_consume --http ------------------------------------------------------------------


def test_outboxer_consume_serves_its_group_s_metrics_over_http(pg_url: str) -> None:
    """``manage.py outboxer_consume --http`` (a subprocess: SIGTERM stops it as a deployment
    would) applies the messages with the ORM and counts them on ``/metrics``."""
    import signal
    import time
    import urllib.request

    import redis

    import outboxer
    from outboxer import Relay, load_settings
    from tests.services import require

    require("redis")
    broker = "redis://127.0.0.1:6379/0"
    check(django(pg_url, "migrate"))  # the shop's tables; outboxer's are there already
    topic = f"django-http-{uuid.uuid4().hex[:12]}"
    group = f"g-{topic}"
    with psycopg.connect(pg_url) as conn:
        for order in range(3):
            outboxer.enqueue(conn, topic, {"order": order}, key=f"c-{order}")
    settings = load_settings({"db": pg_url, "broker": broker}, environ={})
    assert asyncio.run(Relay.from_settings(settings).drain()).published == 3
    port = free_port()
    env = dict(os.environ, OUTBOXER_TEST_DJANGO_DB=pg_url, PYTHONPATH=str(ROOT))
    process = subprocess.Popen(
        [sys.executable, "-m", "django", "outboxer_consume", f"--settings={SETTINGS}",
         "--broker", broker, "--group", group, "--topic", topic, "--http", f"127.0.0.1:{port}",
         "tests.contrib.django_project.shop.handlers:ship"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        text = ""
        while f'outboxer_consumer_acked_total{{group="{group}"}} 3.0' not in text:
            assert process.poll() is None and time.monotonic() < deadline, text
            time.sleep(0.2)
            with (
                contextlib.suppress(OSError),  # not listening yet
                urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as got,
            ):
                text = got.read().decode()
    finally:
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=30)
        with redis.Redis.from_url(broker) as client:
            client.delete(topic)
    assert process.returncode == 0, output
    assert f"consumer {group}: applied 3, duplicates 0, dead letters 0" in output
    assert f'outboxer_consumer_applied_total{{group="{group}"}} 3.0' in text
    assert f'outboxer_consumer_dead_lettered_total{{group="{group}"}} 0.0' in text
    with psycopg.connect(pg_url) as conn:
        shipped = conn.execute('SELECT "order" FROM shop_shipment').fetchall()
    assert sorted(shipped) == [(0,), (1,), (2,)]
