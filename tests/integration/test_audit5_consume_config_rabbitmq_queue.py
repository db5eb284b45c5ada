"""A RabbitMQ consumer's queue name (the group's, or option ``queue``), checked when the
consumer is built, on the real RabbitMQ.

RabbitMQ refuses a queue named ``amq.…`` (ACCESS_REFUSED) and aiormq one of more than 255
bytes: before, the consumer took either refusal for a broker outage and retried for ever.
"""

from __future__ import annotations

import uuid

import pytest

from outboxer.errors import ConfigError
from outboxer.receivers import create_receiver
from tests.services import require

AMQP = "amqp://guest:guest@127.0.0.1:5672/"


@pytest.mark.parametrize(
    ("group", "options"),
    [("amq.orders", {}), ("é" * 200, {}), ("orders", {"queue": "amq.orders"})],
)
def test_a_queue_name_rabbitmq_refuses_is_a_configuration_error(
    group: str, options: dict[str, str]
) -> None:
    with pytest.raises(ConfigError, match="RabbitMQ queue"):
        create_receiver(AMQP, group=group, topics=["t"], **options)


async def test_a_long_ascii_group_still_connects() -> None:
    require("rabbitmq")
    import aio_pika

    tag = uuid.uuid4().hex[:8]
    group = f"g-{tag}-" + "x" * 180  # 200 characters, 200 bytes
    receiver = create_receiver(f"{AMQP}?exchange=x-{tag}", group=group, topics=["t"])
    try:
        await receiver.connect()
    finally:
        await receiver.close()
        connection = await aio_pika.connect(AMQP)
        channel = await connection.channel()
        await channel.queue_delete(group)
        await channel.exchange_delete(f"x-{tag}")
        await connection.close()
