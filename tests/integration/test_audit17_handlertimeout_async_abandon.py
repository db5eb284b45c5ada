"""``handler_timeout``: an async handler that catches its cancellation and goes on (Redis,
PostgreSQL through asyncpg and psycopg).

Before, such a handler held its worker for ever after its timeout: the cancellation was
its only bound, so its message was never dead-lettered and the later messages of its key
never applied (one worker: nothing more at all). Now it is abandoned ``TIMEOUT_GRACE``
after its cancellation, as a hung sync handler is: its task left running on a session that
never commits, whose transaction is ended from a new connection (its inbox claim goes, so
the next attempt is not held behind it), counted among the hung handlers (more than
``concurrency`` stop the consumer), the message failing with HandlerTimeout. A handler that
returns after catching its cancellation fails the same way instead of being committed.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from outboxer.brokers import create_publisher
from outboxer.consumer import Consumer, Delivery
from outboxer.errors import ConsumerShutdownError
from outboxer.testing import make_message
from tests.integration.test_audit16_htimeout_consumer import FAST, REDIS, dead_letters, drop
from tests.services import require

#: (n, key) in publishing order; n=0 is the head of key "a", the handler's hang.
MESSAGES = [(0, "a"), (1, "a"), (2, "b")]
DRIVERS = ["asyncpg", "psycopg"]
#: outboxer.consumer.TIMEOUT_GRACE (not imported: the old code, which fails these tests, has
#: none).
GRACE = 1.0


def prepare(db: str) -> None:
    with psycopg.connect(db) as conn:
        conn.execute("CREATE TABLE applied (position SERIAL PRIMARY KEY, n INTEGER, key TEXT)")


def applied(db: str) -> list[tuple[int, str]]:
    with psycopg.connect(db) as conn:
        return [
            (int(n), str(key))
            for n, key in conn.execute("SELECT n, key FROM applied ORDER BY position")
        ]


def idle_in_transaction(db: str) -> int:
    """Backends of ``db`` holding a transaction open between statements (an abandoned one
    not ended would be one)."""
    name = db.rsplit("/", 1)[1]
    with psycopg.connect(db, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = %s AND state LIKE 'idle in transaction%%'",
            (name,),
        ).fetchone()
    assert row is not None
    return int(row[0])


async def until(condition: Callable[[], bool], seconds: float, what: str) -> None:
    """tests.waiting.wait_for on the event loop (the consumer runs on it)."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


async def publish(stream: str) -> list[uuid.UUID]:
    messages = [make_message(stream, {"n": n}, key=key) for n, key in MESSAGES]
    async with create_publisher(REDIS) as publisher:
        assert all(o.published for o in await publisher.publish_batch(messages))
    return [message.id for message in messages]


class Stubborn:
    """An async handler writing (n, key) to ``applied``; on n in ``hangs`` it catches every
    cancellation and goes on waiting until ``release`` is set, then tries to write all the
    same (on a connection that must be gone by then)."""

    def __init__(self, hangs: set[int]) -> None:
        self.hangs = hangs
        self.release = asyncio.Event()
        self.calls: list[int] = []
        self.cancellations = 0
        self.running = 0
        #: What the writes of the released handlers raised (None: the write went through).
        self.late: list[BaseException | None] = []

    async def __call__(self, message: Delivery, conn: Any) -> None:
        n = message.payload["n"]
        self.calls.append(n)
        if n in self.hangs:
            self.running += 1
            try:
                while not self.release.is_set():
                    try:
                        await self.release.wait()
                    except asyncio.CancelledError:
                        self.cancellations += 1  # and on it goes
                try:
                    await self.write(conn, n, message.key)
                except Exception as exc:  # the test reads it
                    self.late.append(exc)
                else:
                    self.late.append(None)
                return
            finally:
                self.running -= 1
        await self.write(conn, n, message.key)

    @staticmethod
    async def write(conn: Any, n: int, key: str | None) -> None:
        if isinstance(conn, psycopg.AsyncConnection):
            await conn.execute("INSERT INTO applied (n, key) VALUES (%s, %s)", (n, key))
        else:
            await conn.execute("INSERT INTO applied (n, key) VALUES ($1, $2)", n, key)


def consumer_for(db: str, driver: str, stream: str, handler: Stubborn, **options: Any) -> Consumer:
    settings: dict[str, Any] = {
        "concurrency": 2,
        "batch": 10,
        "max_attempts": 2,
        "backoff": FAST,
        "handler_timeout": 0.3,
    }
    settings.update(options)
    return Consumer(
        db=db,
        broker=REDIS,
        group=f"g-{uuid.uuid4().hex[:8]}",
        handler=handler,
        topics=[stream],
        async_driver=driver,
        **settings,
    )


@pytest.mark.parametrize("driver", DRIVERS)
def test_an_async_handler_ignoring_its_cancellation_is_abandoned(pg_url: str, driver: str) -> None:
    require("redis")
    prepare(pg_url)
    stream = f"ha-{uuid.uuid4().hex[:12]}"

    async def scenario() -> tuple[Consumer, Stubborn, list[uuid.UUID], float, int]:
        ids = await publish(stream)
        handler = Stubborn({0})
        consumer = consumer_for(pg_url, driver, stream, handler)
        run = asyncio.create_task(consumer.run_async())
        began = time.monotonic()
        try:
            # Before: the first attempt held its worker for ever, nothing dead-lettered and
            # message 1 (key "a", after it) never applied.
            await until(
                lambda: (
                    len(dead_letters(pg_url, consumer.group)) == 1 and len(applied(pg_url)) == 2
                ),
                8,
                "the stubborn handler's message dead-lettered and the others applied",
            )
            took = time.monotonic() - began
            # Both abandoned attempts still run: their transactions ended from outside.
            assert handler.running == 2 and len(consumer._hung) == 2
            await until(lambda: idle_in_transaction(pg_url) == 0, 3, "abandoned transactions ended")
            hung_left = len(consumer._hung)
            handler.release.set()  # they end now, and try to write
            await until(lambda: not consumer._hung, 3, "the abandoned handlers' tasks ended")
            consumer.stop()
            await asyncio.wait_for(run, 5)  # nothing left running: no error
        finally:
            handler.release.set()
            consumer.stop()
            if not run.done():
                await asyncio.wait({run}, timeout=5)
            await drop(stream)
        return consumer, handler, ids, took, hung_left

    consumer, handler, ids, took, hung_left = asyncio.run(scenario())
    [(message_id, attempts, error)] = dead_letters(pg_url, consumer.group)
    assert (message_id, attempts) == (str(ids[0]), 2)
    assert "handler_timeout (0.3s)" in error and "abandoned" in error, error
    assert handler.calls.count(0) == 2 and handler.cancellations >= 2
    # Each other message once, key "a" in order; nothing of the abandoned ones, whose late
    # writes found their connection ended.
    assert sorted(applied(pg_url)) == [(1, "a"), (2, "b")]
    assert len(handler.late) == 2 and all(exc is not None for exc in handler.late)
    stats = consumer.stats
    assert (stats.handler_timeouts, stats.failed, stats.dead_lettered, stats.applied) == (
        2,
        2,
        1,
        2,
    )
    assert hung_left == 2
    # Two attempts of timeout and grace, a backoff between.
    assert took < 2 * (0.3 + GRACE) + 2


@pytest.mark.parametrize("driver", DRIVERS)
def test_stopping_with_an_abandoned_async_handler_still_running(pg_url: str, driver: str) -> None:
    require("redis")
    prepare(pg_url)
    stream = f"ha-{uuid.uuid4().hex[:12]}"

    async def scenario() -> tuple[Consumer, list[uuid.UUID], ConsumerShutdownError, float, int]:
        ids = await publish(stream)
        handler = Stubborn({0})
        consumer = consumer_for(pg_url, driver, stream, handler, max_attempts=1, shutdown_timeout=5)
        run = asyncio.create_task(consumer.run_async())
        try:
            await until(
                lambda: (
                    len(dead_letters(pg_url, consumer.group)) == 1 and len(applied(pg_url)) == 2
                ),
                8,
                "the stubborn handler's message dead-lettered and the others applied",
            )
            [session] = consumer._hung
            began = time.monotonic()
            consumer.stop()
            with pytest.raises(ConsumerShutdownError) as stopped:
                await asyncio.wait_for(run, 4)
            took = time.monotonic() - began
            # Its connection closed: no transaction of it left open, whatever it does next.
            assert session.conn is None
            left = idle_in_transaction(pg_url)
            assert handler.running == 1  # still ignoring its cancellation
        finally:
            handler.release.set()  # asyncio.run's end waits for its task
            consumer.stop()
            if not run.done():
                await asyncio.wait({run}, timeout=5)
            await drop(stream)
        return consumer, ids, stopped.value, took, left

    _, ids, error, took, left = asyncio.run(scenario())
    # outboxer consume exits 1 at once on `hung` (asyncio's end would wait for the task).
    assert error.hung and error.message_ids == [str(ids[0])]
    assert took < 2  # not shutdown_timeout (5 s)
    assert left == 0
    assert sorted(applied(pg_url)) == [(1, "a"), (2, "b")]


def test_more_stubborn_async_handlers_than_concurrency_stop_the_consumer(pg_url: str) -> None:
    require("redis")
    prepare(pg_url)
    stream = f"ha-{uuid.uuid4().hex[:12]}"

    async def scenario() -> tuple[Consumer, Stubborn, ConsumerShutdownError]:
        await publish(stream)
        handler = Stubborn({n for n, _ in MESSAGES})  # each one: the first taken hangs
        consumer = consumer_for(
            pg_url, "asyncpg", stream, handler, concurrency=1, batch=1, max_attempts=5
        )
        try:
            with pytest.raises(ConsumerShutdownError) as stopped:
                # Before: the first hang held the only worker for ever.
                await asyncio.wait_for(consumer.run_async(), 8)
        finally:
            handler.release.set()
            await drop(stream)
        return consumer, handler, stopped.value

    consumer, handler, error = asyncio.run(scenario())
    # One abandoned handler is allowed (concurrency 1); the second stops the consumer, that
    # attempt neither charged nor dead-lettered.
    assert len(handler.calls) == 2
    assert error.hung and "handler_timeout" in str(error)
    assert consumer.stats.handler_timeouts == 2 and consumer.stats.failed == 1
    assert dead_letters(pg_url, consumer.group) == []
    assert applied(pg_url) == []


def test_an_async_handler_returning_after_its_cancellation_is_not_committed(
    pg_url: str,
) -> None:
    require("redis")
    prepare(pg_url)
    stream = f"ha-{uuid.uuid4().hex[:12]}"

    async def swallowing(message: Delivery, conn: Any) -> None:
        n = message.payload["n"]
        if n == 0:
            with contextlib.suppress(asyncio.CancelledError):  # and returns, as if done
                await asyncio.sleep(30)
        await conn.execute("INSERT INTO applied (n, key) VALUES ($1, $2)", n, message.key)

    async def scenario() -> tuple[Consumer, list[uuid.UUID]]:
        ids = await publish(stream)
        consumer = Consumer(
            db=pg_url,
            broker=REDIS,
            group=f"g-{uuid.uuid4().hex[:8]}",
            handler=swallowing,
            topics=[stream],
            concurrency=2,
            max_attempts=1,
            backoff=FAST,
            handler_timeout=0.3,
            exit_when_idle=True,
        )
        try:
            await asyncio.wait_for(consumer.run_async(), 8)
        finally:
            await drop(stream)
        return consumer, ids

    consumer, ids = asyncio.run(scenario())
    # Before: its write committed after its timeout, the message acked as applied.
    [(message_id, attempts, error)] = dead_letters(pg_url, consumer.group)
    assert (message_id, attempts) == (str(ids[0]), 1)
    assert "handler_timeout (0.3s)" in error and "returned" in error, error
    assert sorted(applied(pg_url)) == [(1, "a"), (2, "b")]
    assert consumer.stats.handler_timeouts == 1 and consumer.stats.applied == 2
