"""``amqp://`` and ``amqps://``: a consumer group is a durable queue bound to the outbox exchange.

The queue (``queue``, default the group's name) is declared durable and bound to the
exchange the relay publishes to (the URL's ``exchange``, default ``outboxer``, declared as
the relay declares it) once per topic pattern (``orders.*``, ``#``); every consumer process
of the group consumes from it, with manual acks and a prefetch of the runner's ``prefetch``.
A message is acked once the transaction that applied it committed; unacknowledged messages
go back to the queue when the channel closes (a crash, a shutdown) and RabbitMQ delivers
them again.

The URL is the relay's: its exchange options and everything it hands to aio-pika (TLS
files, heartbeat, connection name) are read by :class:`RabbitMQPublisher`. The receiver's
own options: ``queue``, ``queue_type`` (``classic`` or ``quorum``), and
``single_active_consumer`` (true: one consumer of the group at a time gets the queue's
messages, so a key's messages are applied in order across several processes too; the
others stand by).

Decoding: ``message_id`` is the id, ``content_type`` the content type, the headers carry the
rest of the envelope (``outboxer-topic``, ``outboxer-key``, ``outboxer-created-at``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import aiormq
from aio_pika.abc import AbstractConnection, AbstractIncomingMessage

from outboxer.brokers.base import option_bool
from outboxer.brokers.rabbitmq import RabbitMQPublisher, connect_amqp
from outboxer.errors import ConfigError
from outboxer.receivers.base import Incoming, Receiver, decode, take

_QUEUE_TYPES = ("classic", "quorum")


def _text(value: Any) -> str:
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode("utf-8", "replace")
    return str(value)


class RabbitMQReceiver(Receiver):
    """Consumes the group's durable queue, bound to the outbox exchange by topic pattern."""

    schemes = ("amqp", "amqps")
    options = ("queue", "queue_type", "single_active_consumer")
    all_topics = "#"

    def __init__(self, url: str, **options: Any) -> None:
        super().__init__(url, **options)
        self.queue: str = str(self.settings.get("queue") or self.group)
        self.queue_type = str(self.settings.get("queue_type") or "classic").lower()
        if self.queue_type not in _QUEUE_TYPES:
            raise ConfigError(f"queue_type must be classic or quorum, not {self.queue_type!r}")
        self.single_active_consumer = option_bool(
            {k: str(v) for k, v in self.settings.items()},
            "single_active_consumer",
            None,
            False,
        )
        self._connection: AbstractConnection | None = None
        self._arrived: asyncio.Queue[AbstractIncomingMessage] = asyncio.Queue()
        self._lost = asyncio.Event()

    @property
    def _rabbit(self) -> RabbitMQPublisher:
        assert isinstance(self.publisher, RabbitMQPublisher)
        return self.publisher

    def parse(self, url: str) -> RabbitMQPublisher:
        return RabbitMQPublisher(url)

    async def _connect(self) -> None:
        await self._close()
        self._lost = asyncio.Event()
        self._arrived = asyncio.Queue()
        publisher = self._rabbit
        connection = await connect_amqp(publisher._driver_url, publisher.connect_timeout)
        self._connection = connection
        connection.close_callbacks.add(self._on_close)
        channel = await connection.channel()
        channel.close_callbacks.add(self._on_close)
        await channel.set_qos(prefetch_count=self.prefetch)
        exchange: Any = publisher.exchange
        if publisher.declare_exchange and exchange and not exchange.startswith("amq."):
            exchange = await channel.declare_exchange(
                exchange, publisher.exchange_type, durable=True
            )
        arguments: dict[str, Any] = {}
        if self.queue_type == "quorum":
            arguments["x-queue-type"] = "quorum"
        if self.single_active_consumer:
            arguments["x-single-active-consumer"] = True
        try:
            queue = await channel.declare_queue(self.queue, durable=True, arguments=arguments)
        except aiormq.exceptions.ChannelPreconditionFailed as exc:
            raise ConfigError(
                f"queue {self.queue!r} exists with other settings ({exc.args[0] if exc.args else exc}); "
                "set queue_type and single_active_consumer to match it, or name another queue"
            ) from exc
        if exchange:  # the default exchange routes by queue name: nothing to bind
            for pattern in self.topics:
                await queue.bind(exchange, routing_key=pattern)
        await queue.consume(self._arrived.put, no_ack=False)

    def _on_close(self, *_: object) -> None:
        self._lost.set()

    async def _close(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            # Closing hands every unacknowledged message back to the queue.
            await RabbitMQPublisher._quietly(connection.close())

    async def _receive(self, limit: int, timeout: float) -> list[Incoming]:
        messages = await take(self._arrived, self._lost, limit, timeout, "RabbitMQ")
        return [self._incoming(message) for message in messages]

    @staticmethod
    def _incoming(message: AbstractIncomingMessage) -> Incoming:
        headers = {name: _text(value) for name, value in (message.headers or {}).items()}
        incoming = decode(
            headers,
            message.body,
            message_id=message.message_id,
            content_type=message.content_type,
            fallback_topic=message.routing_key or "",
        )
        incoming.token = message
        return incoming

    async def _ack(self, incomings: Sequence[Incoming]) -> None:
        for incoming in incomings:
            await incoming.token.ack()


__all__ = ["RabbitMQReceiver"]
