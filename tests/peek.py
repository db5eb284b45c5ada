"""A test's own SQL on a real database beside the code under test (SQLite, PostgreSQL or
MySQL by the URL): each statement committed at once, so no snapshot or transaction stays
open between a test's steps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tests.integration.test_http_api import connect_sync


@dataclass(frozen=True)
class Row:
    """An outbox row's state as a test reads it."""

    status: str
    attempts: int
    locked_by: str | None
    last_error: str | None


class Peek:
    def __init__(self, url: str) -> None:
        self.url = url
        self.dialect = (
            "sqlite"
            if url.startswith("sqlite")
            else ("mysql" if url.startswith("mysql") else "postgres")
        )
        self.conn = connect_sync(url)

    def close(self) -> None:
        self.conn.close()

    def _run(self, sql: str) -> list[tuple[Any, ...]]:
        cursor = self.conn.cursor()
        try:
            cursor.execute(sql)
            found = list(cursor.fetchall()) if cursor.description else []
        finally:
            cursor.close()
        self.conn.commit()
        return found
