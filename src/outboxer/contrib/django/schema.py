"""The migration operation that creates outboxer's schema in a Django database.

It runs outboxer's own migration files for the connection's vendor (the SQL ``outboxer
schema apply`` runs and ``outboxer schema sql`` prints, rendered with the configured schema
and table names) and records each in ``<table>_migrations``, skipping the versions recorded
there already: a database that ``outboxer schema apply`` set up first is left as it is.

Each Django migration of this app pins the outboxer versions it brings per dialect, so
``migrate`` stays repeatable and an upgrade arrives as a new Django migration: when
outboxer gains a migration file, a new Django migration here raises the pins
(tests/contrib/test_django.py fails until one does).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from django.db import router
from django.db.migrations.operations.base import Operation

from outboxer.contrib.django import conf
from outboxer.errors import SchemaError
from outboxer.stores import Store, create_store
from outboxer.stores.mysql import _SCHEMA_LOCK_WAIT, schema_lock_name
from outboxer.stores.pgpartitions import PARTITIONED
from outboxer.stores.postgres import schema_lock
from outboxer.stores.sqlfiles import migrations, render, statements

#: A URL of each dialect: only names and SQL are taken from these stores, never a connection.
_PLACEHOLDER_URLS = {
    "postgres": "postgresql://localhost/",
    "mysql": "mysql://localhost/outboxer",
    "sqlite": "sqlite:///outboxer.db",
}


def dialect_store(dialect: str) -> Store:
    """A store of ``dialect`` with the configured names, for its DDL (it never connects).

    The names only (``conf.outbox_names()``), not ``outboxer_settings()``: that one derives the
    database URL, which an in-memory SQLite database (Django's test database) has none of."""
    names = conf.outbox_names()
    return create_store(_PLACEHOLDER_URLS[dialect], schema=names.schema, table=names.table)


class ApplyOutboxerSchema(Operation):
    """Apply outboxer's migrations up to the pinned version of the connection's dialect."""

    reversible = False
    reduces_to_sql = True

    def __init__(self, *, postgres: int, mysql: int, sqlite: int) -> None:
        self.versions = {"postgres": postgres, "mysql": mysql, "sqlite": sqlite}

    def deconstruct(self) -> tuple[str, list[Any], dict[str, int]]:
        return (self.__class__.__qualname__, [], dict(self.versions))

    def state_forwards(self, app_label: str, state: Any) -> None:
        return None  # no model state: the tables are outboxer's, not Django models

    def describe(self) -> str:
        pins = ", ".join(f"{name} {version}" for name, version in self.versions.items())
        return f"Apply outboxer's schema migrations ({pins})"

    def database_forwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        connection = schema_editor.connection
        if not router.allow_migrate(connection.alias, app_label):
            return
        dialect = conf.dialect(connection.alias)
        store = dialect_store(dialect)
        tokens = store.tokens()
        # PostgreSQL runs a migration file as one script (its functions hold semicolons);
        # MySQL's and SQLite's drivers take one statement at a time.
        split = (lambda sql: [sql]) if dialect == "postgres" else statements

        def run(sql: str) -> None:
            schema_editor.execute(sql, params=None)  # None: no %-formatting of the SQL

        if schema_editor.collect_sql:  # sqlmigrate: SQL only, no locks
            self._apply(schema_editor, dialect, store, tokens, split, run)
        elif dialect == "postgres":
            # The locks `outboxer schema apply` takes, in its order (postgres.lock_schema):
            # the schema's, whose shared objects (the schema, inbox, dead letters) another
            # table's apply may be creating, then the table's. Held until the migration's
            # transaction ends (Django runs each in one on PostgreSQL).
            schema_editor.execute(
                "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))",
                params=[schema_lock(store.schema)],
            )
            run(f"SELECT pg_advisory_xact_lock({store.lock_key('schema')})")
            self._apply(schema_editor, dialect, store, tokens, split, run)
        elif dialect == "mysql":
            # The session lock `outboxer schema apply` takes: MySQL's DDL commits statement by
            # statement, so a second migrate (or apply) reading the recorded versions before
            # this one recorded them ran the same ALTERs again and failed half-way.
            with _mysql_schema_lock(schema_editor.connection, store.table):
                self._apply(schema_editor, dialect, store, tokens, split, run)
        else:  # SQLite: one writer at a time already
            self._apply(schema_editor, dialect, store, tokens, split, run)

    def _apply(
        self,
        schema_editor: Any,
        dialect: str,
        store: Store,
        tokens: dict[str, str],
        split: Callable[[str], list[str]],
        run: Callable[[str], None],
    ) -> None:
        """The pending migrations up to the pin, each recorded; under the locks taken."""
        connection = schema_editor.connection
        for sql in split(render(store.migrations_table_sql, tokens)):
            run(sql)
        done = set() if schema_editor.collect_sql else self._recorded(connection, tokens)
        layout = _postgres_layout(schema_editor) if dialect == "postgres" else None
        for migration in migrations(dialect, layout):
            if migration.version in done or migration.version > self.versions[dialect]:
                continue
            for sql in split(render(migration.sql, tokens)):
                run(sql)
            run(store.record_migration_sql(tokens["migrations"], migration.version, migration.name))

    @staticmethod
    def _recorded(connection: Any, tokens: dict[str, str]) -> set[int]:
        with connection.cursor() as cursor:
            cursor.execute(f"SELECT version FROM {tokens['migrations']}")
            return {int(row[0]) for row in cursor.fetchall()}

    def database_backwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        raise NotImplementedError("outboxer's schema is never dropped by a migration")


@contextlib.contextmanager
def _mysql_schema_lock(connection: Any, table: str) -> Iterator[None]:
    """GET_LOCK of ``outboxer schema apply`` (mysql.schema_lock_name) on Django's session,
    released however the migration ends: a failed one in a long-lived process (a test run,
    ``call_command``) must not keep every later apply waiting."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT DATABASE()")
        [database] = cursor.fetchone()
        name = schema_lock_name(database, table)
        cursor.execute("SELECT GET_LOCK(%s, %s)", [name, _SCHEMA_LOCK_WAIT])
        if cursor.fetchone()[0] != 1:
            raise SchemaError(
                f"another process has been applying outboxer's schema for {_SCHEMA_LOCK_WAIT}s"
            )
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute("SELECT RELEASE_LOCK(%s)", [name])


def _postgres_layout(schema_editor: Any) -> str | None:
    """The outbox's table layout, as ``outboxer schema apply`` picks it: the existing
    table's, or for a new one, partitioned when ``OUTBOXER["partitioned"]`` says so. A new
    partitioned table has its default partition only: the relay's cleanup (or ``outboxer
    cleanup``) makes the ranges, moving any rows written meanwhile into them."""
    current = conf.outboxer_settings()
    if schema_editor.collect_sql:  # sqlmigrate: no database to look at
        return PARTITIONED if current.partitioned else None
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(
            "SELECT c.relkind FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = %s AND c.relname = %s",
            [current.schema, current.table],
        )
        row = cursor.fetchone()
    kind = row[0] if row else None
    if kind == "r" and current.partitioned:
        raise SchemaError(
            f"the outbox {current.schema}.{current.table} exists as a plain table; "
            'OUTBOXER["partitioned"] creates a new table only. To move this one: '
            "`outboxer schema migrate-partitioned` (README: Partitioned outbox)"
        )
    return PARTITIONED if kind == "p" or (kind is None and current.partitioned) else None
