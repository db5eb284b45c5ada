"""A handler that ends the runner's transaction and goes on, on PostgreSQL (psycopg sync and
async, asyncpg) and MariaDB, fed by the in-process broker; and ``dead-letters replay`` of a
handler that ends it.

PostgreSQL claims the batch at once, before its handlers. A handler's ``COMMIT`` then
commits every claim of the batch; psycopg begins a new transaction at its next statement (on
asyncpg, a ``BEGIN`` of the handler's own), so the transaction status the runner reads after
each handler says "in a transaction" all the same. A later handler's failure then rolled
back only the new transaction: the later messages' claims stayed, their redeliveries skipped
as duplicates, never applied. A ``ROLLBACK`` and more writes undid the first messages, which
were acked as applied. The batch's transaction id, read at its claim and before its commit
(and after a failed batch, whether it committed all the same), shows both.

A replay deleted the dead letter before the handler: a handler's COMMIT committed that
removal, and the failed replay lost the dead letter it meant to keep.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sqlite3
from typing import Any

import psycopg
import pytest

from outboxer.consumer import Consumer, Delivery
from outboxer.testing import make_message
from tests.integration.test_consumer_handler_errors import (
    FAST,
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


def extra(message: Delivery) -> Delivery:
    """What the handler writes after it ended the transaction: a row of n=100."""
    return dataclasses.replace(message, payload={"n": 100})


POSTGRES = ["postgres-psycopg", "postgres-asyncpg", "postgres-psycopg-async"]

#: scenario -> what the first message's handler does on its first call, and whether the
#: second message's handler fails its first attempt.
SCENARIOS = {
    # The claims committed, the extra write in a new transaction a later failure rolls back.
    "commit-write-later-fails": ("COMMIT", True, False),
    # The claims committed, then the handler raises: rolled back, nothing to see after it.
    "commit-raise": ("COMMIT", False, True),
    # The first message undone, the extra write and the second message's then committed.
    "rollback-write": ("ROLLBACK", False, False),
}


#: MariaDB claims each message just before its handler: one scenario shows that it stays safe
#: (its claim commits with its writes); the others take the paths of test_audit7/audit5.
CASES = [
    *((scenario, kind) for scenario in SCENARIOS for kind in POSTGRES),
    ("commit-write-later-fails", "mysql"),
    ("rollback-write", "mysql"),
]


@pytest.mark.parametrize(("scenario", "kind"), CASES)
def test_a_handler_that_ends_the_transaction_and_goes_on_loses_no_message(
    request: pytest.FixtureRequest, kind: str, scenario: str
) -> None:
    db = database(request, kind)
    _, driver, record_it = KINDS[kind]
    sql, second_fails, first_raises = SCENARIOS[scenario]
    if kind == "postgres-asyncpg" and not first_raises:
        sql += "; BEGIN"  # asyncpg does not begin one itself: it would run in autocommit
    first, second = sorted(
        (make_message("t", {"n": 1}, key="a"), make_message("t", {"n": 2}, key="b")),
        key=lambda m: m.id,
    )
    calls: dict[str, int] = {"first": 0, "second": 0}

    def step(message: Delivery) -> str:
        name = "first" if message.id == first.id else "second"
        calls[name] += 1
        if calls[name] > 1:
            return "record"
        if name == "first":
            return "end"
        return "fail" if second_fails else "record"

    def handler(message: Delivery, conn: Any) -> None:
        what = step(message)
        if what == "fail":
            raise RuntimeError("first attempt fails")
        record_it(message, conn)
        if what == "end":
            end_sync(conn, sql)
            if first_raises:
                raise RuntimeError("raised after its COMMIT")
            record_it(extra(message), conn)

    async def handler_async(message: Delivery, conn: Any) -> None:
        what = step(message)
        if what == "fail":
            raise RuntimeError("first attempt fails")
        await record_it(message, conn)
        if what == "end":
            await conn.execute(sql)
            if first_raises:
                raise RuntimeError("raised after its COMMIT")
            await record_it(extra(message), conn)

    _, stats = consume(
        db,
        handler_async if is_async(kind) else handler,
        first,
        second,
        concurrency=1,
        max_attempts=5,
        async_driver=driver,
    )
    ns = sorted(row[0] for row in applied(db) if row[0] != 100)
    assert ns == [1, 2], "each message applied exactly once, none acked unapplied or skipped"
    assert dead_letters(db) == []
    assert inbox_ids(db) == {str(first.id), str(second.id)}
    if kind != "mysql":  # there a deadlock-like rollback (PyMySQLSession._rolled_back)
        assert stats.database_errors == 0  # the handler's bug, not the database's


@pytest.mark.parametrize(
    "kind", ["sqlite", "postgres-psycopg", "postgres-asyncpg", "postgres-psycopg-async", "mysql"]
)
def test_a_replay_whose_handler_commits_keeps_the_dead_letter(
    request: pytest.FixtureRequest, kind: str
) -> None:
    db = database(request, kind)
    _, driver, record_it = KINDS[kind]
    message = make_message("t", {"n": 1}, key="a")
    state = {"fixed": False}

    def handler(delivery: Delivery, conn: Any) -> None:
        if not state["fixed"]:
            raise RuntimeError("broken")
        record_it(delivery, conn)
        end_sync(conn, "COMMIT")

    async def handler_async(delivery: Delivery, conn: Any) -> None:
        if not state["fixed"]:
            raise RuntimeError("broken")
        await record_it(delivery, conn)
        await conn.execute("COMMIT")

    chosen = handler_async if is_async(kind) else handler
    consume(db, chosen, message, max_attempts=1, async_driver=driver)
    [letter] = dead_letters(db)
    assert letter[2] == 1

    state["fixed"] = True
    replayer = Consumer(
        db=db, broker=None, group="g", handler=chosen, async_driver=driver, backoff=FAST
    )
    counts = asyncio.run(replayer.replay_dead_letters())
    assert counts["failed"] == 1
    [letter] = dead_letters(db)  # still there: the handler's COMMIT did not take its removal
    assert letter[2] == 2 and "HandlerEndedTransaction" in letter[1]
