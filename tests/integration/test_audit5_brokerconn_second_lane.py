"""A wave that needs a connection (Redis) or a channel (RabbitMQ) of its own, beside a wave
already in flight, and cannot get it: nothing of it was written, so it goes back untried
(NotSent). It failed as attempted: a relay with ``concurrency`` > 1 used up an attempt of
every message of the wave for a broker that refused a new client (Redis maxclients) or
dropped the connection while the channel opened."""

from __future__ import annotations

import asyncio
import uuid

import redis.asyncio as aioredis

from outboxer.brokers import create_publisher
from outboxer.brokers.base import OutcomeKind
from outboxer.testing import eventually, make_message
from tests.integration.test_audit5_brokerconn_idle_drop import Dropper, closed_port
from tests.services import require


async def test_redis_a_new_connection_refused_is_not_an_attempt() -> None:
    require("redis")
    prefix = f"audit5-lane-{uuid.uuid4().hex[:8]}-"
    dropper = Dropper(6379)
    publisher = create_publisher(
        f"redis://127.0.0.1:{dropper.proxy.port}/0?stream_prefix={prefix}", publish_timeout=3
    )
    try:
        await publisher.connect()
        # The connection the publisher has stays up; a new one is refused.
        dropper.proxy.target_port = closed_port()
        first, second = await asyncio.gather(
            publisher.publish_batch([make_message("t", key="a")]),
            publisher.publish_batch([make_message("t", key="b")]),
        )
        assert [o.kind for o in first] == [OutcomeKind.PUBLISHED], first
        assert [(o.kind, o.attempted) for o in second] == [(OutcomeKind.FAILED, False)], second
    finally:
        await publisher.close()
        dropper.proxy.stop()
        client = aioredis.Redis.from_url("redis://127.0.0.1:6379/0")
        await client.delete(f"{prefix}t")
        await client.aclose()


async def test_rabbitmq_a_connection_lost_while_a_channel_opens_is_not_an_attempt() -> None:
    require("rabbitmq")
    dropper = Dropper(5672)
    publisher = create_publisher(
        f"amqp://guest:guest@127.0.0.1:{dropper.proxy.port}/?exchange=audit5-lane-"
        f"{uuid.uuid4().hex[:8]}&mandatory=false",
        publish_timeout=3,
    )
    try:
        await publisher.connect()
        dropper.proxy.stall()
        # The first wave takes the channel it has, the second opens one: both held.
        first = asyncio.ensure_future(publisher.publish_batch([make_message("t", key="a")]))
        second = asyncio.ensure_future(publisher.publish_batch([make_message("t", key="b")]))
        connection = publisher._connection.transport.connection  # type: ignore[attr-defined]

        async def opening() -> bool:
            return len(connection.channels) == 2

        await eventually(opening, timeout=2, interval=0.01)
        dropper.drop()
        written, not_written = await first, await second
        assert [(o.kind, o.attempted) for o in written] == [(OutcomeKind.FAILED, True)]
        assert [(o.kind, o.attempted) for o in not_written] == [(OutcomeKind.FAILED, False)], (
            not_written
        )
    finally:
        dropper.proxy.resume()
        await publisher.close()
        dropper.proxy.stop()
