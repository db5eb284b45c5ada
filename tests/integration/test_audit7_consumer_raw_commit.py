"""A handler that ends the runner's transaction with SQL of its own (``COMMIT``, ``ROLLBACK``
through the driver's execute, which no driver refuses), on SQLite, PostgreSQL (psycopg, sync
and async; asyncpg) and MariaDB, fed by the in-process broker; and a handler that closes its SQLite connection.

The runner claims the batch's inbox rows before its handlers (PostgreSQL: one statement).
A raw COMMIT of the first handler commits the second message's claim too: a failure of the
second handler then no longer rolls its claim back (asyncpg runs it in autocommit, its
partial writes stick), and every redelivery of it is skipped as a duplicate: lost. A raw
ROLLBACK undoes the first message, then acked as applied. Either must be the handler's
failed attempt, seen right after it returns, and no message lost.
"""

from __future__ import annotations

import logging
import sqlite3
from typing import Any

import psycopg
import pytest

from outboxer.consumer import Delivery
from outboxer.testing import make_message
from tests.integration.test_consumer_handler_errors import (
    KINDS,
    applied,
    consume,
    database,
    dead_letters,
    inbox_ids,
    is_async,
    mysql_db,  # noqa: F401 -- fixtures database() asks for
    pg_db,  # noqa: F401
    sqlite_db,  # noqa: F401
)


def end_sync(conn: Any, sql: str) -> None:
    if isinstance(conn, sqlite3.Connection | psycopg.Connection):
        conn.execute(sql)
    else:
        with conn.cursor() as cursor:  # PyMySQL
            cursor.execute(sql)


#: SQLite and MariaDB claim each message just before its handler and saw the statement already.
POSTGRES = ["postgres-psycopg", "postgres-asyncpg", "postgres-psycopg-async"]


@pytest.mark.parametrize("kind", POSTGRES)
@pytest.mark.parametrize("sql", ["COMMIT", "ROLLBACK"])
def test_a_handler_that_ends_the_transaction_with_sql_loses_no_message(
    request: pytest.FixtureRequest, kind: str, sql: str, caplog: pytest.LogCaptureFixture
) -> None:
    db = database(request, kind)
    _, driver, record_it = KINDS[kind]
    first, second = sorted(
        (make_message("t", {"n": 1}, key="a"), make_message("t", {"n": 2}, key="b")),
        key=lambda m: m.id,
    )
    ended: list[int] = []
    failed: list[int] = []

    def step(message: Delivery) -> str:
        if message.id == first.id and not ended:
            ended.append(message.attempt)
            return "end"
        if message.id == second.id and not failed:
            failed.append(message.attempt)
            return "fail"
        return "record"

    def handler(message: Delivery, conn: Any) -> None:
        what = step(message)
        record_it(message, conn)
        if what == "end":
            end_sync(conn, sql)
        elif what == "fail":
            raise RuntimeError("first attempt fails")

    async def handler_async(message: Delivery, conn: Any) -> None:
        what = step(message)
        await record_it(message, conn)
        if what == "end":
            await conn.execute(sql)
        elif what == "fail":
            raise RuntimeError("first attempt fails")

    with caplog.at_level(logging.WARNING, logger="outboxer.consumer"):
        _, stats = consume(
            db,
            handler_async if is_async(kind) else handler,
            first,
            second,
            concurrency=1,
            max_attempts=5,
            async_driver=driver,
        )
    assert sorted(row[0] for row in applied(db)) == [1, 2], (
        "each message applied exactly once (a message recorded in the inbox but not applied "
        "is skipped for ever)"
    )
    assert dead_letters(db) == []
    assert inbox_ids(db) == {str(first.id), str(second.id)}
    assert stats.applied + stats.duplicates == 2
    # The ending handler's own attempt failed, named in the log as the handler's bug.
    [ended] = [r for r in caplog.records if "HandlerEndedTransaction" in r.getMessage()]
    assert f"message {first.id}" in ended.getMessage()
    assert "a handler must not end it" in ended.getMessage()
    assert ended.levelno == logging.ERROR


def test_a_handler_that_closes_the_sqlite_connection_does_not_wedge_the_worker(
    sqlite_db: str,  # noqa: F811 -- the fixture
) -> None:
    """sqlite3 has no ``closed``: the closed connection was never seen as lost, every later
    call failed (the dead letter's too) and the worker retried it for ever. The others
    (psycopg, asyncpg, PyMySQL) know theirs closed: a lost connection, reopened."""
    db = sqlite_db
    record_it = KINDS["sqlite"][2]
    first, second = sorted(
        (make_message("t", {"n": 1}, key="a"), make_message("t", {"n": 2}, key="b")),
        key=lambda m: m.id,
    )
    closed: list[int] = []

    def handler(message: Delivery, conn: Any) -> None:
        record_it(message, conn)
        if message.id == first.id and not closed:
            closed.append(message.attempt)
            conn.close()

    _, stats = consume(db, handler, first, second, concurrency=1, max_attempts=2)
    assert closed
    assert sorted(row[0] for row in applied(db)) == [1, 2]
    assert dead_letters(db) == []
    assert inbox_ids(db) == {str(first.id), str(second.id)}
    assert stats.applied == 2
