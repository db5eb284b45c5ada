"""Receiver.lag() on RabbitMQ: the group queue's ready messages (a passive declare on a
channel of its own), down as the consumer takes and acks them; None when not connected, for
a queue that is gone (without disturbing the consuming channel) and for a broker that
stopped answering (within the timeout)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aio_pika
import pytest

from outboxer.brokers import create_publisher
from outboxer.receivers import create_receiver
from outboxer.testing import make_message
from tests.chaos.proxy import FaultProxy
from tests.receiving import collect, lag_becomes
from tests.services import require

AMQP = "amqp://guest:guest@127.0.0.1:5672/"


@pytest.fixture
async def names() -> AsyncIterator[tuple[str, str]]:
    require("rabbitmq")
    tag = uuid.uuid4().hex[:10]
    group, exchange = f"lag-{tag}", f"x-lag-{tag}"
    yield group, exchange
    connection = await aio_pika.connect(AMQP)
    channel = await connection.channel()
    await channel.queue_delete(group)
    await channel.exchange_delete(exchange)
    await connection.close()


async def publish(exchange: str, count: int) -> None:
    async with create_publisher(f"{AMQP}?exchange={exchange}") as publisher:
        outcomes = await publisher.publish_batch(
            [make_message("t.lag", {"n": n}) for n in range(count)]
        )
    assert all(outcome.published for outcome in outcomes)


async def test_lag_counts_ready_messages_and_goes_down_as_they_are_acked(
    names: tuple[str, str],
) -> None:
    group, exchange = names
    receiver = create_receiver(f"{AMQP}?exchange={exchange}", group=group, prefetch=2)
    assert await receiver.lag() is None  # not connected
    await receiver.connect()
    try:
        assert await receiver.lag() == 0
        await publish(exchange, 6)
        # Two are handed to this consumer (prefetch), four wait in the queue.
        assert await lag_becomes(receiver, lambda n: n == 4, "4") == 4
        await receiver.ack(await collect(receiver, 2))
        assert await lag_becomes(receiver, lambda n: n == 2, "2") == 2
        await receiver.ack(await collect(receiver, 2))
        await receiver.ack(await collect(receiver, 2))
        assert await lag_becomes(receiver, lambda n: n == 0, "0") == 0
    finally:
        await receiver.close()
    assert await receiver.lag() is None  # closed


async def test_a_failed_passive_declare_leaves_the_consuming_channel_alone(
    names: tuple[str, str],
) -> None:
    group, exchange = names
    receiver: Any = create_receiver(f"{AMQP}?exchange={exchange}", group=group)
    await receiver.connect()
    try:
        receiver.queue = f"missing-{uuid.uuid4().hex}"  # the 404 closes the lag's channel
        assert await receiver.lag() is None
        receiver.queue = group
        await publish(exchange, 3)
        got = await collect(receiver, 3)  # the consumer still receives, and its acks go out
        await receiver.ack(got)
        assert receiver.connected and receiver.stats.failed_acks == 0
        assert await lag_becomes(receiver, lambda n: n == 0, "0") == 0
    finally:
        await receiver.close()


async def test_a_broker_that_stopped_answering_gives_none_within_the_timeout(
    names: tuple[str, str],
) -> None:
    group, exchange = names
    proxy = FaultProxy(5672).start()
    receiver = create_receiver(
        f"amqp://guest:guest@127.0.0.1:{proxy.port}/?exchange={exchange}", group=group
    )
    try:
        await receiver.connect()
        proxy.stall()
        started = time.monotonic()
        assert await receiver.lag(timeout=0.5) is None
        assert time.monotonic() - started < 1.5
        assert await receiver.lag(timeout=0.3) is None  # the same query, still unanswered
        proxy.resume()
        assert await lag_becomes(receiver, lambda n: n == 0, "0") == 0
    finally:
        proxy.resume()
        await receiver.close()
        proxy.stop()
