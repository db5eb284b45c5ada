"""Receiver.lag() on Redis Streams: XINFO GROUPS' ``lag`` (entries no consumer of the
group was handed yet), summed over the group's streams, down as the receiver reads; None
when not connected, and where Redis cannot tell (entries deleted ahead of the group)."""

from __future__ import annotations

import uuid

import redis.asyncio as aioredis

from outboxer.brokers import create_publisher
from outboxer.receivers import create_receiver
from outboxer.testing import make_message
from tests.receiving import collect
from tests.services import require

REDIS = "redis://127.0.0.1:6379/0"


async def test_lag_is_what_the_group_was_not_handed_over_all_its_streams() -> None:
    require("redis")
    streams = [f"lag-{uuid.uuid4().hex[:12]}" for _ in range(2)]
    receiver = create_receiver(REDIS, group=f"g-{uuid.uuid4().hex[:8]}", topics=streams)
    client = aioredis.Redis.from_url(REDIS)
    try:
        assert await receiver.lag() is None  # not connected
        await receiver.connect()  # the group, from each stream's first entry
        assert await receiver.lag() == 0
        async with create_publisher(REDIS) as publisher:
            for stream, count in zip(streams, (3, 4), strict=True):
                messages = [make_message(stream, {"n": n}) for n in range(count)]
                assert all(o.published for o in await publisher.publish_batch(messages))
        assert await receiver.lag() == 7
        taken = await collect(receiver, 7)
        assert await receiver.lag() == 0  # handed over; unacked ones are not lag
        await receiver.ack(taken)
        # An entry deleted ahead of the group: Redis no longer knows the lag.
        entry = await client.xadd(streams[0], {"x": "1"})
        await client.xadd(streams[0], {"x": "2"})
        await client.xdel(streams[0], entry)
        assert await receiver.lag() is None
    finally:
        await receiver.close()
        await client.delete(*streams)
        await client.aclose()
    assert await receiver.lag() is None  # closed
