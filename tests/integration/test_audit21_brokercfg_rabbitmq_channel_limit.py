"""A RabbitMQ user with a ``max-channels`` limit (``rabbitmqctl set_user_limits``), below
the relay's lanes (one channel per wave in flight: ``concurrency`` loops at once).

RabbitMQ closes the whole connection (530 NOT_ALLOWED) for a channel over the limit, every
lane's waves with it. The publisher reconnected and opened as many lanes again: a
reconnect at every round of concurrent waves, most of their messages failing (not
attempted) each time. Now it learns the limit from the first close and keeps its lanes
within it, the waves beyond it waiting for a lane. A user of its own, deleted at the end.
"""

from __future__ import annotations

import asyncio
import subprocess
import uuid
from collections.abc import AsyncIterator

import aio_pika
import pytest

from outboxer.brokers.rabbitmq import RabbitMQPublisher
from outboxer.testing import make_message
from tests.rabbit import AMQP_URL

pytestmark = pytest.mark.timeout(30)


def _ctl(*args: str) -> None:
    subprocess.run(["rabbitmqctl", "-q", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
async def limited_url() -> AsyncIterator[str]:
    tag = f"audit21-chan-{uuid.uuid4().hex[:8]}"
    connection = await aio_pika.connect(AMQP_URL)
    channel = await connection.channel()
    exchange = await channel.declare_exchange(tag, "topic", durable=True)
    sink = await channel.declare_queue(tag, durable=True, arguments={"x-max-length": 0})
    await sink.bind(exchange, "#")
    _ctl("add_user", tag, "pw")
    try:
        _ctl("set_permissions", "-p", "/", tag, f"^{tag}$", f"^{tag}$", f"^{tag}$")
        _ctl("set_user_limits", tag, '{"max-channels": 2}')
        yield f"amqp://{tag}:pw@127.0.0.1:5672/?exchange={tag}"
    finally:
        _ctl("delete_user", tag)
        await channel.queue_delete(tag)
        await channel.exchange_delete(tag)
        await connection.close()


async def test_waves_keep_within_a_users_channel_limit(limited_url: str) -> None:
    publisher = RabbitMQPublisher(limited_url, publish_timeout=5)
    rounds = []
    async with publisher:
        for _ in range(4):
            if not publisher.connected:
                await publisher.connect()
            waves = await asyncio.gather(
                *(
                    publisher.publish_batch([make_message(f"k.{i}", {"n": i}) for i in range(3)])
                    for _ in range(4)
                )
            )
            rounds.append(sum(o.published for wave in waves for o in wave))
            assert all(o.published or not o.attempted for wave in waves for o in wave)
    assert rounds[1:] == [12, 12, 12]  # before: 3 of 12 each round, and a reconnect each
    assert publisher.stats.connects <= 2
    assert publisher._lane_cap == 2
