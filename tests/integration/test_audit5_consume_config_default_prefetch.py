"""The consumer's default prefetch (2 x concurrency x batch) within what the broker takes,
on the real RabbitMQ.

Before, a large batch (``--batch 10000``, allowed up to 10000) made the default 80000 and
the consumer refused to start: "prefetch must be at most 65535 for RabbitMQ", about a
value the user never set; concurrency 256 x batch 10000 went past any receiver's limit.
"""

from __future__ import annotations

import uuid

from outboxer.consumer import Consumer
from tests.services import require

AMQP = "amqp://guest:guest@127.0.0.1:5672/"


def _ignore(message: object, connection: object) -> None:
    return None


async def test_a_large_batch_gives_a_default_prefetch_rabbitmq_takes() -> None:
    require("rabbitmq")
    import aio_pika

    tag = uuid.uuid4().hex[:8]
    consumer = Consumer(
        db="sqlite:////nonexistent/never-opened.db",
        broker=f"{AMQP}?exchange=x-{tag}",
        group=f"g-{tag}",
        handler=_ignore,
        concurrency=4,
        batch=10_000,
    )
    assert consumer.prefetch == consumer.receiver.prefetch == 65_535
    try:
        await consumer.receiver.connect()  # basic.qos takes it
    finally:
        await consumer.receiver.close()
        connection = await aio_pika.connect(AMQP)
        channel = await connection.channel()
        await channel.queue_delete(f"g-{tag}")
        await channel.exchange_delete(f"x-{tag}")
        await connection.close()


def test_the_largest_concurrency_and_batch_give_a_default_prefetch_within_limits() -> None:
    consumer = Consumer(
        db="sqlite:////nonexistent/never-opened.db",
        broker="memory://audit5-prefetch",
        group="g",
        handler=_ignore,
        concurrency=256,
        batch=10_000,
    )
    assert consumer.prefetch == 1_000_000
    given = Consumer(
        db="sqlite:////nonexistent/never-opened.db",
        broker="memory://audit5-prefetch",
        group="g",
        handler=_ignore,
        prefetch=7,
    )
    assert given.prefetch == 7  # a prefetch given stays as given
