"""A session abandoned at shutdown (its sync handler's thread, or an async handler that
ignored its cancellation, still ran) is closed: a sync one once its call ends, not under its
thread; an async one at the shutdown (its transaction held the claims of the messages
handed back). Before, ``run_async`` never closed it, and its connection stayed open until
garbage collection or the process's exit (a library caller running ``run_async`` again
leaked one per hung batch).
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from outboxer.brokers.memory import memory_broker
from outboxer.consumer import Consumer
from outboxer.consumer_db import Session, session_factory
from outboxer.errors import ConsumerShutdownError
from outboxer.receivers.base import Delivery
from outboxer.receivers.memory import group_state
from outboxer.testing import make_message

BOUND = 30.0


def _closed(kind: str, conn: Any) -> bool:
    if kind == "mysql":
        return not conn.open
    if kind == "sqlite":
        try:
            conn.total_changes  # noqa: B018 -- raises once closed
        except sqlite3.ProgrammingError:
            return True
        return False
    if kind == "asyncpg":
        return bool(conn.is_closed())
    return bool(conn.closed)  # psycopg, sync and async


@pytest.fixture(params=["mysql", "psycopg", "sqlite", "asyncpg", "psycopg-async"])
def case(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    kind: str = request.param
    fixture = {"mysql": "mysql_url", "sqlite": "sqlite_url"}.get(kind, "pg_url")
    yield kind, request.getfixturevalue(fixture)


async def test_an_abandoned_session_is_closed_when_its_call_ends(case: tuple[str, str]) -> None:
    kind, url = case
    is_async = kind in ("asyncpg", "psycopg-async")
    broker = f"abandon-{uuid.uuid4().hex[:8]}"
    memory_broker(broker).clear()
    memory_broker(broker).messages.append(make_message("t", {"n": 1}, key="k"))
    started, release = threading.Event(), threading.Event()
    made: list[Session] = []
    factory = session_factory(
        url,
        "outboxer",
        is_async=is_async,
        async_driver="psycopg" if kind == "psycopg-async" else None,
    )

    def sessions(executor: ThreadPoolExecutor) -> Session:
        made.append(factory(executor))
        return made[-1]

    def hung(delivery: Delivery, conn: Any) -> None:
        started.set()
        release.wait(BOUND)  # a sync handler's thread cannot be interrupted

    async def stubborn(delivery: Delivery, conn: Any) -> None:
        started.set()
        while not release.is_set():
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                continue  # ignores its cancellation

    consumer = Consumer(
        db=url,
        broker=f"memory://{broker}",
        group="g",
        handler=stubborn if is_async else hung,
        concurrency=1,
        shutdown_timeout=0.1,
        sessions=sessions,
    )
    running = asyncio.create_task(consumer.run_async())
    assert await asyncio.to_thread(started.wait, BOUND)
    [session] = made
    conn = session.conn
    consumer.stop()
    try:
        with pytest.raises(ConsumerShutdownError) as error:
            await running
        assert error.value.hung
        if is_async:
            # An async handler that ignores its cancellation: its connection goes at the
            # shutdown, with the transaction holding the claims of the messages handed back
            # (their next delivery waited on them for as long as the handler ran).
            assert _closed(kind, conn), "left open under a handler ignoring its cancellation"
        else:
            assert not _closed(kind, conn), "closed under the handler's thread"
    finally:
        release.set()  # else the handler runs on, and the test's loop never closes
    loop = asyncio.get_running_loop()
    deadline = loop.time() + BOUND
    while not _closed(kind, conn):
        assert loop.time() < deadline, "the abandoned session's connection was never closed"
        await asyncio.sleep(0.02)
    assert group_state(broker, "g").acked == set()  # never acked: rolled back


@pytest.mark.parametrize("driver", ["asyncpg", "psycopg"])
async def test_an_abandoned_async_batch_is_not_charged_when_it_returns(
    pg_url: str, driver: str
) -> None:
    """The async handler that ignored its cancellation returns after shutdown: its batch
    rolls back (``abandoned``) and nothing is charged to its message, which was handed back.
    Before, it counted as a failed attempt: with max_attempts=1, a dead letter written after
    shutdown for a message the broker delivers again."""
    import psycopg

    broker = f"abandon-{uuid.uuid4().hex[:8]}"
    memory_broker(broker).clear()
    memory_broker(broker).messages.append(make_message("t", {"n": 1}, key="k"))
    started, release = asyncio.Event(), asyncio.Event()
    made: list[Session] = []
    factory = session_factory(pg_url, "outboxer", is_async=True, async_driver=driver)

    def sessions(executor: ThreadPoolExecutor) -> Session:
        made.append(factory(executor))
        return made[-1]

    async def stubborn(delivery: Delivery, conn: Any) -> None:
        started.set()
        while not release.is_set():
            try:
                await release.wait()
            except asyncio.CancelledError:
                continue  # ignores its cancellation

    consumer = Consumer(
        db=pg_url,
        broker=f"memory://{broker}",
        group="g",
        handler=stubborn,
        concurrency=1,
        max_attempts=1,
        shutdown_timeout=0.1,
        sessions=sessions,
    )
    running = asyncio.create_task(consumer.run_async())
    await asyncio.wait_for(started.wait(), BOUND)
    [session] = made
    consumer.stop()
    with pytest.raises(ConsumerShutdownError):
        await running
    worker = next(iter(consumer._given_up))
    release.set()
    await asyncio.wait_for(asyncio.shield(worker), BOUND)
    assert (consumer.stats.failed, consumer.stats.dead_lettered) == (0, 0)
    with psycopg.connect(pg_url) as check:
        rows = check.execute("SELECT count(*) FROM outboxer.dead_letters").fetchone()
    assert rows == (0,)
    assert group_state(broker, "g").acked == set()
    assert session.conn is None  # closed at the worker's end
