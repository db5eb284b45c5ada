"""Review of the learned channel limit (a user's ``max-channels``, the server's
``channel_max``) on a real RabbitMQ; users of the tests' own, deleted at the end.

- The limit learned from a 530 was kept for ever: an operator who raised it left the relay
  throttled until a restart. Now, ``lane_cap_retry`` after it was learned, one wave at the
  limit tries a channel beyond it, and the limit is forgotten if RabbitMQ allows it.
- The ``channel_max`` RabbitMQ sets at the connect (Connection.Tune) was only learned from
  the 530 that closes the connection, every lane's waves with it. Now it is kept to from
  the start.
- The consumer's ``lag`` opened a second channel at every metrics tick: with
  ``max-channels 1`` RabbitMQ closed the consumer's connection each time (every prefetched
  message back to the queue). Now the channel is opened at the connect, and a refusal
  there is remembered: ``lag`` answers None and the consumer keeps its connection.
"""

from __future__ import annotations

import asyncio
import subprocess
import uuid
from collections.abc import AsyncIterator

import aio_pika
import pytest

from outboxer.brokers.rabbitmq import RabbitMQPublisher
from outboxer.receivers.rabbitmq import RabbitMQReceiver
from outboxer.testing import make_message
from tests.rabbit import AMQP_URL

pytestmark = pytest.mark.timeout(30)


def _ctl(*args: str) -> None:
    subprocess.run(["rabbitmqctl", "-q", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
async def tag() -> AsyncIterator[str]:
    """An exchange and a queue bound to it for ``#``; a user with every permission on them."""
    tag = f"audit21-rev-chan-{uuid.uuid4().hex[:8]}"
    connection = await aio_pika.connect(AMQP_URL)
    channel = await connection.channel()
    exchange = await channel.declare_exchange(tag, "topic", durable=True)
    queue = await channel.declare_queue(tag, durable=True)
    await queue.bind(exchange, "#")
    _ctl("add_user", tag, "pw")
    try:
        _ctl("set_permissions", "-p", "/", tag, f"^{tag}$", f"^{tag}$", f"^{tag}$")
        yield tag
    finally:
        _ctl("delete_user", tag)
        await channel.queue_delete(tag)
        await channel.exchange_delete(tag)
        await connection.close()


async def _round(publisher: RabbitMQPublisher, waves: int = 4) -> int:
    if not publisher.connected:
        await publisher.connect()
    outcomes = await asyncio.gather(
        *(
            publisher.publish_batch([make_message(f"k.{i}", {"n": i}) for i in range(50)])
            for _ in range(waves)
        )
    )
    return sum(o.published for wave in outcomes for o in wave)


async def test_a_raised_channel_limit_is_used_again(tag: str) -> None:
    _ctl("set_user_limits", tag, '{"max-channels": 2}')
    publisher = RabbitMQPublisher(f"amqp://{tag}:pw@127.0.0.1:5672/?exchange={tag}")
    publisher.lane_cap_retry = 0.3
    async with publisher:
        await _round(publisher)  # learns the limit of 2
        assert publisher._lane_cap == 2
        await asyncio.sleep(0.4)
        await _round(publisher)  # the limit is still there: tried, and learned again
        # (RabbitMQ untracks a closed connection's channels a moment later: a 530 on the
        # new connection may lower the cap to 1 for a while; the next retry mends that.)
        assert publisher._lane_cap in (1, 2)
        assert await _round(publisher) == 200
        _ctl("set_user_limits", tag, '{"max-channels": 20}')
        await asyncio.sleep(0.4)
        await _round(publisher)
        assert publisher._lane_cap is None  # before: 2 until a restart
        channels = []

        async def wave() -> int:
            published = await _round(publisher, 1)
            channels.append(len(publisher._connection.transport.connection.channels))  # type: ignore[union-attr]
            return published

        await _round(publisher)
        published = await asyncio.gather(*(wave() for _ in range(6)))
        assert sum(published) == 300 and max(channels) > 2


async def test_the_servers_channel_max_is_kept_to_from_the_connect(tag: str) -> None:
    publisher = RabbitMQPublisher(AMQP_URL, exchange=tag, publish_timeout=5)
    async with publisher:
        await publisher.connect()
        underlay = publisher._connection.transport.connection  # type: ignore[union-attr]
        underlay.connection_tune.channel_max = 2  # as a server with channel_max = 2 says
        peak = 0
        original = publisher._open_channel

        async def counting(connection: aio_pika.abc.AbstractConnection) -> object:
            nonlocal peak
            channel = await original(connection)
            peak = max(peak, len(underlay.channels))
            return channel

        publisher._open_channel = counting  # type: ignore[method-assign,assignment]
        outcomes = await asyncio.gather(
            *(
                publisher.publish_batch([make_message(f"k.{i}", {"n": i}) for i in range(20)])
                for _ in range(6)
            )
        )
        assert all(o.published for wave in outcomes for o in wave)
        assert peak <= 2  # before: 6 channels, over channel_max (RabbitMQ: 530)


async def test_lag_with_one_channel_allowed_keeps_the_consumers_connection(tag: str) -> None:
    _ctl("set_user_limits", tag, '{"max-channels": 1}')
    receiver = RabbitMQReceiver(
        f"amqp://{tag}:pw@127.0.0.1:5672/?exchange={tag}&queue={tag}",
        group="g",
        connect_timeout=5,
    )
    await asyncio.wait_for(receiver.connect(), 10)
    try:
        for _ in range(3):
            assert await receiver.lag(2) is None
            await asyncio.sleep(0.1)
        message = make_message("orders.created", {"n": 1})
        async with RabbitMQPublisher(AMQP_URL, exchange=tag) as publisher:
            assert (await publisher.publish_batch([message]))[0].published
        got = await receiver.receive(10, 3)  # before: the connection was lost at the lag
        assert [incoming.delivery.id for incoming in got] == [message.id]
        await receiver.ack(got)
    finally:
        await receiver.close()
