"""``Incoming.redelivered`` as each broker tells it, on the real servers: a first delivery is
not redelivered; a message handed back unacknowledged (its consumer closed: it died) is,
on RabbitMQ (the deliver's redelivered flag), Redis (an entry read again from the
consumer's pending list) and NATS JetStream (num_delivered > 1). The consumer records such
a message's attempt before its handler runs (a suspect), so the flag must be right: a
false negative leaves the crash loop open, a false positive costs a commit each message."""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable

import aio_pika
import pytest

from outboxer.brokers import create_publisher
from outboxer.receivers import create_receiver
from outboxer.receivers.base import Incoming, Receiver
from outboxer.testing import make_message
from tests.services import require

AMQP = "amqp://guest:guest@127.0.0.1:5672/"
REDIS = "redis://127.0.0.1:6379/0"
NATS = "nats://127.0.0.1:4222"


async def collect(receiver: Receiver, count: int, timeout: float) -> list[Incoming]:
    got: list[Incoming] = []
    deadline = time.monotonic() + timeout
    while len(got) < count and time.monotonic() < deadline:
        got += await receiver.receive(count - len(got), 0.5)
    assert len(got) == count, f"received {len(got)} of {count}"
    return got


def rabbitmq(topic: str, group: str) -> tuple[str, Callable[[], Awaitable[None]]]:
    require("rabbitmq")
    url = f"{AMQP}?exchange=x-{topic}"

    async def cleanup() -> None:
        connection = await aio_pika.connect(AMQP)
        channel = await connection.channel()
        await channel.queue_delete(group)
        await channel.exchange_delete(f"x-{topic}")
        await connection.close()

    return url, cleanup


def redis(topic: str, group: str) -> tuple[str, Callable[[], Awaitable[None]]]:
    require("redis")

    async def cleanup() -> None:
        import redis.asyncio as aioredis

        client = aioredis.Redis.from_url(REDIS)
        await client.delete(topic)
        await client.aclose()

    return REDIS, cleanup


def nats(topic: str, group: str) -> tuple[str, Callable[[], Awaitable[None]]]:
    require("nats")
    stream = topic.replace(".", "_")

    async def cleanup() -> None:
        import nats as nats_client

        nc = await nats_client.connect(NATS)
        await nc.jetstream().delete_stream(stream)
        await nc.close()

    # ack_wait: how soon JetStream sends the dead consumer's message again.
    url = f"{NATS}?stream={stream}&create_stream=true&subjects={topic}&ack_wait=1"
    return url, cleanup


BROKERS = {"rabbitmq": rabbitmq, "redis": redis, "nats": nats}


@pytest.mark.parametrize("broker", list(BROKERS))
async def test_a_message_handed_back_unacknowledged_comes_again_marked_redelivered(
    broker: str,
) -> None:
    topic = f"redeliver.{uuid.uuid4().hex[:8]}"
    group = f"g-{uuid.uuid4().hex[:8]}"
    url, cleanup = BROKERS[broker](topic, group)

    def receiver() -> Receiver:
        # One consumer name: Redis reads that name's pending list first after a restart.
        return create_receiver(url, group=group, topics=[topic], name="one")

    try:
        first = receiver()
        await first.connect()
        acked, dying = make_message(topic, {"n": 1}, key="a"), make_message(topic, {"n": 2})
        async with create_publisher(url) as publisher:
            assert all(o.published for o in await publisher.publish_batch([acked, dying]))
        got = await collect(first, 2, 10.0)
        assert [(i.delivery.id, i.redelivered) for i in got] == [
            (acked.id, False),
            (dying.id, False),
        ]
        await first.ack(got[:1])
        await first.close()  # the other one never acked: its consumer died

        second = receiver()
        await second.connect()
        try:
            [again] = await collect(second, 1, 10.0)
            assert (again.delivery.id, again.redelivered) == (dying.id, True)
            await second.ack([again])
            fresh = make_message(topic, {"n": 3})
            async with create_publisher(url) as publisher:
                assert all(o.published for o in await publisher.publish_batch([fresh]))
            [new] = await collect(second, 1, 10.0)
            assert (new.delivery.id, new.redelivered) == (fresh.id, False)
            await second.ack([new])
        finally:
            await second.close()
    finally:
        await cleanup()
