"""The store contract, with its operators' changes (purge, replay, requeue by filter),
against the real PostgreSQL, SQLite and MariaDB."""

from __future__ import annotations

import sqlite3
from typing import Any

import pytest

from outboxer.stores.sqlite import sqlite_path
from outboxer.testing_admin import StoreAdminContract
from tests.conftest import mysql_connect


class TestPostgresStore(StoreAdminContract):
    table = "outboxer.outbox"

    @pytest.fixture
    def url(self, pg_url: str) -> str:
        return pg_url

    def connect_sync(self, url: str) -> Any:
        import psycopg

        return psycopg.connect(url)

    def shift_sql(self, column: str, seconds: float) -> str:
        return f"UPDATE {self.table} SET {column} = {column} - make_interval(secs => {seconds})"

    def refuse_sql(self, topic: str) -> str:
        return (
            f"ALTER TABLE {self.table} ADD CONSTRAINT refuse CHECK ("
            f"(status <> 'PUBLISHED' OR topic <> '{topic}') AND last_error NOT LIKE '%forbidden text%')"
        )


class TestSqliteStore(StoreAdminContract):
    @pytest.fixture
    def url(self, sqlite_url: str) -> str:
        return sqlite_url

    def connect_sync(self, url: str) -> Any:
        return sqlite3.connect(sqlite_path(url))

    def shift_sql(self, column: str, seconds: float) -> str:
        return f"UPDATE {self.table} SET {column} = {column} - {seconds}"

    def refuse_sql(self, topic: str) -> str:
        # SQLite adds no constraint to a table: a trigger refuses instead (a constraint error).
        return (
            f"CREATE TRIGGER refuse BEFORE UPDATE ON {self.table} "
            f"WHEN (NEW.status = 'PUBLISHED' AND NEW.topic = '{topic}') "
            f"OR NEW.last_error LIKE '%forbidden text%' BEGIN SELECT RAISE(ABORT, 'refused'); END"
        )

    def hold_row(self, url: str, message: Any) -> Any:
        pytest.skip(
            "SQLite has no row locks: a writer holds the whole database, and claims wait for it"
        )


class TestMySQLStore(StoreAdminContract):
    @pytest.fixture
    def url(self, mysql_url: str) -> str:
        return mysql_url

    def connect_sync(self, url: str) -> Any:
        return mysql_connect(url)

    def shift_sql(self, column: str, seconds: float) -> str:
        return f"UPDATE {self.table} SET {column} = {column} - INTERVAL {seconds} SECOND"

    def refuse_sql(self, topic: str) -> str:
        return (
            f"ALTER TABLE {self.table} ADD CONSTRAINT refuse CHECK ("
            f"(status <> 'PUBLISHED' OR topic <> '{topic}') AND last_error NOT LIKE '%forbidden text%')"
        )

    def rows(self, url: str) -> list[dict[str, Any]]:
        # As the contract's, with `key` quoted: KEY is a reserved word in MySQL.
        conn = self.connect_sync(url)
        try:
            cursor = conn.cursor()
            cursor.execute(
                f"SELECT seq, id, `key`, status, attempts, last_error, locked_by "
                f"FROM {self.table} ORDER BY seq"
            )
            names = [d[0] for d in cursor.description]
            return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]
        finally:
            conn.close()
