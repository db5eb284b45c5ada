"""The straightforward relay of typical blog samples, to compare outboxer's relay with.

One row at a time: BEGIN; SELECT the oldest pending row FOR UPDATE SKIP LOCKED;
publish it and wait for its publisher confirm; UPDATE that row; COMMIT; loop.
Same table, same messages, same RabbitMQ settings (persistent, confirms).
"""

from __future__ import annotations

import json
import time

import aio_pika
import asyncpg

POLL = """
SELECT id, destination, topic, key, payload, content_type, CAST(headers AS text) AS headers
FROM outboxer.outbox
WHERE destination = 'default' AND status = 'PENDING'
ORDER BY seq
LIMIT 1
FOR UPDATE SKIP LOCKED
"""
#: By the table's key (id, destination): unique, and indexed whatever else the schema indexes.
MARK = (
    "UPDATE outboxer.outbox SET status = 'PUBLISHED', published_at = now() "
    "WHERE id = $1 AND destination = $2"
)


async def simple_relay(
    db_url: str, amqp_url: str, exchange_name: str, seconds: float
) -> tuple[int, float]:
    """Relay for ``seconds`` (or until nothing is pending); (messages published, elapsed s)."""
    db = await asyncpg.connect(db_url)
    broker = await aio_pika.connect(amqp_url)
    try:
        channel = await broker.channel(publisher_confirms=True)
        exchange = await channel.get_exchange(exchange_name)
        published = 0
        started = time.perf_counter()
        while time.perf_counter() - started < seconds:
            async with db.transaction():
                row = await db.fetchrow(POLL)
                if row is None:
                    break
                headers = json.loads(row["headers"])
                headers["outboxer-key"] = row["key"] or ""
                await exchange.publish(  # returns once RabbitMQ confirmed it
                    aio_pika.Message(
                        bytes(row["payload"]),
                        content_type=row["content_type"],
                        message_id=str(row["id"]),
                        headers=headers,
                        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                    ),
                    routing_key=row["topic"],
                )
                await db.execute(MARK, row["id"], row["destination"])
            published += 1
        elapsed = time.perf_counter() - started
    finally:
        await broker.close()
        await db.close()
    return published, elapsed
