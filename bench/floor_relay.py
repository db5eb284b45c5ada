"""The floor of a batched relay on the same drivers: the control for relay CPU per message.

    python bench/floor_relay.py DB_URL AMQP_URL EXCHANGE   # runs until SIGTERM or SIGINT

What any batched outbox relay on asyncpg and aiormq must do, and nothing more: one loop
claims up to 200 PENDING rows with one UPDATE (PROCESSING, a lock owner and deadline),
writes them to RabbitMQ on one channel with publisher confirms and waits for the
confirms, marks them PUBLISHED with one UPDATE, and when the claim was not full sleeps
5 ms (outboxer's poll interval under load) before the next. No per-key order, no lease
renewal, no retry or backoff, no metrics, no tracing, no NOTIFY, no handling of a
refused message: a relay that lacks them is not fit for use, which is why this is a
floor. ``bench/paced_relay.py --floor`` runs it under the same paced writers as the
real relay and prints its CPU per message beside it: what outboxer adds, and what the
drivers and the interpreter cost whatever the relay does.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys

import aiormq
import asyncpg
from pamqp import commands as spec

BATCH = 200
POLL_SECONDS = 0.005
CLAIM = f"""
UPDATE outboxer.outbox SET status = 'PROCESSING', attempts = attempts + 1,
       locked_by = 'floor', locked_until = now() + interval '30 seconds'
WHERE seq IN (
    SELECT seq FROM outboxer.outbox
    WHERE destination = 'default' AND status = 'PENDING'
    ORDER BY seq LIMIT {BATCH}
    FOR UPDATE SKIP LOCKED)
RETURNING seq, id, topic, key, payload, content_type, headers::text AS headers
"""
SETTLE = """
UPDATE outboxer.outbox SET status = 'PUBLISHED', published_at = now(),
       locked_by = NULL, locked_until = NULL
WHERE seq = ANY($1::bigint[])
"""


async def relay(db_url: str, amqp_url: str, exchange: str, stop: asyncio.Event) -> None:
    db = await asyncpg.connect(db_url)
    broker = await aiormq.connect(amqp_url)
    try:
        channel = await broker.channel(publisher_confirms=True)
        while not stop.is_set():
            rows = await db.fetch(CLAIM)
            if rows:
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
                await asyncio.gather(*confirms)
                await db.execute(SETTLE, [row["seq"] for row in rows])
            if len(rows) < BATCH:
                await asyncio.sleep(POLL_SECONDS)
    finally:
        await broker.close()
        await db.close()


async def main(db_url: str, amqp_url: str, exchange: str) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await relay(db_url, amqp_url, exchange, stop)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
