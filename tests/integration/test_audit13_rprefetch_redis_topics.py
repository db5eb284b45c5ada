"""Redis receiver: one receive returns at most ``limit`` entries over all its streams.

XREADGROUP's and XAUTOCLAIM's COUNT bound each stream, not the reply: a consumer of three
topics got up to three times ``limit`` from one ``receive(limit)`` (receive(5) returned 15),
and the runner, which asks for the room left under its prefetch, held three times its
prefetch (memory, and that many handlers at once where the user sized five)."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import psycopg
import pytest
import redis.asyncio as aioredis

from outboxer.brokers import create_publisher
from outboxer.consumer import Consumer, Delivery
from outboxer.receivers import create_receiver
from outboxer.receivers.base import Incoming
from outboxer.testing import make_message

REDIS = "redis://127.0.0.1:6379/0"
PER_TOPIC = 12


@pytest.fixture
async def topics(redis_stream: str) -> AsyncIterator[list[str]]:
    names = [f"{redis_stream}-{n}" for n in range(3)]
    yield names
    client = aioredis.Redis.from_url(REDIS)
    try:
        await client.delete(*names)
    finally:
        await client.aclose()


async def publish(topics: Sequence[str], count: int) -> dict[str, list[uuid.UUID]]:
    """``count`` entries on each topic, keyed four ways; their ids in stream order."""
    messages = [
        make_message(t, {"n": n}, key=f"{t}/k{n % 4}") for t in topics for n in range(count)
    ]
    async with create_publisher(REDIS) as publisher:
        assert all(o.published for o in await publisher.publish_batch(messages))
    return {t: [m.id for m in messages if m.topic == t] for t in topics}


def by_topic(incomings: Sequence[Incoming]) -> dict[str, list[uuid.UUID]]:
    grouped: dict[str, list[uuid.UUID]] = {}
    for incoming in incomings:
        grouped.setdefault(incoming.delivery.topic, []).append(incoming.delivery.id)
    return grouped


async def test_one_receive_returns_at_most_limit_and_keeps_the_rest_alive(
    topics: list[str],
) -> None:
    published = await publish(topics, 5)
    first = create_receiver(f"{REDIS}?claim_idle=0.3", group="g", topics=topics, name="a")
    other = create_receiver(f"{REDIS}?claim_idle=0.3", group="g", topics=topics, name="b")
    await first.connect()
    await other.connect()
    try:
        held = await first.receive(5, 0.5)
        assert len(held) == 5  # was 15: five from each stream
        # The ten read beyond the limit are this consumer's pending entries, not handed out
        # yet: kept from looking idle with those it holds, the other consumer never takes
        # them over (nor anything else: every entry is the first consumer's).
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 1.0
        while loop.time() < deadline:
            await first.extend(held)
            assert await other.receive(5, 0.05) == []
            await asyncio.sleep(0.05)
        rest = await first.receive(5, 0.5)
        rest += await first.receive(5, 0.5)
        assert len(rest) == 10
        assert await first.receive(5, 0.1) == []
        # Each entry once, each stream's in stream order.
        assert by_topic(held + rest) == published
        await first.ack(held + rest)
    finally:
        await first.close()
        await other.close()


def test_a_consumer_of_three_topics_holds_at_most_its_prefetch(
    pg_url: str, topics: list[str]
) -> None:
    published = asyncio.run(publish(topics, PER_TOPIC))
    with psycopg.connect(pg_url) as conn:
        conn.execute(
            "CREATE TABLE applied (position serial PRIMARY KEY, message_id uuid NOT NULL,"
            " topic text NOT NULL, key text NOT NULL)"
        )
    lock = threading.Lock()
    running = 0
    most_running = most_held = most_out = 0
    consumer: Consumer

    def handler(message: Delivery, conn: Any) -> None:
        nonlocal running, most_running, most_held, most_out
        stats = consumer.receiver.stats
        with lock:
            running += 1
            most_running = max(most_running, running)
            most_held = max(most_held, consumer._held)
            # Handed out by the receiver and not acked yet: what the consumer holds, counted
            # on the receiver's side rather than by the runner's own accounting.
            most_out = max(most_out, stats.received - stats.acked)
        try:
            conn.execute(
                "INSERT INTO applied (message_id, topic, key) VALUES (%s, %s, %s)",
                (message.id, message.topic, message.key),
            )
            threading.Event().wait(0.02)  # long enough for the others to start meanwhile
        finally:
            with lock:
                running -= 1

    consumer = Consumer(
        db=pg_url,
        broker=REDIS,
        group="g",
        handler=handler,
        topics=topics,
        concurrency=16,
        batch=1,
        prefetch=5,
        name="prefetch",
        exit_when_idle=True,
    )
    asyncio.run(asyncio.wait_for(consumer.run_async(), 30))
    assert most_out <= 5 and most_held <= 5 and most_running <= 5, (
        most_out,
        most_held,
        most_running,
    )
    with psycopg.connect(pg_url) as conn:
        applied = conn.execute("SELECT message_id, topic, key FROM applied ORDER BY position")
        rows = applied.fetchall()
    # Each entry exactly once; each key's in stream order (the order the runner keeps).
    assert sorted(m for m, _, _ in rows) == sorted(i for ids in published.values() for i in ids)
    for topic, ids in published.items():
        for k in range(4):
            key = f"{topic}/k{k}"
            assert [m for m, _, mk in rows if mk == key] == ids[k::4]
    assert consumer.stats.duplicates == 0
    assert consumer.receiver.stats.received == 3 * PER_TOPIC
