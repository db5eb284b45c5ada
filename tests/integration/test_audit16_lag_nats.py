"""Receiver.lag() on NATS JetStream: the durable consumer's ``num_pending`` (stored and not
yet delivered), down as the receiver pulls; None when not connected and, within the
timeout, from a server that stopped answering."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator

import nats
import nats.js.errors
import pytest

from outboxer.brokers import create_publisher
from outboxer.receivers import create_receiver
from outboxer.testing import make_message
from tests.chaos.proxy import FaultProxy
from tests.receiving import collect
from tests.services import require

NATS = "nats://127.0.0.1:4222"


@pytest.fixture
async def topic() -> AsyncIterator[str]:
    require("nats")
    topic = f"lag.{uuid.uuid4().hex[:10]}"
    yield topic
    nc = await nats.connect(NATS)
    try:  # not made if the test failed before its receiver connected
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await nc.jetstream().delete_stream(topic.replace(".", "_"))
    finally:
        await nc.close()


def url(topic: str, port: int = 4222) -> str:
    stream = topic.replace(".", "_")
    return f"nats://127.0.0.1:{port}?stream={stream}&create_stream=true&subjects={topic}"


async def publish(topic: str, count: int) -> None:
    async with create_publisher(url(topic)) as publisher:
        outcomes = await publisher.publish_batch(
            [make_message(topic, {"n": n}) for n in range(count)]
        )
    assert all(outcome.published for outcome in outcomes)


async def test_lag_is_what_the_durable_has_not_delivered(topic: str) -> None:
    receiver = create_receiver(url(topic), group=f"g-{uuid.uuid4().hex[:8]}", topics=[topic])
    assert await receiver.lag() is None  # not connected
    await receiver.connect()
    try:
        assert await receiver.lag() == 0
        await publish(topic, 5)
        assert await receiver.lag() == 5  # stored when the publish was acknowledged
        first = await collect(receiver, 2)
        assert await receiver.lag() == 3
        await receiver.ack(first)
        await receiver.ack(await collect(receiver, 3))
        assert await receiver.lag() == 0
    finally:
        await receiver.close()
    assert await receiver.lag() is None  # closed


async def test_a_server_that_stopped_answering_gives_none_within_the_timeout(
    topic: str,
) -> None:
    await publish(topic, 2)  # creates the stream
    proxy = FaultProxy(4222).start()
    receiver = create_receiver(
        url(topic, proxy.port), group=f"g-{uuid.uuid4().hex[:8]}", topics=[topic]
    )
    try:
        await receiver.connect()
        assert await receiver.lag() == 2
        proxy.stall()
        started = time.monotonic()
        assert await receiver.lag(timeout=0.5) is None
        assert time.monotonic() - started < 1.5
        proxy.resume()
        assert await receiver.lag() == 2
    finally:
        proxy.resume()
        await receiver.close()
        proxy.stop()
