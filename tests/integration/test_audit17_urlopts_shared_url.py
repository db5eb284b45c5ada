"""One URL, the consumer's options included, serves the relay and the consumers, against the
real servers: the relay's publisher connects and publishes where the consumer reads. Redis
before: redis-py got ``claim_idle`` and refused every connect (an outage retried for ever)."""

from __future__ import annotations

import uuid

import nats
import redis.asyncio as aioredis

from outboxer.brokers import create_publisher
from outboxer.receivers import create_receiver
from outboxer.testing import make_message
from tests.receiving import collect
from tests.services import require


async def test_redis_the_consumers_url_publishes_where_the_consumer_reads() -> None:
    require("redis")
    prefix = f"shared-{uuid.uuid4().hex[:8]}:"
    url = f"redis://127.0.0.1:6379/0?stream_prefix={prefix}&claim_idle=30"
    receiver = create_receiver(url, group=f"g-{uuid.uuid4().hex[:8]}", topics=["orders"])
    client = aioredis.Redis.from_url("redis://127.0.0.1:6379/0")
    try:
        await receiver.connect()
        async with create_publisher(url) as publisher:
            messages = [make_message("orders", {"n": n}, key="k") for n in range(3)]
            assert all(o.published for o in await publisher.publish_batch(messages))
        taken = await collect(receiver, 3)
        assert [incoming.delivery.id for incoming in taken] == [m.id for m in messages]
        assert await client.xlen(f"{prefix}orders") == 3
        await receiver.ack(taken)
    finally:
        await receiver.close()
        await client.delete(f"{prefix}orders")
        await client.aclose()


async def test_nats_the_consumers_url_publishes_where_the_consumer_reads() -> None:
    require("nats")
    token = uuid.uuid4().hex[:8]
    url = (
        f"nats://127.0.0.1:4222?subject_prefix=shared{token}.&stream=SHARED{token}"
        f"&create_stream=true&ack_wait=30&durable=billing{token}"
    )
    async with create_publisher(url) as publisher:  # creates the stream
        receiver = create_receiver(url, group=f"g{token}", topics=["orders"])
        try:
            await receiver.connect()
            messages = [make_message("orders", {"n": n}, key="k") for n in range(3)]
            assert all(o.published for o in await publisher.publish_batch(messages))
            taken = await collect(receiver, 3)
            assert [incoming.delivery.id for incoming in taken] == [m.id for m in messages]
            await receiver.ack(taken)
        finally:
            await receiver.close()
            nc = await nats.connect("nats://127.0.0.1:4222")
            try:
                await nc.jetstream().delete_stream(f"SHARED{token}")
            finally:
                await nc.close()
