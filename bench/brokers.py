"""Fresh destinations on the local brokers, and the broker-only ceilings.

A ``Sink`` is one run's destination: a new RabbitMQ exchange with a bound durable
queue (so every message is routable), a new Redis stream prefix, or a new
``memory://`` name. ``count()`` says how many messages arrived; ``close()``
deletes what the run created.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from harness import AMQP_URL, REDIS_URL, BoxMeter, backlog_items, log
from outboxer.brokers import create_publisher
from outboxer.message import Message

BROKERS = ("rabbitmq", "redis", "memory")
#: Sinks that may hold something on a broker until their close() succeeded.
_OPEN: dict[str, Sink] = {}


class Sink:
    name = "?"

    def __init__(self) -> None:
        self.tag = f"outboxer-bench-{uuid.uuid4().hex[:10]}"
        self.url = ""

    async def open(self) -> Sink:
        return self

    async def count(self) -> int | None:
        return None

    async def close(self) -> None:
        return None


class RabbitSink(Sink):
    name = "rabbitmq"

    def __init__(self) -> None:
        super().__init__()
        self.url = f"{AMQP_URL}?exchange={self.tag}"
        self._connection: Any = None
        self._queue: Any = None
        self._consuming: Any = None

    async def open(self) -> RabbitSink:
        import aio_pika

        _OPEN[self.tag] = self
        self._connection = await aio_pika.connect(AMQP_URL)
        channel = await self._connection.channel()
        exchange = await channel.declare_exchange(
            self.tag, aio_pika.ExchangeType.TOPIC, durable=True
        )
        self._queue = await channel.declare_queue(self.tag, durable=True)
        await self._queue.bind(exchange, "#")
        return self

    async def consume(self, on_message: Any) -> None:
        """Deliver every message of the queue to ``on_message`` (no acks: nothing is redelivered)."""
        self._consuming = channel = await self._connection.channel()
        await channel.set_qos(prefetch_count=2000)
        queue = await channel.get_queue(self.tag)
        await queue.consume(on_message, no_ack=True)

    async def count(self) -> int | None:
        channel = await self._connection.channel()
        queue = await channel.declare_queue(self.tag, passive=True)
        count = int(queue.declaration_result.message_count)
        await channel.close()
        return count

    async def close(self) -> None:
        """Delete the queue and exchange, on a connection of its own: the sink's own one may
        have died with a broker restart (they are durable: they would outlive it)."""
        import aio_pika

        connection, self._connection = self._connection, None
        if connection is not None:
            with contextlib.suppress(Exception):
                if self._consuming is not None:
                    await self._consuming.close()
                await connection.close()
        cleaner = await aio_pika.connect(AMQP_URL)
        try:
            channel = await cleaner.channel()
            await channel.queue_delete(self.tag)
            await channel.exchange_delete(self.tag)
        finally:
            await cleaner.close()
        _OPEN.pop(self.tag, None)


class RedisSink(Sink):
    name = "redis"

    def __init__(self) -> None:
        super().__init__()
        self.prefix = f"{self.tag}:"
        self.url = f"{REDIS_URL}?stream_prefix={self.prefix}"
        _OPEN[self.tag] = self  # streams appear as soon as anything publishes

    async def _keys(self, client: Any) -> list[bytes]:
        return [key async for key in client.scan_iter(match=f"{self.prefix}*", count=1000)]

    async def count(self) -> int | None:
        import redis.asyncio as aioredis

        client = aioredis.Redis.from_url(REDIS_URL)
        try:
            return sum([int(await client.xlen(key)) for key in await self._keys(client)])
        finally:
            await client.aclose()

    async def close(self) -> None:
        import redis.asyncio as aioredis

        client = aioredis.Redis.from_url(REDIS_URL)
        try:
            keys = await self._keys(client)
            if keys:
                await client.delete(*keys)
        finally:
            await client.aclose()
        _OPEN.pop(self.tag, None)


class MemorySink(Sink):
    name = "memory"

    def __init__(self) -> None:
        super().__init__()
        self.url = f"memory://{self.tag}"

    async def count(self) -> int | None:
        from outboxer.brokers.memory import memory_broker

        broker = memory_broker(self.tag)
        return len(broker.messages) or None  # a relay in another process keeps its own list

    async def close(self) -> None:
        from outboxer.brokers.memory import _brokers

        _brokers.pop(self.tag, None)


def sink(name: str) -> Sink:
    return {"rabbitmq": RabbitSink, "redis": RedisSink, "memory": MemorySink}[name]()


async def close_leftovers() -> list[str]:
    """Delete what sinks whose close failed (or never ran) left on the brokers; what remains."""
    for leftover in list(_OPEN.values()):
        try:
            await leftover.close()
        except Exception as exc:
            log(f"could not delete {leftover.name} {leftover.tag}: {exc}")
    return sorted(_OPEN)


# ----- ceilings -----------------------------------------------------------------------------


def _batches(messages: Sequence[Message], size: int) -> list[Sequence[Message]]:
    return [messages[i : i + size] for i in range(0, len(messages), size)]


@dataclass
class Ceiling:
    rate: float  # messages/s
    box: dict[str, float]  # cores busy meanwhile, by service (harness.BoxMeter)


async def _timed(
    label: str,
    target: Sink,
    publish: Any,
    messages: Sequence[Message],
    batch_size: int,
    concurrency: int,
) -> Ceiling:
    """Publish one message (warm-up), then the rest in batches from ``concurrency`` loops taking
    the next batch in turn, as the relay's loops do; check they all arrived; messages/s."""
    await publish(messages[:1])
    queue = iter(_batches(messages[1:], batch_size))

    async def loop() -> None:
        for batch in queue:
            await publish(batch)

    meter = BoxMeter().start()
    started = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    seconds = time.perf_counter() - started
    box = meter.stop()
    arrived = await target.count()
    if arrived is not None and arrived != len(messages):
        raise RuntimeError(f"{label}: {arrived} of {len(messages)} messages arrived")
    return Ceiling((len(messages) - 1) / seconds, box)


async def adapter_ceiling(
    name: str, messages: Sequence[Message], batch_size: int, concurrency: int
) -> Ceiling:
    """Messages/s through the outboxer adapter's ``publish_batch``, no database involved."""
    target = await sink(name).open()
    try:
        publisher = create_publisher(target.url)
        failed = 0

        async def publish(batch: Sequence[Message]) -> None:
            nonlocal failed
            outcomes = await publisher.publish_batch(batch)
            failed += sum(not outcome.published for outcome in outcomes)

        async with publisher:
            ceiling = await _timed(
                f"{name} adapter ceiling", target, publish, messages, batch_size, concurrency
            )
        if failed:
            raise RuntimeError(f"{name} adapter ceiling: {failed} messages failed")
    finally:
        await target.close()
    return ceiling


#: Publishing shapes tried for the RabbitMQ broker maximum: label -> (connections, channels per
#: connection, batch size). Each channel has one batch in flight at a time.
RABBITMQ_SHAPES: dict[str, tuple[int, int, int]] = {
    "1 channel, batch 500": (1, 1, 500),
    "2 connections, batch 200 each": (2, 1, 200),
    "4 channels, batch 200 each": (1, 4, 200),
}


async def raw_rabbitmq_ceiling(
    messages: Sequence[Message],
    batch_size: int,
    concurrency: int,
    *,
    connections: int = 1,
    channels: int = 1,
) -> Ceiling:
    """Messages/s of a plain aio-pika loop: same properties, mandatory, confirms, batch in flight.

    ``concurrency`` loops take the next batch in turn; each publishes it on a channel of its
    own if there are as many channels (``connections`` x ``channels``), else they share them.
    """
    import aio_pika

    target = await RabbitSink().open()
    opened: list[Any] = []
    try:
        exchanges = []  # one per channel
        for _ in range(connections):
            opened.append(await aio_pika.connect(AMQP_URL))
            for _ in range(channels):
                channel = await opened[-1].channel(publisher_confirms=True, on_return_raises=True)
                exchanges.append(await channel.get_exchange(target.tag))
        lanes: asyncio.Queue[Any] = asyncio.Queue()  # a loop takes one to publish a batch on
        for n in range(max(concurrency, len(exchanges))):
            lanes.put_nowait(exchanges[n % len(exchanges)])

        def amqp(m: Message) -> aio_pika.Message:
            return aio_pika.Message(
                m.payload,
                content_type=m.content_type,
                message_id=str(m.id),
                timestamp=m.created_at,
                headers=dict(m.envelope_headers()),
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            )

        async def publish(batch: Sequence[Message]) -> None:
            exchange = lanes.get_nowait()
            try:
                await asyncio.gather(
                    *(exchange.publish(amqp(m), m.topic, mandatory=True) for m in batch)
                )
            finally:
                lanes.put_nowait(exchange)

        return await _timed("raw aio-pika", target, publish, messages, batch_size, concurrency)
    finally:
        for connection in opened:
            with contextlib.suppress(Exception):
                await connection.close()
        await target.close()


async def rabbitmq_shape(shape: str, messages: Sequence[Message]) -> Ceiling:
    """``raw_rabbitmq_ceiling`` in one of RABBITMQ_SHAPES: one loop per channel."""
    connections, channels, batch_size = RABBITMQ_SHAPES[shape]
    return await raw_rabbitmq_ceiling(
        messages, batch_size, connections * channels, connections=connections, channels=channels
    )


async def raw_redis_ceiling(
    messages: Sequence[Message], batch_size: int, concurrency: int
) -> Ceiling:
    """Messages/s of a plain redis-py loop: one non-transactional XADD pipeline per batch."""
    import redis.asyncio as aioredis

    from outboxer.brokers.redis import entry_fields

    target = RedisSink()
    client = aioredis.Redis.from_url(REDIS_URL)
    try:

        async def publish(batch: Sequence[Message]) -> None:
            async with client.pipeline(transaction=False) as pipe:
                for m in batch:
                    pipe.xadd(target.prefix + m.topic, entry_fields(m))
                await pipe.execute()

        return await _timed("raw redis-py", target, publish, messages, batch_size, concurrency)
    finally:
        await client.aclose()
        await target.close()


async def raw_ceiling(
    name: str, messages: Sequence[Message], batch_size: int, concurrency: int
) -> Ceiling | None:
    if name == "rabbitmq":
        return await raw_rabbitmq_ceiling(messages, batch_size, concurrency)
    if name == "redis":
        return await raw_redis_ceiling(messages, batch_size, concurrency)
    return None


# ----- the latency section's broker control ---------------------------------------------------


def publish_paced(
    url: str, rate: float, messages: int, start_at: float, end_at: float, keys: int, seed: int
) -> dict[str, Any]:
    """The relay's latency without a database: a wave of ``messages`` straight to ``url``
    through outboxer's publisher every 1/``rate`` s (one wave per writer transaction), in a
    process of its own as the relay is. Returns each message's wave-start-to-confirm ms."""
    return asyncio.run(_publish_paced(url, rate, messages, start_at, end_at, keys, seed))


async def _publish_paced(
    url: str, rate: float, messages: int, start_at: float, end_at: float, keys: int, seed: int
) -> dict[str, Any]:
    waves = max(1, math.ceil((end_at - start_at) * rate))
    items = backlog_items(waves * messages, keys, seed=seed)
    sent = [
        Message(
            id=uuid.uuid4(),
            topic=item["topic"],
            key=item["key"],
            headers=item["headers"],
            payload=json.dumps(item["payload"], separators=(",", ":")).encode(),
        )
        for item in items
    ]
    latencies: list[float] = []
    failed = 0

    async def wave(batch: Sequence[Message]) -> None:
        nonlocal failed
        started = time.time()
        outcomes = await publisher.publish_batch(batch)
        confirmed = time.time()
        failed += sum(not outcome.published for outcome in outcomes)
        latencies.extend([(confirmed - started) * 1000.0] * len(batch))

    publisher = create_publisher(url)
    async with publisher:
        await wave(sent[:1])  # warm up: connection and channels open
        latencies.clear()
        pending = []
        for n in range(waves):
            await asyncio.sleep(max(0.0, start_at + n / rate - time.time()))
            pending.append(asyncio.ensure_future(wave(sent[n * messages : (n + 1) * messages])))
        await asyncio.gather(*pending)
    if failed:
        raise RuntimeError(f"broker latency control: {failed} messages failed")
    return {"latencies": latencies, "rate": len(latencies) / (end_at - start_at)}
