"""Broker-side limits of Redis Streams: the publisher's ``maxlen`` trims each stream on every
XADD whatever the consumer groups have read, so a group that falls behind by more than
``maxlen`` entries never sees the ones trimmed before it read them; no error anywhere, the
relay counted them published. The docs must say so, with what to do instead."""

from __future__ import annotations

import logging
import uuid
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from outboxer.brokers import create_publisher
from outboxer.receivers import create_receiver
from outboxer.receivers.base import Incoming
from outboxer.testing import make_message
from tests.services import require

REDIS = "redis://127.0.0.1:6379/0"
DOCS = Path(__file__).resolve().parents[2] / "docs" / "brokers" / "redis.md"


async def test_entries_trimmed_before_a_group_read_them_are_lost_and_documented() -> None:
    require("redis")
    topic = f"audit5-limits-{uuid.uuid4().hex[:10]}"
    receiver = create_receiver(REDIS, group="slow", topics=[topic], name="a")
    await receiver.connect()  # the group exists before anything is published
    try:
        messages = [make_message(topic, {"n": n}) for n in range(300)]
        async with create_publisher(f"{REDIS}?maxlen=10") as publisher:
            for start in range(0, 300, 100):
                outcomes = await publisher.publish_batch(messages[start : start + 100])
                assert all(o.published for o in outcomes)
        received: list[Incoming] = []
        while batch := await receiver.receive(500, 0.1):
            received += batch
            await receiver.ack(batch)
    finally:
        await receiver.close()
        client = aioredis.Redis.from_url(REDIS)
        await client.delete(topic)
        await client.aclose()
    # Only the newest entries are left: the group never saw the oldest ones.
    ids = [i.delivery.id for i in received]
    assert 10 <= len(ids) < 300
    assert ids == [m.id for m in messages[-len(ids) :]]
    docs = " ".join(DOCS.read_text("utf-8").split())
    for said in (
        "whether or not every consumer group has read them",
        "counted as published",
        "XTRIM",
        "MINID",
    ):
        assert said in docs, said


async def test_pending_entries_trimmed_before_they_were_applied_are_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A consumer handed entries that it did not apply (it crashed, its handler retried) and
    that ``maxlen`` trimmed meanwhile finds them gone from the stream: the receiver
    acknowledges them, as nothing is left to apply. Those messages are lost, and a warning
    must say so (which group, which stream, how many), not an empty pending list alone."""
    require("redis")
    topic = f"audit5-limits-{uuid.uuid4().hex[:10]}"
    receiver = create_receiver(REDIS, group="g", topics=[topic], name="a")
    client = aioredis.Redis.from_url(REDIS)
    try:
        await receiver.connect()
        messages = [make_message(topic, {"n": n}) for n in range(3)]
        async with create_publisher(REDIS) as publisher:
            assert all(o.published for o in await publisher.publish_batch(messages))
        assert len(await receiver.receive(10, 1.0)) == 3  # handed over, never acknowledged
        await client.xtrim(topic, maxlen=1, approximate=False)
        await receiver.close()
        with caplog.at_level(logging.WARNING, logger="outboxer.receiver"):
            await receiver.connect()
            [survivor] = await receiver.receive(10, 1.0)
        assert survivor.delivery.id == messages[2].id
    finally:
        await receiver.close()
        await client.delete(topic)
        await client.aclose()
    [warning] = [r for r in caplog.records if "gone from the stream" in r.getMessage()]
    assert warning.levelno == logging.WARNING
    assert "2 pending entries" in warning.getMessage()
    assert repr(topic) in warning.getMessage() and "'g'" in warning.getMessage()


async def test_a_dead_consumers_trimmed_entries_are_logged_when_claimed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """XAUTOCLAIM drops pending entries no longer in the stream from the pending list itself
    (Redis 7) and names them apart: the consumer taking over a dead one's entries must report
    those as lost too."""
    require("redis")
    topic = f"audit5-limits-{uuid.uuid4().hex[:10]}"
    dead = create_receiver(REDIS, group="g", topics=[topic], name="dead")
    alive = create_receiver(f"{REDIS}?claim_idle=0.2", group="g", topics=[topic], name="alive")
    client = aioredis.Redis.from_url(REDIS)
    try:
        await dead.connect()
        messages = [make_message(topic, {"n": n}) for n in range(3)]
        async with create_publisher(REDIS) as publisher:
            assert all(o.published for o in await publisher.publish_batch(messages))
        assert len(await dead.receive(10, 1.0)) == 3
        await dead.close()
        await client.xtrim(topic, maxlen=1, approximate=False)
        with caplog.at_level(logging.WARNING, logger="outboxer.receiver"):
            await alive.connect()
            taken: list[Incoming] = []
            for _ in range(20):  # the entries become claimable once idle 0.2 s
                taken += await alive.receive(10, 0.1)
                if taken:
                    break
        assert [i.delivery.id for i in taken] == [messages[2].id]
    finally:
        await alive.close()
        await client.delete(topic)
        await client.aclose()
    [warning] = [r for r in caplog.records if "gone from the stream" in r.getMessage()]
    assert "2 pending entries" in warning.getMessage()
