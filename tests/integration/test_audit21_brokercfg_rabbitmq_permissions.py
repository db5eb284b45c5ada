"""A RabbitMQ user without the ``configure`` permission, as an operations team that
provisions exchanges, queues and bindings itself grants to applications.

The relay declared its exchange at every connect and the consumer its exchange, queue and
bindings: RabbitMQ refused them (403 ACCESS_REFUSED) and the refusal read as an outage,
retried for ever ("broker unreachable", "cannot consume from"), though the relay's user
could publish to the exchange and the consumer's read the queue. Now what exists is used
as it is, with one warning; a refused exchange or queue that does not exist is a clear,
non-retryable configuration error. A user of its own (deleted at the end), on exchange and
queue names of the test's own.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aio_pika
import pytest

from outboxer.brokers.rabbitmq import RabbitMQPublisher
from outboxer.errors import ConfigError, PublishError
from outboxer.receivers.rabbitmq import RabbitMQReceiver
from outboxer.testing import make_message
from tests.rabbit import AMQP_URL

pytestmark = pytest.mark.timeout(30)


def _ctl(*args: str) -> None:
    subprocess.run(["rabbitmqctl", "-q", *args], check=True, capture_output=True, timeout=30)


@dataclass
class Provisioned:
    exchange: str
    queue: str
    user: str

    def url(self, **options: str) -> str:
        query = "&".join(f"{k}={v}" for k, v in {"exchange": self.exchange, **options}.items())
        return f"amqp://{self.user}:pw@127.0.0.1:5672/?{query}"


@pytest.fixture
async def provisioned() -> AsyncIterator[Provisioned]:
    """An exchange, a queue bound to it for ``#``, and a user that may write the exchange
    and read the queue, nothing else (no configure permission at all)."""
    tag = f"audit21-perm-{uuid.uuid4().hex[:8]}"
    setup = Provisioned(tag, f"{tag}-q", tag)
    connection = await aio_pika.connect(AMQP_URL)
    channel = await connection.channel()
    exchange = await channel.declare_exchange(setup.exchange, "topic", durable=True)
    queue = await channel.declare_queue(setup.queue, durable=True)
    await queue.bind(exchange, "#")
    _ctl("add_user", setup.user, "pw")
    try:
        _ctl("set_permissions", "-p", "/", setup.user, "^$", f"^{tag}$", f"^{tag}-q$")
        yield setup
    finally:
        _ctl("delete_user", setup.user)
        await channel.queue_delete(setup.queue)
        await channel.exchange_delete(setup.exchange)
        await connection.close()


async def test_relay_publishes_to_an_exchange_it_may_not_declare(
    provisioned: Provisioned, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "outboxer.publisher.rabbitmq")
    message = make_message("orders.created", {"n": 1})
    async with RabbitMQPublisher(provisioned.url(), publish_timeout=5) as publisher:
        [outcome] = await publisher.publish_batch([message])
    assert outcome.published, outcome.error
    assert "refused to declare exchange" in caplog.text
    connection = await aio_pika.connect(AMQP_URL)
    try:
        channel = await connection.channel()
        queue = await channel.declare_queue(provisioned.queue, passive=True)
        got = await queue.get(timeout=5)
        assert got.message_id == str(message.id)
        await got.ack()
    finally:
        await connection.close()


async def test_relay_stops_on_a_refused_exchange_that_does_not_exist(
    provisioned: Provisioned,
) -> None:
    publisher = RabbitMQPublisher(
        provisioned.url(exchange=f"{provisioned.exchange}-missing"), publish_timeout=5
    )
    with pytest.raises(PublishError) as refused:
        await publisher.connect()
    assert not refused.value.retryable  # the relay stops with a ConfigError naming it
    assert "does not exist" in str(refused.value)


async def test_consumer_reads_a_queue_it_may_neither_declare_nor_bind(
    provisioned: Provisioned, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "outboxer.receiver")
    receiver = RabbitMQReceiver(
        provisioned.url(queue=provisioned.queue), group="g", connect_timeout=5
    )
    await asyncio.wait_for(receiver.connect(), 10)
    try:
        message = make_message("orders.created", {"n": 2})
        async with RabbitMQPublisher(AMQP_URL, exchange=provisioned.exchange) as publisher:
            assert (await publisher.publish_batch([message]))[0].published
        got = await receiver.receive(10, 5)
        assert [incoming.delivery.id for incoming in got] == [message.id]
        await receiver.ack(got)
        assert receiver.stats.acked == 1
    finally:
        await receiver.close()
    assert "consuming queue" in caplog.text and "bind it to" in caplog.text


async def test_consumer_refused_a_queue_that_does_not_exist_is_a_config_error(
    provisioned: Provisioned,
) -> None:
    receiver = RabbitMQReceiver(
        provisioned.url(queue=f"{provisioned.queue}-missing"), group="g", connect_timeout=5
    )
    with pytest.raises(ConfigError, match="does not exist"):
        await asyncio.wait_for(receiver.connect(), 10)
