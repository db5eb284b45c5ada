"""The suspects table's primitives on the real databases (SQLite, PostgreSQL with psycopg
and asyncpg, MariaDB): ``Session.suspect_attempt`` records an attempt at a redelivered
message in a commit of its own and returns the deaths before it (attempts recorded that
never ended); the apply transaction of a suspect deletes its row with the message's own
writes, a rolled-back one leaves it; ``suspect_done`` deletes it on its own; an ordinary
apply never touches the table."""

from __future__ import annotations

import asyncio
import sqlite3
import uuid
from typing import Any

import psycopg
import pytest

from outboxer.consumer_db import BatchFailed, DaemonThreadPool, Result, session_factory
from outboxer.receivers.base import Delivery
from tests.integration.test_consumer_mysql import rows as mysql_rows

#: kind -> (database fixture, async driver)
KINDS: dict[str, tuple[str, str | None]] = {
    "sqlite": ("sqlite_url", None),
    "postgres-psycopg": ("pg_url", None),
    "postgres-asyncpg": ("pg_url", "asyncpg"),
    "mysql": ("mysql_url", None),
}


def query(db: str, sql: str) -> list[tuple[Any, ...]]:
    if db.startswith("sqlite"):
        with sqlite3.connect(db.removeprefix("sqlite:///")) as lite:
            return lite.execute(sql).fetchall()
    if db.startswith("postgres"):
        with psycopg.connect(db) as conn:
            return conn.execute(sql).fetchall()
    return mysql_rows(db, sql)


def suspects(db: str) -> list[tuple[str, str, int]]:
    name = "outboxer.inbox_suspects" if db.startswith("postgres") else "inbox_suspects"
    rows = query(db, f"SELECT consumer, message_id, deaths FROM {name} ORDER BY consumer")
    return [(str(c), str(m), int(d)) for c, m, d in rows]


def delivery() -> Delivery:
    return Delivery(
        id=uuid.uuid4(),
        topic="t",
        key="k",
        headers={},
        payload={"n": 1},
        body=b'{"n": 1}',
        content_type="application/json",
    )


def nothing(message: Delivery, conn: Any) -> None:
    return None


async def nothing_async(message: Delivery, conn: Any) -> None:
    return None


def failing(message: Delivery, conn: Any) -> None:
    raise RuntimeError("the handler's own failure")


async def failing_async(message: Delivery, conn: Any) -> None:
    raise RuntimeError("the handler's own failure")


@pytest.mark.parametrize("kind", list(KINDS))
def test_suspect_attempts_count_deaths_and_the_apply_deletes_its_row(
    kind: str, request: pytest.FixtureRequest
) -> None:
    fixture, driver = KINDS[kind]
    db: str = request.getfixturevalue(fixture)
    is_async = driver is not None
    ok, fail = (nothing_async, failing_async) if is_async else (nothing, failing)

    async def scenario() -> None:
        pool = DaemonThreadPool(2)
        session = session_factory(db, "outboxer", is_async=is_async, async_driver=driver)(pool)
        await session.open()
        try:
            killer, other = delivery(), delivery()
            # An ordinary apply (a first delivery) writes nothing there.
            assert await session.apply("g", [other], ok, hold_keys=False) == [Result.APPLIED]
            assert suspects(db) == []
            # Each recorded attempt that never ended is one more death; committed at once.
            assert [await session.suspect_attempt("g", killer.id) for _ in range(3)] == [0, 1, 2]
            assert suspects(db) == [("g", str(killer.id), 2)]
            # Per consumer group.
            assert await session.suspect_attempt("h", killer.id) == 0
            # A rolled-back apply leaves the row (the attempt did not commit) ...
            with pytest.raises(BatchFailed):
                await session.apply("g", [killer], fail, hold_keys=False, suspect=True)
            assert ("g", str(killer.id), 2) in suspects(db)
            # ... and the in-process failure path deletes it in a commit of its own.
            await session.suspect_done("g", killer.id)
            assert suspects(db) == [("h", str(killer.id), 0)]
            # The apply that commits deletes it with the message's own writes.
            applied = await session.apply("h", [killer], ok, hold_keys=False, suspect=True)
            assert applied == [Result.APPLIED]
            assert suspects(db) == []
            # A duplicate ends the attempt too.
            assert await session.suspect_attempt("h", killer.id) == 0
            again = await session.apply("h", [killer], ok, hold_keys=False, suspect=True)
            assert again == [Result.DUPLICATE]
            assert suspects(db) == []
        finally:
            await session.close()
            pool.shutdown()

    asyncio.run(scenario())
