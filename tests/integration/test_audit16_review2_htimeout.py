"""``handler_timeout`` review: two interleavings of the watchdog of sync handlers.

1. The watchdog saw a handler past the bound, and before it abandoned the batch that
   handler returned and the batch's next one began on the same connection: the next one,
   run for no time at all, was abandoned and charged a HandlerTimeout.
2. A handler timing out during the shutdown's wait for the batches in flight: its worker's
   new connection was not opened (stopping) and so the abandoned transaction was not ended:
   on SQLite its write lock held every other batch in flight until shutdown_timeout (which
   then failed, ConsumerShutdownError) and the timed-out message's dead letter failed.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
import uuid
from typing import Any

from outboxer.brokers import create_publisher
from outboxer.consumer import Consumer, Delivery
from outboxer.consumer_db import BatchFailed, Session
from outboxer.testing import make_message
from tests.integration.test_audit16_htimeout_consumer import FAST, REDIS, drop, release
from tests.services import require

__all__ = ["release"]  # the fixture, imported


def prepare(url: str) -> str:
    path = url.removeprefix("sqlite:///")
    with sqlite3.connect(path) as lite:
        lite.execute("CREATE TABLE applied (n INTEGER)")
    return path


def applied(path: str) -> list[int]:
    with sqlite3.connect(path) as lite:
        return sorted(n for (n,) in lite.execute("SELECT n FROM applied"))


async def publish(stream: str, ns: list[int]) -> list[uuid.UUID]:
    messages = [make_message(stream, {"n": n}, key=f"k{n}") for n in ns]
    async with create_publisher(REDIS) as publisher:
        assert all(o.published for o in await publisher.publish_batch(messages))
    return [message.id for message in messages]


def test_the_next_handler_of_the_batch_is_not_abandoned_for_the_last_ones_time(
    sqlite_url: str,
) -> None:
    require("redis")
    path = prepare(sqlite_url)
    stream, group = f"hr-{uuid.uuid4().hex[:12]}", f"g-{uuid.uuid4().hex[:8]}"
    decided = threading.Event()  # the watchdog saw handler 0 past the bound
    second_began = threading.Event()
    abandon_done = threading.Event()

    def handler(message: Delivery, conn: Any) -> None:
        n = message.payload["n"]
        if n == 0:
            decided.wait(5)  # past the bound: returns right as the watchdog decides
        else:
            second_began.set()
            abandon_done.wait(5)  # still running when the watchdog acts
        conn.execute("INSERT INTO applied (n) VALUES (?)", (n,))

    class Interleaved(Consumer):
        """Holds the watchdog between its decision and its act until the batch's second
        handler has begun: the interleaving of a handler returning at the bound."""

        async def _abandon(
            self, session: Session, task: asyncio.Task[Any], deliveries: list[Delivery]
        ) -> BatchFailed | None:
            if decided.is_set():
                return await super()._abandon(session, task, deliveries)
            decided.set()
            assert second_began.wait(5)
            try:
                return await super()._abandon(session, task, deliveries)
            finally:
                abandon_done.set()

    async def scenario() -> Consumer:
        await publish(stream, [0, 1])  # one batch: 0 first (ids sort in publishing order)
        consumer = Interleaved(
            db=sqlite_url,
            broker=REDIS,
            group=group,
            handler=handler,
            topics=[stream],
            concurrency=1,
            batch=10,
            max_attempts=3,
            backoff=FAST,
            handler_timeout=0.2,
            exit_when_idle=True,
        )
        try:
            await asyncio.wait_for(consumer.run_async(), 8)
        finally:
            await drop(stream)
        return consumer

    stats = asyncio.run(scenario()).stats
    # Before: handler 1, begun a moment before, was abandoned (1 timeout, 1 failure).
    assert (stats.handler_timeouts, stats.failed, stats.applied) == (0, 0, 2)
    assert applied(path) == [0, 1]


def test_a_timeout_during_shutdown_ends_the_abandoned_transaction(
    sqlite_url: str, release: threading.Event
) -> None:
    require("redis")
    path = prepare(sqlite_url)
    stream, group = f"hr-{uuid.uuid4().hex[:12]}", f"g-{uuid.uuid4().hex[:8]}"
    hanging = threading.Event()

    def handler(message: Delivery, conn: Any) -> None:
        n = message.payload["n"]
        if n == 0:
            hanging.set()
            release.wait(30)
        conn.execute("INSERT INTO applied (n) VALUES (?)", (n,))

    async def scenario() -> tuple[Consumer, list[uuid.UUID], float]:
        [hung] = await publish(stream, [0])
        consumer = Consumer(
            db=sqlite_url,
            broker=REDIS,
            group=group,
            handler=handler,
            topics=[stream],
            concurrency=2,
            batch=1,
            max_attempts=1,
            backoff=FAST,
            handler_timeout=0.5,
            shutdown_timeout=4,
        )
        run = asyncio.create_task(consumer.run_async())
        try:
            assert await asyncio.to_thread(hanging.wait, 5)
            # The other worker's batch, in flight behind the hung one's write lock.
            await publish(stream, [1])
            deadline = time.monotonic() + 5
            while len(consumer._batches) < 2:
                assert time.monotonic() < deadline, "the second batch was never taken"
                await asyncio.sleep(0.01)
            began = time.monotonic()
            consumer.stop()  # the timeout comes during the shutdown's wait
            await asyncio.wait_for(run, 8)  # before: ConsumerShutdownError after 4 s
            return consumer, [hung], time.monotonic() - began
        finally:
            if not run.done():
                run.cancel()
            await drop(stream)

    consumer, [hung], took = asyncio.run(scenario())
    assert applied(path) == [1]
    with sqlite3.connect(path) as lite:
        rows = lite.execute("SELECT message_id, attempts FROM dead_letters").fetchall()
    assert [(str(m), a) for m, a in rows] == [(str(hung), 1)]
    assert consumer.stats.handler_timeouts == 1 and consumer.stats.database_errors == 0
    assert took < 3
