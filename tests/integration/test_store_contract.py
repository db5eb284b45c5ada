"""The store contract against the real PostgreSQL and SQLite."""

from __future__ import annotations

import sqlite3
from typing import Any

import pytest

from outboxer.stores.sqlite import sqlite_path
from outboxer.testing import StoreContract


class TestPostgresStore(StoreContract):
    table = "outboxer.outbox"

    @pytest.fixture
    def url(self, pg_url: str) -> str:
        return pg_url

    def connect_sync(self, url: str) -> Any:
        import psycopg

        return psycopg.connect(url)

    def shift_sql(self, column: str, seconds: float) -> str:
        return f"UPDATE {self.table} SET {column} = {column} - make_interval(secs => {seconds})"


class TestSqliteStore(StoreContract):
    @pytest.fixture
    def url(self, sqlite_url: str) -> str:
        return sqlite_url

    def connect_sync(self, url: str) -> Any:
        return sqlite3.connect(sqlite_path(url))

    def shift_sql(self, column: str, seconds: float) -> str:
        return f"UPDATE {self.table} SET {column} = {column} - {seconds}"
