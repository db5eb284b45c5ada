"""The consumer (PyMySQL sessions) against a MariaDB that answers read-only: the old primary
of a failover, left up and fenced with ``read_only`` (see test_audit20_myreadonly_failover).

A read-only answer means the server is no primary: the runner must drop the connection and
connect anew (where a proxy or DNS now leads to the new primary), counting no attempt.
Before, the inbox claim's 1290 was taken for the message's own failure: its attempts were
charged on the old server, each on the same connection, and at ``max_attempts`` it became
a dead letter whose handler never ran (that write refused too, retried on the old server for
ever, or written once the server took writes again)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from outboxer.brokers import create_publisher
from outboxer.consumer import Consumer, Delivery
from outboxer.testing import make_message
from tests.integration.test_audit20_myreadonly_failover import (
    Pair,
    primary_and_replica,
    sessions,
    sql,
)
from tests.relaying import until
from tests.services import require

REDIS = "redis://127.0.0.1:6379/0"


@pytest.fixture
def pair() -> Iterator[Pair]:
    require("redis")
    with primary_and_replica() as made:
        sql(made.old, "CREATE TABLE applied (id CHAR(36) PRIMARY KEY)")  # replicated
        made.caught_up()
        yield made


def applied(port: int) -> set[str]:
    return {row[0] for row in sql(port, "SELECT id FROM applied")}


def dead_letters(port: int) -> list[tuple[Any, ...]]:
    return sql(port, "SELECT message_id, error FROM dead_letters")


def _consumer(pair: Pair, topic: str, max_attempts: int) -> Consumer:
    def record(delivery: Delivery, conn: Any) -> None:
        with conn.cursor() as cursor:
            cursor.execute("INSERT INTO applied (id) VALUES (%s)", (str(delivery.id),))

    return Consumer(
        db=pair.url(),
        broker=REDIS,
        group=f"g-{uuid.uuid4().hex[:8]}",
        topics=[topic],
        handler=record,
        concurrency=1,
        max_attempts=max_attempts,
    )


async def _publish(topic: str, count: int) -> set[str]:
    messages = [make_message(topic, {"n": n}) for n in range(count)]
    async with create_publisher(REDIS) as publisher:
        assert all(o.published for o in await publisher.publish_batch(messages))
    return {str(m.id) for m in messages}


async def _delete_stream(topic: str) -> None:
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(REDIS)
    try:
        await client.delete(topic)
    finally:
        await client.aclose()


async def test_the_consumer_applies_on_the_new_primary_after_a_read_only_failover(
    pair: Pair,
) -> None:
    topic = f"audit20-ro-{uuid.uuid4().hex[:10]}"
    consumer = _consumer(pair, topic, max_attempts=3)
    running = asyncio.create_task(consumer.run_async())
    try:
        first = await _publish(topic, 1)
        await until(lambda: applied(pair.old) == first, "the first message was not applied", 10)
        on_old = sessions(pair.old)
        assert on_old, "the consumer holds no connection to the old primary"
        await asyncio.to_thread(pair.failover)
        later = await _publish(topic, 2)
        await until(
            lambda: applied(pair.new) == first | later,
            "the consumer did not go on on the new primary",
            10,
        )
        assert consumer.stats.failed == 0, consumer.stats  # no attempt charged to a message
        assert dead_letters(pair.new) == []
        assert not sessions(pair.old) & on_old, "the read-only connection was kept"
    finally:
        consumer.stop()
        await asyncio.wait_for(running, 20)
        await _delete_stream(topic)


async def test_a_read_only_database_costs_the_consumer_no_attempt(pair: Pair) -> None:
    """Read-only for a while, no new primary: the message is tried again on new
    connections, never charged; with ``max_attempts=1`` one charge was a dead letter."""
    topic = f"audit20-ro-{uuid.uuid4().hex[:10]}"
    consumer = _consumer(pair, topic, max_attempts=1)
    running = asyncio.create_task(consumer.run_async())
    try:
        first = await _publish(topic, 1)
        await until(lambda: applied(pair.old) == first, "the first message was not applied", 10)
        sql(pair.old, "SET GLOBAL read_only = ON")
        later = await _publish(topic, 1)
        await until(
            lambda: consumer.stats.database_errors >= 2 or consumer.stats.failed > 0,
            "the consumer never met the read-only database",
            10,
        )
        await asyncio.sleep(0.5)  # a retry or two more on the read-only server
        sql(pair.old, "SET GLOBAL read_only = OFF")
        await until(
            lambda: applied(pair.old) == first | later or bool(dead_letters(pair.old)),
            "the message was neither applied nor dead-lettered",
            10,
        )
        assert dead_letters(pair.old) == []
        assert applied(pair.old) == first | later
        assert consumer.stats.failed == 0, consumer.stats
    finally:
        consumer.stop()
        await asyncio.wait_for(running, 20)
        await _delete_stream(topic)


async def test_a_fence_between_the_inbox_claim_and_the_handlers_write_costs_no_attempt(
    pair: Pair,
) -> None:
    """MariaDB fences open transactions too: ``read_only`` set after a message's inbox claim
    fails its handler's write with 1290. That is the database's, not the handler's (no
    attempt), when the session's server is read-only; a 1290 the handler raises while that
    server takes writes (its own read-only database elsewhere) stays its failure."""
    import pymysql

    topic = f"audit20-ro-{uuid.uuid4().hex[:10]}"
    fenced: list[str] = []

    def fence_then_write(delivery: Delivery, conn: Any) -> None:
        if delivery.payload["kind"] == "elsewhere":
            raise pymysql.err.OperationalError(1290, "another server runs with --read-only")
        if not fenced:
            fenced.append(str(delivery.id))
            sql(pair.old, "SET GLOBAL read_only = ON")  # after this message's inbox claim
        with conn.cursor() as cursor:
            cursor.execute("INSERT INTO applied (id) VALUES (%s)", (str(delivery.id),))

    consumer = Consumer(
        db=pair.url(),
        broker=REDIS,
        group=f"g-{uuid.uuid4().hex[:8]}",
        topics=[topic],
        handler=fence_then_write,
        concurrency=1,
        max_attempts=1,
    )
    running = asyncio.create_task(consumer.run_async())
    try:
        async with create_publisher(REDIS) as publisher:
            elsewhere = make_message(topic, {"kind": "elsewhere"})
            assert all(o.published for o in await publisher.publish_batch([elsewhere]))
            await until(lambda: len(dead_letters(pair.old)) == 1, "not dead-lettered", 10)
            assert consumer.stats.failed == 1, consumer.stats
            fenced_message = make_message(topic, {"kind": "fenced"})
            assert all(o.published for o in await publisher.publish_batch([fenced_message]))
        await until(lambda: bool(fenced), "the handler never ran", 10)
        await until(lambda: consumer.stats.database_errors >= 2, "no outage seen", 10)
        sql(pair.old, "SET GLOBAL read_only = OFF")
        await until(
            lambda: (
                applied(pair.old) == {str(fenced_message.id)} or len(dead_letters(pair.old)) > 1
            ),
            "the fenced message was neither applied nor dead-lettered",
            10,
        )
        assert [row[0] for row in dead_letters(pair.old)] == [str(elsewhere.id)]
        assert consumer.stats.failed == 1, consumer.stats
    finally:
        consumer.stop()
        await asyncio.wait_for(running, 20)
        await _delete_stream(topic)
