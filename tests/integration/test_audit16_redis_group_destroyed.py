"""Redis receiver: a consumer group destroyed under it (XGROUP DESTROY, or the stream
deleted and written again) is created again from the stream's first entry, which reads
every entry still in the stream once more. That went unsaid; now a WARNING names the
stream, the group and how many entries are read from the start."""

from __future__ import annotations

import asyncio
import logging
import uuid

import pytest
import redis.asyncio as aioredis

from outboxer.brokers import create_publisher
from outboxer.errors import BrokerUnavailableError
from outboxer.receivers import create_receiver
from outboxer.receivers.base import Incoming
from outboxer.testing import make_message
from tests.services import require

REDIS = "redis://127.0.0.1:6379/0"


async def test_a_destroyed_group_is_created_again_loudly(caplog: pytest.LogCaptureFixture) -> None:
    require("redis")
    stream, group = f"test-{uuid.uuid4().hex[:12]}", f"g-{uuid.uuid4().hex[:8]}"
    client = aioredis.Redis.from_url(REDIS)
    receiver = create_receiver(REDIS, group=group, topics=[stream], name="audit")
    try:
        async with create_publisher(REDIS) as publisher:
            messages = [make_message(stream, {"n": n}, key=f"k{n}") for n in range(4)]
            assert all(o.published for o in await publisher.publish_batch(messages))
        with caplog.at_level(logging.INFO, logger="outboxer.receiver"):
            await receiver.connect()
        # Created the first time: no warning (the group is new, reading from 0 is the point).
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        got: list[Incoming] = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5
        while len(got) < 4 and loop.time() < deadline:
            got += await receiver.receive(4, 0.1)
        await receiver.ack(got)
        assert await client.xgroup_destroy(stream, group) == 1
        with pytest.raises(BrokerUnavailableError, match="NOGROUP"):
            await receiver.receive(4, 0.1)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="outboxer.receiver"):
            await receiver.connect()
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1, warnings
        assert stream in warnings[0] and group in warnings[0] and " 4 entries" in warnings[0]
        # The semantics stay: every entry is read again (the inbox skips those it remembers).
        again: list[Incoming] = []
        deadline = loop.time() + 5
        while len(again) < 4 and loop.time() < deadline:
            again += await receiver.receive(4, 0.1)
        assert [i.delivery.id for i in again] == [m.id for m in messages]
        await receiver.ack(again)
    finally:
        await receiver.close()
        await client.delete(stream)
        await client.aclose()
