"""What one wait of a relay cycle costs in CPU on this box, whatever the relay does.

    .venv/bin/python bench/wake_cost.py [DB_URL]      # prints one JSON object

A claim-publish-settle cycle waits at least four times: for the busy poll's timer, the
claim's answer, RabbitMQ's confirm and the settle's answer. Each wait ends in a wake-up of
the asyncio loop, and on a virtual machine a wake-up after an idle spell costs more CPU
than the work around it (caches gone cold, the halt and the interrupt accounted to the
process; the longer the idle, the more). Measured here, in a fresh interpreter as the
relay is, one kind of wait at a time, each CPU figure per wait (user + system, this
process):

- ``loop_turn_us``: ``asyncio.sleep(0)``, an event loop turn that never blocks (the
  interpreter's share of any wait);
- ``timer_wake_us``: ``asyncio.sleep(busy_poll_interval)``, the busy poll's timer;
- ``pg_round_trip_us``: asyncpg ``SELECT 1`` (the claim and the settle each cost one such
  round trip, plus their SQL);
- ``amqp_confirm_us``: outboxer's RabbitMQ publisher publishing one persistent message to
  a durable queue and waiting for its confirm.

``cycle_waits_us`` adds one timer wake-up, two PostgreSQL round trips and one confirm: what
the waits of one cycle cost before it reads a row or writes a frame. ``bench/run.py``
(section ``sweep``) runs this after the floor relay, on an idle box, so the figures are a
lower bound of what the same waits cost under the sweep's load.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from collections.abc import Awaitable, Callable

import asyncpg

from brokers import AMQP_URL, RabbitSink
from outboxer.brokers.rabbitmq import RabbitMQPublisher
from outboxer.config import Settings
from outboxer.message import Message

DEFAULT_DB = "postgresql://postgres@127.0.0.1/postgres"


async def cpu_per_call(call: Callable[[], Awaitable[object]], count: int) -> float:
    """CPU microseconds per awaited ``call``, after a warm-up."""
    for _ in range(max(10, count // 10)):
        await call()
    started = time.process_time()
    for _ in range(count):
        await call()
    return (time.process_time() - started) / count * 1e6


async def measure(db_url: str) -> dict[str, float]:
    figures: dict[str, float] = {}
    poll = Settings().busy_poll_interval
    figures["loop_turn_us"] = await cpu_per_call(lambda: asyncio.sleep(0), 5000)
    figures["timer_wake_us"] = await cpu_per_call(lambda: asyncio.sleep(poll), 300)
    db = await asyncpg.connect(db_url)
    try:
        figures["pg_round_trip_us"] = await cpu_per_call(lambda: db.fetchval("SELECT 1"), 1000)
    finally:
        await db.close()
    sink = await RabbitSink().open()
    publisher = RabbitMQPublisher(AMQP_URL, exchange=sink.tag, declare_exchange=False)
    try:
        await publisher.connect()
        body = b'{"order_id": 1, "note": "' + b"x" * 260 + b'"}'

        def one() -> Awaitable[object]:
            message = Message(id=uuid.uuid4(), topic="order.placed", payload=body, key="k")
            return publisher.publish_batch([message])

        figures["amqp_confirm_us"] = await cpu_per_call(one, 300)
    finally:
        await publisher.close()
        await sink.close()
    figures["cycle_waits_us"] = (
        figures["timer_wake_us"] + 2 * figures["pg_round_trip_us"] + figures["amqp_confirm_us"]
    )
    return figures


if __name__ == "__main__":
    print(json.dumps(asyncio.run(measure(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_DB))))
