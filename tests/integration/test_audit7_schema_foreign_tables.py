"""Audit 7, schema safety: `schema apply` made the shared inbox and dead-letter tables with
CREATE TABLE IF NOT EXISTS, so in a shared schema it silently took over an unrelated table
of the same name (the consumer failed later with an obscure SQL error, or wrote into it).
Now it refuses, naming the table and the columns it lacks, before it changes anything.
And an outbox table named like a shared table ("inbox") was itself taken for the inbox."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import psycopg
import pytest

from outboxer.errors import ConfigError, SchemaError
from outboxer.stores import create_store
from tests.conftest import mysql_connect


def _apply(url: str, **names: str) -> list[str]:
    async def run() -> list[str]:
        async with create_store(url, **names) as store:
            return await store.apply_schema()

    return asyncio.run(run())


@pytest.mark.parametrize(
    ("shared", "foreign_ddl"),
    [
        ("inbox", "CREATE TABLE audit7.inbox (id integer PRIMARY KEY, body text)"),
        ("dead_letters", "CREATE TABLE audit7.dead_letters (seq bigint, consumer text)"),
    ],
)
def test_postgres_refuses_a_foreign_shared_table(
    pg_url: str, shared: str, foreign_ddl: str
) -> None:
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA audit7")
        conn.execute(foreign_ddl)
    with pytest.raises(SchemaError, match=rf'"audit7"\."{shared}" exists but is not outboxer'):
        _apply(pg_url, schema="audit7")
    with psycopg.connect(pg_url) as conn:
        tables = conn.execute(
            "SELECT relname FROM pg_class WHERE relnamespace = 'audit7'::regnamespace "
            "AND relkind = 'r'"
        ).fetchall()
    assert [row[0] for row in tables] == [shared], "nothing was created"


def test_postgres_error_lists_the_missing_columns(pg_url: str) -> None:
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA audit7")
        conn.execute("CREATE TABLE audit7.inbox (consumer text, message_id uuid)")
    with pytest.raises(SchemaError, match=r"lacks column\(s\) received_at\."):
        _apply(pg_url, schema="audit7")


def test_postgres_second_outbox_still_shares_the_inbox(pg_url: str) -> None:
    # The inbox made by the first outbox of the schema is outboxer's own: adopted, as before.
    assert "0002_inbox" in _apply(pg_url, table="orders")


def test_mysql_refuses_a_foreign_inbox_before_any_ddl(mysql_empty_url: str) -> None:
    conn = mysql_connect(mysql_empty_url, autocommit=True)
    try:
        conn.cursor().execute("CREATE TABLE inbox (id INT PRIMARY KEY, body TEXT)")
    finally:
        conn.close()
    with pytest.raises(SchemaError, match=r"`inbox` exists but is not outboxer's.*consumer"):
        _apply(mysql_empty_url)
    conn = mysql_connect(mysql_empty_url)
    try:
        with conn.cursor() as cursor:
            cursor.execute("SHOW TABLES")
            assert [row[0] for row in cursor.fetchall()] == ["inbox"], "DDL commits: none ran"
    finally:
        conn.close()


def test_mysql_refuses_an_outbox_table_named_like_the_inbox(mysql_empty_url: str) -> None:
    # Before: the outbox was created as `inbox` and the inbox's CREATE IF NOT EXISTS passed
    # over it: the consumer's inbox writes went into the outbox table.
    with pytest.raises(ConfigError, match="outboxer's inbox table"):
        _apply(mysql_empty_url, table="inbox")


def test_sqlite_refuses_a_foreign_dead_letters_table(tmp_path: Path) -> None:
    path = tmp_path / "shared.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE Dead_Letters (id INTEGER PRIMARY KEY, what TEXT)")
    with pytest.raises(SchemaError, match=r'"dead_letters" exists but is not outboxer'):
        _apply(f"sqlite:///{path}")
    with sqlite3.connect(path) as conn:
        names = conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall()
    assert [row[0] for row in names] == ["Dead_Letters"], "rolled back, the migrations table too"


@pytest.mark.parametrize("table", ["inbox", "Dead_Letters"])
def test_sqlite_refuses_an_outbox_table_named_like_a_shared_one(tmp_path: Path, table: str) -> None:
    with pytest.raises(ConfigError, match="shared by every outbox"):
        create_store(f"sqlite:///{tmp_path / 'x.db'}", table=table)


@pytest.mark.parametrize("dialect", ["postgres", "mysql", "sqlite"])
def test_expected_columns_are_those_the_migrations_make(
    request: pytest.FixtureRequest, dialect: str
) -> None:
    """The check reads each adopted table's columns from its CREATE statement: they must be
    columns the applied schema has, or the check would refuse outboxer's own tables."""
    from outboxer.stores.sqlfiles import adopted_tables, migrations

    url = request.getfixturevalue(
        {"postgres": "pg_url", "mysql": "mysql_url"}.get(dialect, "sqlite_url")
    )
    expected = {
        token: set(columns)
        for migration in migrations(dialect)
        for token, columns in adopted_tables(migration.sql).items()
    }
    assert {"inbox", "dead_letters"} <= set(expected)
    names = {"outbox": "outbox", "destinations": "outbox_destinations", "keys": "outbox_keys"}
    names |= {"key_slots": "outbox_key_slots", "inbox": "inbox", "dead_letters": "dead_letters"}
    names["inbox_suspects"] = "inbox_suspects"
    for token, columns in expected.items():
        table = names[token]
        if dialect == "postgres":
            with psycopg.connect(url) as conn:
                rows = conn.execute(
                    "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass "
                    "AND attnum > 0 AND NOT attisdropped",
                    (f"outboxer.{table}",),
                ).fetchall()
        elif dialect == "mysql":
            conn = mysql_connect(url)
            try:
                with conn.cursor() as cursor:
                    cursor.execute(f"SHOW COLUMNS FROM `{table}`")
                    rows = cursor.fetchall()
            finally:
                conn.close()
        else:
            with sqlite3.connect(url.removeprefix("sqlite:///")) as lite:
                rows = lite.execute("SELECT name FROM pragma_table_info(?)", (table,)).fetchall()
        found = {row[0].lower() for row in rows}
        # Later migrations may add columns (MySQL's outbox: lease); none adds to the shared ones.
        assert found == columns if token in ("inbox", "dead_letters") else found >= columns, table
