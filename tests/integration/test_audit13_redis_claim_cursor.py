"""Redis receiver: a dead consumer's pending entries behind many that live consumers hold.

XAUTOCLAIM looks at no more than ten times its COUNT pending entries per call and returns
the id where it stopped. The receiver started every call from ``0-0`` again: with more
entries still held (kept fresh) by live consumers at the head of the group's pending list
than one call looks at, a dead consumer's entries behind them were never taken over, for as
long as those were held (a key retrying, a consumer near its prefetch)."""

from __future__ import annotations

import asyncio
import uuid

import redis.asyncio as aioredis

from outboxer.brokers import create_publisher
from outboxer.receivers import create_receiver
from outboxer.receivers.base import Incoming
from outboxer.testing import make_message

REDIS = "redis://127.0.0.1:6379/0"


async def test_a_dead_consumers_entries_behind_many_held_ones_are_taken_over(
    redis_stream: str,
) -> None:
    messages = [make_message(redis_stream, {"n": n}, key=f"k{n}") for n in range(30)]
    async with create_publisher(REDIS) as publisher:
        assert all(o.published for o in await publisher.publish_batch(messages))
    alive = create_receiver(f"{REDIS}?claim_idle=0.3", group="g", topics=[redis_stream], name="a")
    await alive.connect()
    client = aioredis.Redis.from_url(REDIS)
    try:
        held: list[Incoming] = []
        while len(held) < 25:
            held += await alive.receive(25 - len(held), 0.2)
        # The dead consumer's entries come after the 25 the live one holds.
        await client.xreadgroup("g", "dead", {redis_stream: ">"}, count=5)
        taken: list[Incoming] = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 4
        while len(taken) < 5 and loop.time() < deadline:
            await alive.extend(held)  # as the runner does: what it holds never looks idle
            # Nearly at its prefetch: two at most, so an XAUTOCLAIM looks at 20 entries.
            taken += await alive.receive(2, 0.05)
        expected: list[uuid.UUID] = [m.id for m in messages[25:]]
        assert sorted(i.delivery.id for i in taken) == sorted(expected)
        await alive.ack(held + taken)
        assert int((await client.xpending(redis_stream, "g"))["pending"]) == 0
    finally:
        await client.aclose()
        await alive.close()
