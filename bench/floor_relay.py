"""The floor of a batched relay on the same drivers: the control for relay CPU per message.

    python bench/floor_relay.py DB_URL AMQP_URL EXCHANGE [waves|aiormq [POLL_SECONDS]]

What any batched outbox relay on asyncpg and aiormq must do, and nothing more: one loop
claims up to 200 PENDING rows with one UPDATE (PROCESSING, a lock owner and deadline),
writes them to RabbitMQ on one channel with publisher confirms and waits for the
confirms, marks them PUBLISHED with one UPDATE, and when the claim was not full sleeps
POLL_SECONDS (by default outboxer's poll under load, ``busy_poll_interval``) before the
next; it runs until SIGTERM or SIGINT. ``waves`` (the default)
publishes through outboxer's own RabbitMQ publisher, the cheapest way to these drivers
this project knows (a batch's frames written in one go, confirms read by aiormq), so
the floor is as low as the drivers allow; ``aiormq`` calls ``basic_publish`` once per
message, as a relay written straight on aiormq would. No per-key order, no lease
renewal, no retry or backoff, no metrics, no tracing, no NOTIFY, no handling of a
refused message: a relay that lacks them is not fit for use, which is why this is a
floor. ``bench/paced_relay.py --floor`` runs it under the same paced writers as the
real relay and prints its CPU per message beside it: what outboxer adds, and what the
drivers and the interpreter cost whatever the relay does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence

import aiormq
import asyncpg
from pamqp import commands as spec

from outboxer.config import Settings

BATCH = 200
POLL_SECONDS = Settings().busy_poll_interval
#: The rows are found through the partial ready index and updated by ctid (a TID scan): seq
#: has no index of its own, so ``WHERE seq IN (…)`` would scan the published history.
CLAIM = f"""
UPDATE outboxer.outbox AS o SET status = 'PROCESSING', attempts = o.attempts + 1,
       locked_by = 'floor', locked_until = now() + interval '30 seconds'
FROM (
    SELECT ctid AS row_id FROM outboxer.outbox
    WHERE destination = 'default' AND status = 'PENDING'
    ORDER BY seq LIMIT {BATCH}
    FOR UPDATE SKIP LOCKED) AS due
WHERE o.ctid = due.row_id
RETURNING o.seq, o.id, o.topic, o.key, o.payload, o.content_type, o.headers::text AS headers
"""
SETTLE = """
UPDATE outboxer.outbox SET status = 'PUBLISHED', published_at = now(),
       locked_by = NULL, locked_until = NULL
WHERE destination = 'default' AND status = 'PROCESSING' AND seq = ANY($1::bigint[])
"""


Publish = Callable[[Sequence[asyncpg.Record]], Awaitable[object]]


async def waves_publisher(
    amqp_url: str, exchange: str, stack: contextlib.AsyncExitStack
) -> Publish:
    """A batch as one wave of outboxer's RabbitMQ publisher."""
    from outboxer.brokers.rabbitmq import RabbitMQPublisher
    from outboxer.message import Message

    publisher = RabbitMQPublisher(amqp_url, exchange=exchange, declare_exchange=False)
    await publisher.connect()
    stack.push_async_callback(publisher.close)

    async def publish(rows: Sequence[asyncpg.Record]) -> object:
        return await publisher.publish_batch(
            [
                Message(
                    id=row["id"],
                    topic=row["topic"],
                    payload=bytes(row["payload"]),
                    key=row["key"],
                    headers=json.loads(row["headers"]),
                    content_type=row["content_type"],
                    seq=row["seq"],
                )
                for row in rows
            ]
        )

    return publish


async def aiormq_publisher(
    amqp_url: str, exchange: str, stack: contextlib.AsyncExitStack
) -> Publish:
    """A batch as one aiormq ``basic_publish`` per message, the confirms gathered."""
    broker = await aiormq.connect(amqp_url)
    stack.push_async_callback(broker.close)
    channel = await broker.channel(publisher_confirms=True)

    async def publish(rows: Sequence[asyncpg.Record]) -> object:
        confirms = []
        for row in rows:
            headers = json.loads(row["headers"])
            headers["outboxer-key"] = row["key"] or ""
            properties = spec.Basic.Properties(
                content_type=row["content_type"],
                delivery_mode=2,
                message_id=str(row["id"]),
                headers=headers,
            )
            confirms.append(
                channel.basic_publish(
                    bytes(row["payload"]),
                    exchange=exchange,
                    routing_key=row["topic"],
                    properties=properties,
                )
            )
        return await asyncio.gather(*confirms)

    return publish


async def relay(
    db_url: str, amqp_url: str, exchange: str, mode: str, stop: asyncio.Event, poll: float
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        # As the relay: its claims and settles do not wait for the WAL flush (a crash
        # repeats a batch, never loses one).
        db = await asyncpg.connect(db_url, server_settings={"synchronous_commit": "off"})
        stack.push_async_callback(db.close)
        make = waves_publisher if mode == "waves" else aiormq_publisher
        publish = await make(amqp_url, exchange, stack)
        while not stop.is_set():
            rows = await db.fetch(CLAIM)
            if rows:
                await publish(rows)
                await db.execute(SETTLE, [row["seq"] for row in rows])
            if len(rows) < BATCH:
                await asyncio.sleep(poll)


async def main(
    db_url: str, amqp_url: str, exchange: str, mode: str = "waves", poll: str = ""
) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    seconds = float(poll) if poll else POLL_SECONDS
    await relay(db_url, amqp_url, exchange, mode, stop, seconds)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:6]))
