"""Redis receiver: one XAUTOCLAIM pass takes over no more than the receive asked for.

COUNT bounds each stream's XAUTOCLAIM, not the pass: with several topics one pass took up
to ``limit`` entries of a dead consumer *per stream*. What the receive could not hand out
waited in the receiver's memory, ours in the group's pending list and kept fresh there, so
no other live consumer could take them over meanwhile, however much room it had."""

from __future__ import annotations

import asyncio
import uuid

import redis.asyncio as aioredis

from outboxer.brokers import create_publisher
from outboxer.receivers import create_receiver
from outboxer.receivers.base import Incoming
from outboxer.testing import make_message
from tests.services import require

REDIS = "redis://127.0.0.1:6379/0"


async def test_a_claim_pass_over_several_streams_takes_no_more_than_the_limit() -> None:
    require("redis")
    streams = [f"test-{uuid.uuid4().hex[:12]}" for _ in range(3)]
    group = f"g-{uuid.uuid4().hex[:8]}"
    client = aioredis.Redis.from_url(REDIS)
    receiver = create_receiver(f"{REDIS}?claim_idle=0.2", group=group, topics=streams, name="alive")
    try:
        async with create_publisher(REDIS) as publisher:
            for stream in streams:
                messages = [make_message(stream, {"n": n}, key=f"k{n}") for n in range(10)]
                assert all(o.published for o in await publisher.publish_batch(messages))
        await receiver.connect()  # creates the group on each stream
        for stream in streams:  # a consumer that reads everything, then dies
            assert len((await client.xreadgroup(group, "dead", {stream: ">"}, count=10))[0][1])
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5
        taken: list[Incoming] = []
        while not taken and loop.time() < deadline:
            taken = await receiver.receive(4, 0.05)
        assert len(taken) == 4
        assert all(i.redelivered for i in taken)
        mine = 0
        for stream in streams:
            for consumer in (await client.xpending(stream, group))["consumers"]:
                if consumer["name"] == b"alive":
                    mine += int(consumer["pending"])
        # Only what was handed out is ours: the rest stays with the dead consumer, for any
        # live consumer with room to take over.
        assert mine == 4
        # The rest comes on the next receives, all of it, each once: a pass cut short by
        # the limit goes on with the streams it did not finish.
        while len(taken) < 30 and loop.time() < deadline:
            taken += await receiver.receive(4, 0.05)
        assert len({i.delivery.id for i in taken}) == len(taken) == 30
        await receiver.ack(taken)
        for stream in streams:
            assert int((await client.xpending(stream, group))["pending"]) == 0
    finally:
        await receiver.close()
        await client.delete(*streams)
        await client.aclose()
