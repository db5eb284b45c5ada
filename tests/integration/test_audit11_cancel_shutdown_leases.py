"""Shutdown keeps the leases of the messages still being applied: a handler that runs
past the broker's redelivery window (Redis ``claim_idle``) during ``shutdown_timeout`` must
not have its message taken over by another consumer of the group while its transaction is
still open (before, the lease extension stopped with the fetching)."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import redis.asyncio as aioredis

from outboxer.brokers import create_publisher
from outboxer.consumer import Consumer, Delivery
from outboxer.receivers import create_receiver
from outboxer.testing import make_message

REDIS = "redis://127.0.0.1:6379/0"
CLAIM_IDLE = 0.6


async def test_a_handler_running_through_shutdown_keeps_its_lease(
    pg_url: str, redis_stream: str
) -> None:
    message = make_message(redis_stream, {"n": 1}, key="k1")
    async with create_publisher(REDIS) as publisher:
        [outcome] = await publisher.publish_batch([message])
    assert outcome.published, outcome
    started, release = asyncio.Event(), asyncio.Event()
    calls: list[uuid.UUID] = []

    async def handler(delivery: Delivery, conn: Any) -> None:
        calls.append(delivery.id)
        started.set()
        await release.wait()

    consumer = Consumer(
        db=pg_url,
        broker=f"{REDIS}?claim_idle={CLAIM_IDLE}",
        group="g",
        topics=[redis_stream],
        handler=handler,
        name="first",
        shutdown_timeout=30,
    )
    running = asyncio.create_task(consumer.run_async())
    other = create_receiver(
        f"{REDIS}?claim_idle={CLAIM_IDLE}", group="g", topics=[redis_stream], name="second"
    )
    try:
        await asyncio.wait_for(started.wait(), 10)
        consumer.stop()  # the handler goes on: shutdown_timeout is 30 s
        await other.connect()
        # Another consumer of the group, reading for several redelivery windows while the
        # first one's handler still runs: the entry must stay the first one's.
        taken = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 4 * CLAIM_IDLE
        while loop.time() < deadline:
            taken += await other.receive(10, 0.1)
        assert [i.delivery.id for i in taken] == []
        release.set()
        await asyncio.wait_for(running, 10)
    finally:
        release.set()
        if not running.done():
            running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        await other.close()
    assert calls == [message.id]
    assert consumer.stats.applied == 1
    client = aioredis.Redis.from_url(REDIS)
    try:
        assert int((await client.xpending(redis_stream, "g"))["pending"]) == 0
    finally:
        await client.aclose()
