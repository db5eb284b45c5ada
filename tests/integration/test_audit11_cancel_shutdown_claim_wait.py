"""Shutdown while a sync worker's thread waits in its inbox claim (a concurrent delivery of
the same id holds the inbox row): the runner must neither wait for that thread beyond
``shutdown_timeout`` + ``CANCELLED_WAIT`` nor close the connection under it (before, the
close queued behind the thread, and ``run_async`` hung as long as the other transaction
held the row; with free threads it closed the connection from another thread while the
first was still inside its transaction)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import psycopg
import pytest

from outboxer.brokers import create_publisher
from outboxer.consumer import Consumer, Delivery
from outboxer.errors import ConsumerShutdownError
from outboxer.testing import make_message

REDIS = "redis://127.0.0.1:6379/0"


class Database:
    """The consumer's database (PostgreSQL), seen from connections of the test's own."""

    inbox = "outboxer.inbox"
    claim_waiting = (
        "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
        "AND query LIKE '%%inbox%%' AND pid <> pg_backend_pid()"
    )

    def __init__(self, url: str) -> None:
        self.url = url

    def connect(self, autocommit: bool = False) -> Any:
        return psycopg.connect(self.url, autocommit=autocommit)

    def query(self, conn: Any, sql: str, params: tuple[Any, ...] = ()) -> list[Any]:
        cursor = conn.execute(sql, params)
        return cursor.fetchall() if cursor.description else []


@pytest.fixture
def db(pg_url: str) -> Database:
    return Database(pg_url)


async def test_shutdown_does_not_wait_for_a_claim_blocked_on_a_lock(
    db: Database, redis_stream: str
) -> None:
    pg_url = db.url
    message = make_message(redis_stream, {"n": 1}, key="k1")

    def handler(delivery: Delivery, conn: Any) -> None:
        pass

    # Another consumer's open transaction holds the message's inbox row.
    holder = db.connect()
    db.query(
        holder,
        f"INSERT INTO {db.inbox} (consumer, message_id) VALUES ('g', %s)",
        (str(message.id),),
    )
    watcher = db.connect(autocommit=True)
    consumer = Consumer(
        db=pg_url,
        broker=REDIS,
        group="g",
        topics=[redis_stream],
        handler=handler,
        concurrency=1,  # the close queued behind the blocked thread
        shutdown_timeout=0.2,
    )
    running = asyncio.create_task(consumer.run_async())
    try:
        async with create_publisher(REDIS) as publisher:
            [outcome] = await publisher.publish_batch([message])
        assert outcome.published, outcome
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while not db.query(watcher, db.claim_waiting):
            assert loop.time() < deadline, "the consumer's claim never waited on the row"
            await asyncio.sleep(0.05)
        consumer.stop()
        started = time.monotonic()
        done, _ = await asyncio.wait({running}, timeout=5)
        took = time.monotonic() - started
        assert done, "run_async waited for the blocked claim"
        with pytest.raises(ConsumerShutdownError) as raised:
            running.result()
        assert raised.value.message_ids == [str(message.id)]
        assert took < 3
        # The session was left open under its thread, not closed, and is marked abandoned:
        # once the row is free, the claim goes on, and the batch rolls back, not commits.
        [(session, _)] = consumer._batches.values()
        assert session.abandoned and session.conn is not None
        holder.rollback()
        deadline = loop.time() + 10
        while session.busy():
            assert loop.time() < deadline, "the abandoned thread never ended"
            await asyncio.sleep(0.05)
        assert not db.query(
            watcher, f"SELECT 1 FROM {db.inbox} WHERE message_id = %s", (str(message.id),)
        )
        # Not closed by hand: the consumer closes it once its call ended (close_after).
    finally:
        consumer.stop()
        holder.rollback()
        holder.close()
        watcher.close()
        await asyncio.gather(running, return_exceptions=True)
