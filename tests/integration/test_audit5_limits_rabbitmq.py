"""Broker-side limits of RabbitMQ queues (``x-max-length`` / ``x-max-length-bytes`` and
their ``x-overflow``) and what the publisher makes of them: ``drop-head`` (the default)
confirms the publish and drops the queue's oldest messages, read or not; ``reject-publish``
nacks it, a failed attempt that is retried, while the other queues it was routed to keep
their copy (so the retry duplicates it there). The docs must say both."""

from __future__ import annotations

import uuid
from pathlib import Path

import aio_pika

from outboxer.brokers.base import OutcomeKind
from outboxer.brokers.rabbitmq import RabbitMQPublisher
from outboxer.testing import make_message
from tests.services import require

URL = "amqp://guest:guest@127.0.0.1:5672/"
DOCS = Path(__file__).resolve().parents[2] / "docs" / "brokers" / "rabbitmq.md"


async def message_ids(queue: aio_pika.abc.AbstractQueue) -> list[str]:
    ids: list[str] = []
    while (message := await queue.get(fail=False, no_ack=True)) is not None:
        ids.append(str(message.message_id))
    return ids


async def test_queue_length_limits_drop_or_refuse_and_are_documented() -> None:
    require("rabbitmq")
    exchange = f"audit5-limits-{uuid.uuid4().hex[:10]}"
    connection = await aio_pika.connect(URL)
    publisher = RabbitMQPublisher(f"{URL}?exchange={exchange}", publish_timeout=10.0)
    try:
        await publisher.connect()
        channel = await connection.channel()
        drop_head = await channel.declare_queue(exclusive=True, arguments={"x-max-length": 2})
        await drop_head.bind(exchange, "drop.#")
        refuse = await channel.declare_queue(
            exclusive=True, arguments={"x-max-length": 1, "x-overflow": "reject-publish"}
        )
        await refuse.bind(exchange, "both.#")
        other = await channel.declare_queue(exclusive=True)
        await other.bind(exchange, "both.#")

        dropped = [make_message("drop.a", {"n": n}) for n in range(4)]
        outcomes = await publisher.publish_batch(dropped)
        assert all(o.published for o in outcomes), outcomes
        # Confirmed, all four; the queue kept the newest two.
        assert await message_ids(drop_head) == [str(m.id) for m in dropped[2:]]

        both = [make_message("both.a", {"n": n}, key="k") for n in range(2)]
        first, second = await publisher.publish_batch(both)
        assert first.published
        assert second.kind is OutcomeKind.FAILED and second.retryable, second
        assert "did not take" in (second.error or "")
        # Refused (nacked) by the full queue, yet the other queue has it: a retry is a duplicate there.
        assert await message_ids(other) == [str(m.id) for m in both]
    finally:
        await publisher.close()
        cleanup = await connection.channel()
        await cleanup.exchange_delete(exchange)
        await connection.close()
    docs = " ".join(DOCS.read_text("utf-8").split())
    for said in ("`x-max-length`", "`drop-head`", "`reject-publish`", "silently"):
        assert said in docs, said
