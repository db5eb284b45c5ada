"""A message whose statement makes the database drop the connection (a value over MySQL's
max_allowed_packet, a proxy's query rule, a server crash it triggers) on every attempt:
the consumer reconnects and applies it again. Before, at once and for ever, with the whole
batch: a hot loop that also held back every other message of its batch (and their keys)."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from outboxer.brokers.memory import memory_broker
from outboxer.consumer import Consumer, Delivery
from outboxer.testing import make_message
from tests.conftest import mysql_connect


def test_mysql_a_message_that_drops_the_connection_neither_hot_loops_nor_holds_its_batch(
    mysql_url: str,
) -> None:
    conn = mysql_connect(mysql_url, autocommit=True)
    with conn.cursor() as cursor:
        cursor.execute("CREATE TABLE applied (message_id CHAR(36) PRIMARY KEY, n INT NOT NULL)")
    conn.close()
    calls = {"poison": 0}

    def handler(message: Delivery, conn: Any) -> None:
        with conn.cursor() as cursor:
            if message.key == "poison":
                calls["poison"] += 1
                cursor.execute("KILL CONNECTION_ID()")  # the server drops this connection
            cursor.execute(
                "INSERT INTO applied (message_id, n) VALUES (%s, %s)",
                (str(message.id), message.payload["n"]),
            )

    broker = f"audit5-{uuid.uuid4().hex[:8]}"
    messages = [make_message("t", {"n": n}, key=f"k{n}") for n in range(20)]
    messages.insert(5, make_message("t", {"n": -1}, key="poison"))
    memory_broker(broker).messages.extend(messages)
    consumer = Consumer(
        db=mysql_url, broker=f"memory://{broker}", group="g", handler=handler, concurrency=1
    )

    async def run() -> None:
        asyncio.get_running_loop().call_later(1.0, consumer.stop)
        await consumer.run_async()

    asyncio.run(run())
    conn = mysql_connect(mysql_url)
    with conn.cursor() as cursor:
        cursor.execute("SELECT n FROM applied ORDER BY n")
        applied = [row[0] for row in cursor.fetchall()]
    conn.close()
    # The other messages of its batch were applied: their keys go on.
    assert applied == list(range(20))
    # Reconnected with the outage backoff (0.2 s, 0.4 s, ...), not in a hot loop (old: ~100).
    assert calls["poison"] <= 7, calls
    assert consumer.stats.database_errors <= 7, consumer.stats
