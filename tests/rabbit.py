"""A RabbitMQ consumer for tests: an exclusive queue bound to a fresh exchange."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"


@dataclass
class Delivered:
    message_id: str
    routing_key: str
    headers: dict[str, Any]
    body: bytes
    content_type: str | None
    persistent: bool


@dataclass
class RabbitConsumer:
    exchange: str = field(default_factory=lambda: f"test-{uuid.uuid4().hex[:10]}")
    binding: str = "#"
    received: list[Delivered] = field(default_factory=list)
    _connection: Any = None

    @property
    def broker_url(self) -> str:
        return f"{AMQP_URL}?exchange={self.exchange}"

    async def start(self) -> RabbitConsumer:
        import aio_pika

        self._connection = await aio_pika.connect(AMQP_URL)
        channel = await self._connection.channel()
        exchange = await channel.declare_exchange(
            self.exchange, aio_pika.ExchangeType.TOPIC, durable=True
        )
        queue = await channel.declare_queue(exclusive=True)
        await queue.bind(exchange, self.binding)

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            self.received.append(
                Delivered(
                    str(message.message_id),
                    message.routing_key or "",
                    dict(message.headers or {}),
                    message.body,
                    message.content_type,
                    message.delivery_mode == aio_pika.DeliveryMode.PERSISTENT,
                )
            )
            await message.ack()

        await queue.consume(on_message)
        return self

    async def wait_for(
        self, count: int, timeout: float = 20.0, *, distinct: bool = False
    ) -> list[Delivered]:
        """Wait until ``count`` deliveries arrived (``distinct``: of that many message ids,
        as redeliveries after a crash would reach a plain count early)."""

        def arrived() -> int:
            return len({d.message_id for d in self.received}) if distinct else len(self.received)

        deadline = time.monotonic() + timeout
        while arrived() < count and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return list(self.received)

    async def stop(self) -> None:
        if self._connection is not None:
            channel = await self._connection.channel()
            await channel.exchange_delete(self.exchange)
            await self._connection.close()
