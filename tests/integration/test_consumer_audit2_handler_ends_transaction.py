"""A handler that ends the runner's transaction itself (``conn.commit()``, ``conn.rollback()``)
on SQLite, PostgreSQL (psycopg, sync and async) and MariaDB, fed by the in-process broker.

The runner claims the inbox rows of a whole batch before it calls the handlers. A handler
that committed would commit the claims of the batch's later messages too: one of those
whose handler then failed would be rolled back to "recorded in the inbox, not applied", and
every redelivery of it skipped as a duplicate, i.e. lost; a handler that rolled back would
undo the earlier messages, then acked as applied. Either is a failed attempt of the handler
(psycopg refuses the call inside its transaction block; elsewhere the runner claims one
message at a time and sees the transaction ended), and no message is lost.
"""

from __future__ import annotations

from typing import Any

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

#: asyncpg's connection has no commit() or rollback() to call.
KINDS_TESTED = ["sqlite", "postgres-psycopg", "postgres-psycopg-async", "mysql"]


@pytest.mark.parametrize("kind", KINDS_TESTED)
@pytest.mark.parametrize("ending", ["commit", "rollback"])
def test_a_handler_that_ends_the_transaction_loses_no_message_of_its_batch(
    request: pytest.FixtureRequest, kind: str, ending: str
) -> None:
    db = database(request, kind)
    _, driver, record_it = KINDS[kind]
    # Two keys, one batch: the first (by id, the order the runner applies them) ends the
    # transaction. After a commit, the second fails its first attempt (its claim was
    # committed); after a rollback, it succeeds (and the runner commits what is left).
    first, second = sorted(
        (make_message("t", {"n": 1}, key="a"), make_message("t", {"n": 2}, key="b")),
        key=lambda m: m.id,
    )
    ended: list[int] = []
    failed: list[int] = []  # attempts of the second that failed

    def step(message: Delivery) -> str:
        if str(message.id) == str(first.id) and not ended:
            ended.append(message.attempt)
            return "end"
        if str(message.id) == str(second.id) and not failed and ending == "commit":
            failed.append(message.attempt)
            return "fail"
        return "record"

    def handler(message: Delivery, conn: Any) -> None:
        what = step(message)
        record_it(message, conn)
        if what == "end":
            getattr(conn, ending)()
        elif what == "fail":
            raise RuntimeError("first attempt fails")

    async def handler_async(message: Delivery, conn: Any) -> None:
        what = step(message)
        await record_it(message, conn)
        if what == "end":
            await getattr(conn, ending)()
        elif what == "fail":
            raise RuntimeError("first attempt fails")

    _, stats = consume(
        db,
        handler_async if is_async(kind) else handler,
        first,
        second,
        concurrency=1,
        max_attempts=5,
        async_driver=driver,
    )
    assert failed or ending == "rollback", "the second message never failed"
    assert sorted(row[0] for row in applied(db)) == [1, 2], (
        "each message applied exactly once (a message recorded in the inbox but rolled back "
        "is skipped for ever)"
    )
    assert dead_letters(db) == []
    assert inbox_ids(db) == {str(first.id), str(second.id)}
    # Nothing applied was counted a duplicate, nothing a duplicate went unapplied: the one
    # duplicate allowed is the committing handler's own message, kept by its commit.
    assert stats.applied + stats.duplicates == 2
    assert stats.applied == (1 if ending == "commit" and kind in ("sqlite", "mysql") else 2)
