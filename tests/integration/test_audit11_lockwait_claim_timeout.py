"""An inbox claim that waits on another consumer's lock until the database gives up (MariaDB's
innodb_lock_wait_timeout, error 1205; PostgreSQL's lock_timeout; SQLite's busy_timeout at
BEGIN IMMEDIATE) is not a failure of the message: no attempt counted, never dead-lettered
for it, tried again later, when the claim finds the holder's commit (a duplicate).

Before, it was charged like a handler's failure: with max_attempts=1 the message, which the
other consumer applied, became a dead letter. The lock waits are shortened through the
consumer's ``sessions`` factory, as a deployment would set them on the server."""

from __future__ import annotations

import asyncio
import sqlite3
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from outboxer.brokers.memory import memory_broker
from outboxer.consumer import Consumer
from outboxer.consumer_db import (
    AsyncpgSession,
    PsycopgSession,
    PyMySQLSession,
    Session,
    SqliteSession,
)
from outboxer.inbox import Inbox
from outboxer.receivers.base import Delivery
from outboxer.receivers.memory import group_state
from outboxer.retry import Backoff
from outboxer.testing import make_message
from tests.conftest import mysql_connect

GROUP = "g"
#: Generous bound for what takes a second or two: only a regression reaches it.
BOUND = 30.0


class ShortMySQL(PyMySQLSession):
    def _connect(self) -> Any:
        conn = super()._connect()
        with conn.cursor() as cursor:
            cursor.execute("SET SESSION innodb_lock_wait_timeout = 1")
        return conn


class ShortPsycopg(PsycopgSession):
    def _connect(self) -> Any:
        conn = super()._connect()
        conn.execute("SET lock_timeout = '300ms'")
        conn.commit()
        return conn


class ShortAsyncpg(AsyncpgSession):
    async def open(self) -> None:
        await super().open()
        await self.conn.execute("SET lock_timeout = '300ms'")


class ShortSqlite(SqliteSession):
    def _connect(self) -> Any:
        conn = super()._connect()
        conn.execute("PRAGMA busy_timeout = 300")
        return conn


def _blocker(kind: str, url: str) -> Any:
    """Another consumer's open transaction, its inbox claim of the message made."""
    if kind == "mysql":
        conn = mysql_connect(url)
        conn.begin()
        return conn
    if kind == "sqlite":
        conn = sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None)
        conn.execute("BEGIN IMMEDIATE")
        return conn
    import psycopg

    return psycopg.connect(url)


@pytest.fixture(params=["mysql", "psycopg", "asyncpg", "sqlite"])
def case(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    kind: str = request.param
    fixture = {"mysql": "mysql_url", "sqlite": "sqlite_url"}.get(kind, "pg_url")
    yield kind, request.getfixturevalue(fixture)


async def test_a_claim_that_waits_on_another_consumer_is_not_an_attempt(
    case: tuple[str, str],
) -> None:
    kind, url = case
    broker = f"lockwait-{uuid.uuid4().hex[:8]}"
    memory_broker(broker).clear()
    held = make_message("t", {"n": 1}, key="held")
    free = make_message("t", {"n": 2}, key="free")
    memory_broker(broker).messages.extend([held, free])
    session_class: Callable[..., Session] = {
        "mysql": ShortMySQL,
        "psycopg": ShortPsycopg,
        "asyncpg": ShortAsyncpg,
        "sqlite": ShortSqlite,
    }[kind]
    handled: list[uuid.UUID] = []

    def sync_handler(delivery: Delivery, conn: Any) -> None:
        handled.append(delivery.id)

    async def async_handler(delivery: Delivery, conn: Any) -> None:
        handled.append(delivery.id)

    def sessions(executor: ThreadPoolExecutor) -> Session:
        if kind == "asyncpg":
            return session_class(url, "outboxer")
        return session_class(url, "outboxer", executor)

    blocker = _blocker(kind, url)
    try:
        assert Inbox().claim(blocker, GROUP, held.id)
        consumer = Consumer(
            db=url,
            broker=f"memory://{broker}",
            group=GROUP,
            handler=async_handler if kind == "asyncpg" else sync_handler,
            concurrency=1,
            batch=10,
            max_attempts=1,
            backoff=Backoff(base=0.05, multiplier=1, cap=0.05, jitter=0),
            sessions=sessions,
        )
        running = asyncio.create_task(consumer.run_async())
        loop = asyncio.get_running_loop()
        deadline = loop.time() + BOUND
        # The consumer's wait ran out twice: the batch's, then (split, each message alone;
        # SQLite: the batch again) the held message's own, which the old code counted as
        # its failed attempt.
        while consumer.stats.database_errors < 2 and not consumer.stats.failed:
            assert loop.time() < deadline and not running.done(), "the claim never waited"
            await asyncio.sleep(0.02)
        if kind == "sqlite":
            blocker.execute("COMMIT")
        else:
            blocker.commit()  # the other consumer applied it
        while group_state(broker, GROUP).acked != {0, 1}:
            assert loop.time() < deadline and not running.done(), "not both acked"
            await asyncio.sleep(0.02)
        consumer.stop()
        stats = await running
    finally:
        blocker.close()
    assert (stats.failed, stats.dead_lettered) == (0, 0), "charged for another's lock"
    assert (stats.applied, stats.duplicates) == (1, 1)
    assert handled == [free.id]
