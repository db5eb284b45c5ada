"""``handler_timeout``: a handler that hangs on one message fails that attempt (Redis, SQLite
and PostgreSQL).

Without a bound, a handler that never returned (a call with no timeout, a deadlock of its
own) held its message's key and its worker for ever. Now an attempt still running after
``handler_timeout`` fails (HandlerTimeout): an async handler is cancelled, a sync one is
abandoned in its thread (its transaction ended from a new connection, the worker given a
new session), the attempt retried after its backoff and dead-lettered after max_attempts;
the batch-mates it rolled back are applied again with no attempt charged. More hung sync
threads than ``concurrency`` stop the consumer (a restart ends them).
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from outboxer.brokers import create_publisher
from outboxer.consumer import Consumer, Delivery
from outboxer.errors import ConsumerShutdownError
from outboxer.retry import Backoff
from outboxer.testing import make_message
from tests.services import require

REDIS = "redis://127.0.0.1:6379/0"
FAST = Backoff(base=0.05, multiplier=2, cap=0.1, jitter=0)
RUN_TIMEOUT = 8.0
#: (n, key) in publishing order.
MESSAGES = [(0, "a"), (1, "a"), (2, "b"), (3, "b"), (4, None)]
#: Heads of their key (n=4 keyless), applied together in a batch: the one of them whose id
#: sorts last hangs, so that the others of its batch ran first (a batch applies in id order)
#: and their writes are rolled back with it.
HEADS = (0, 2, 4)


@pytest.fixture
def release() -> Iterator[threading.Event]:
    """Set at teardown: the sync handlers left hanging return (their batch rolls back)."""
    event = threading.Event()
    yield event
    event.set()


def query(db: str, sql: str) -> list[tuple[Any, ...]]:
    if db.startswith("sqlite"):
        with sqlite3.connect(db.removeprefix("sqlite:///")) as lite:
            return lite.execute(sql).fetchall()
    with psycopg.connect(db) as conn:
        return conn.execute(sql).fetchall()


def prepare(db: str) -> None:
    if db.startswith("sqlite"):
        ddl = "CREATE TABLE applied (position INTEGER PRIMARY KEY, n INTEGER, key TEXT)"
    else:
        ddl = "CREATE TABLE applied (position SERIAL PRIMARY KEY, n INTEGER, key TEXT)"
    if db.startswith("sqlite"):
        with sqlite3.connect(db.removeprefix("sqlite:///")) as lite:
            lite.execute(ddl)
    else:
        with psycopg.connect(db) as conn:
            conn.execute(ddl)


def dead_letters(db: str, group: str) -> list[tuple[str, int, str]]:
    table = "dead_letters" if db.startswith("sqlite") else "outboxer.dead_letters"
    rows = query(db, f"SELECT message_id, attempts, error FROM {table} WHERE consumer = '{group}'")
    return [(str(message_id), int(attempts), str(error)) for message_id, attempts, error in rows]


async def publish(stream: str) -> list[uuid.UUID]:
    messages = [make_message(stream, {"n": n}, key=key) for n, key in MESSAGES]
    async with create_publisher(REDIS) as publisher:
        assert all(o.published for o in await publisher.publish_batch(messages))
    return [message.id for message in messages]


async def drop(stream: str) -> None:
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(REDIS)
    try:
        await client.delete(stream)
    finally:
        await client.aclose()


def last_head(ids: list[uuid.UUID]) -> int:
    return max(HEADS, key=lambda n: ids[n])


def handler_for(
    db: str, kind: str, release: threading.Event, calls: list[int], hangs: list[int]
) -> Any:
    """Writes (n, key) to ``applied``; hangs on n in ``hangs`` (until cancelled or
    ``release``)."""

    async def apply_async(message: Delivery, conn: Any) -> None:
        n = message.payload["n"]
        calls.append(n)
        if n in hangs:
            await asyncio.Event().wait()
        await conn.execute("INSERT INTO applied (n, key) VALUES ($1, $2)", n, message.key)

    def apply_sync(message: Delivery, conn: Any) -> None:
        n = message.payload["n"]
        calls.append(n)
        if n in hangs:
            release.wait(60)
        mark = "?" if db.startswith("sqlite") else "%s"
        conn.execute(f"INSERT INTO applied (n, key) VALUES ({mark}, {mark})", (n, message.key))

    return apply_async if kind == "async" else apply_sync


@pytest.mark.parametrize(
    ("database", "kind"), [("sqlite", "sync"), ("postgres", "sync"), ("postgres", "async")]
)
def test_a_hung_handler_times_out_and_is_dead_lettered(
    request: pytest.FixtureRequest, release: threading.Event, database: str, kind: str
) -> None:
    require("redis")
    db = request.getfixturevalue("sqlite_url" if database == "sqlite" else "pg_url")
    prepare(db)
    stream, group = f"ht-{uuid.uuid4().hex[:12]}", f"g-{uuid.uuid4().hex[:8]}"
    calls: list[int] = []
    hangs: list[int] = []

    async def scenario() -> tuple[Consumer, list[uuid.UUID], float]:
        ids = await publish(stream)
        hangs.append(last_head(ids))
        consumer = Consumer(
            db=db,
            broker=REDIS,
            group=group,
            handler=handler_for(db, kind, release, calls, hangs),
            topics=[stream],
            concurrency=2,
            batch=10,
            max_attempts=2,
            backoff=FAST,
            handler_timeout=0.3,
            exit_when_idle=True,
        )
        began = time.monotonic()
        try:
            await asyncio.wait_for(consumer.run_async(), RUN_TIMEOUT)
        finally:
            await drop(stream)
        return consumer, ids, time.monotonic() - began

    consumer, ids, took = asyncio.run(scenario())
    # Before: no such setting (TypeError); and no bound, the run never ended.
    [(message_id, attempts, error)] = dead_letters(db, group)
    [hung] = hangs
    assert (message_id, attempts) == (str(ids[hung]), 2)
    assert "handler_timeout (0.3s)" in error and "apply_" in error, error
    assert calls.count(hung) == 2
    rows = query(db, "SELECT n, key FROM applied ORDER BY position")
    # Each once (a batch-mate rolled back with the hung one applied again), nothing of the
    # hung one, and each key in order (the hung one's follower after its dead letter).
    assert sorted(n for n, _ in rows) == [n for n, _ in MESSAGES if n != hung]
    for key in ("a", "b", None):
        assert [n for n, k in rows if k == key] == [
            n for n, k in MESSAGES if k == key and n != hung
        ]
    stats = consumer.stats
    # The batch-mates the timeout rolled back were not charged an attempt.
    assert (stats.failed, stats.handler_timeouts, stats.dead_lettered, stats.applied) == (
        2,
        2,
        1,
        4,
    )
    assert took < RUN_TIMEOUT


def test_without_handler_timeout_a_slow_handler_is_waited_for(sqlite_url: str) -> None:
    require("redis")
    prepare(sqlite_url)
    stream, group = f"ht-{uuid.uuid4().hex[:12]}", f"g-{uuid.uuid4().hex[:8]}"

    def slow(message: Delivery, conn: Any) -> None:
        if message.payload["n"] == 0:
            time.sleep(0.6)
        conn.execute("INSERT INTO applied (n, key) VALUES (?, ?)", (message.payload["n"], None))

    async def scenario() -> Consumer:
        await publish(stream)
        consumer = Consumer(
            db=sqlite_url,
            broker=REDIS,
            group=group,
            handler=slow,
            topics=[stream],
            max_attempts=1,
            handler_timeout=None,  # the default: no bound
            exit_when_idle=True,
        )
        try:
            await asyncio.wait_for(consumer.run_async(), RUN_TIMEOUT)
        finally:
            await drop(stream)
        return consumer

    stats = asyncio.run(scenario()).stats
    assert (stats.applied, stats.failed, stats.handler_timeouts) == (5, 0, 0)
    assert dead_letters(sqlite_url, group) == []


def test_more_hung_sync_handlers_than_concurrency_stop_the_consumer(
    sqlite_url: str, release: threading.Event
) -> None:
    require("redis")
    prepare(sqlite_url)
    stream, group = f"ht-{uuid.uuid4().hex[:12]}", f"g-{uuid.uuid4().hex[:8]}"
    calls: list[int] = []
    hangs = [n for n, _ in MESSAGES]  # each one: the first head taken hangs

    async def scenario() -> tuple[Consumer, list[uuid.UUID], ConsumerShutdownError]:
        ids = await publish(stream)
        consumer = Consumer(
            db=sqlite_url,
            broker=REDIS,
            group=group,
            handler=handler_for(sqlite_url, "sync", release, calls, hangs),
            batch=1,
            topics=[stream],
            concurrency=1,
            max_attempts=5,
            backoff=FAST,
            handler_timeout=0.3,
        )
        try:
            with pytest.raises(ConsumerShutdownError) as stopped:
                await asyncio.wait_for(consumer.run_async(), RUN_TIMEOUT)
        finally:
            await drop(stream)
        return consumer, ids, stopped.value

    consumer, ids, error = asyncio.run(scenario())
    # One hung thread is allowed (concurrency 1); the second stops the process, the message
    # neither dead-lettered nor charged that attempt: a restart (a new process) ends them.
    # The second hung attempt (the first one's retry, or another key's head meanwhile).
    assert len(calls) == 2
    assert error.hung and error.message_ids == [str(ids[calls[1]])]
    assert "handler_timeout" in str(error)
    assert consumer.stats.handler_timeouts == 2 and consumer.stats.failed == 1
    assert dead_letters(sqlite_url, group) == []
