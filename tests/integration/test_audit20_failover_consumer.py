"""The consumer after a failover whose old primary stays up, read-only (see
test_audit20_failover_relay.py): its URL names both hosts with
``target_session_attrs=read-write``, the primary is fenced (``default_transaction_read_only``)
and the standby promoted.

Before, each worker kept its connection to the old primary: the batch's inbox claim failed
there with "cannot execute INSERT in a read-only transaction" (SQLSTATE 25006), which the
runner took for the messages' own failure: each charged an attempt, then its dead letter
refused by the same server, retried on the same connection for ever. Nothing was lost (never
acked), but nothing was applied again, and every message of the failover was charged
attempts it never made. Now a read-only answer is an outage: the connection is replaced (the
writable host), the batch applied again, no attempt counted.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

import outboxer
from outboxer.brokers.memory import memory_broker
from outboxer.consumer import Consumer, Delivery
from outboxer.receivers.memory import group_state
from outboxer.testing import make_message
from tests import relaying
from tests.failover import primary_and_standby

DB = "outboxer_failover_consumer"
#: Seconds the consumer has to apply what came after the failover.
BOUND = 15.0
INSERT = "INSERT INTO applied (message_id, n) VALUES ({}, {})"


def sync_handler(message: Delivery, conn: Any) -> None:
    conn.execute(INSERT.format("%s", "%s"), (message.id, message.payload["n"]))


async def asyncpg_handler(message: Delivery, conn: Any) -> None:
    await conn.execute(INSERT.format("$1", "$2"), message.id, message.payload["n"])


async def psycopg_async_handler(message: Delivery, conn: Any) -> None:
    await conn.execute(INSERT.format("%s", "%s"), (message.id, message.payload["n"]))


HANDLERS: dict[str, tuple[Callable[..., Any], str | None]] = {
    "psycopg": (sync_handler, None),
    "asyncpg": (asyncpg_handler, "asyncpg"),
    "psycopg-async": (psycopg_async_handler, "psycopg"),
}


def applied(url: str) -> set[str]:
    with psycopg.connect(url, autocommit=True) as conn:
        try:
            return {str(row[0]) for row in conn.execute("SELECT message_id FROM applied")}
        except psycopg.errors.UndefinedTable:
            return set()  # not replayed on the standby yet (a loaded box)


def dead_letters(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM outboxer.dead_letters").fetchone()
    return int(row[0]) if row else -1


@pytest.mark.parametrize("driver", list(HANDLERS))
async def test_audit20_consumer_applies_on_the_new_primary_after_the_fence(driver: str) -> None:
    handler, async_driver = HANDLERS[driver]
    with primary_and_standby(DB) as pair:
        url = pair.url(DB)
        async with outboxer.create_store(url) as store:
            await store.apply_schema()
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("CREATE TABLE applied (message_id uuid PRIMARY KEY, n int NOT NULL)")
        name = f"failover-{uuid.uuid4().hex[:8]}"
        broker = memory_broker(name)
        acked = group_state(name, "g").acked
        consumer = Consumer(
            db=url,
            broker=f"memory://{name}",
            group="g",
            handler=handler,
            concurrency=2,
            max_attempts=2,
            async_driver=async_driver,
        )
        task = asyncio.create_task(consumer.run_async())
        try:
            before = [make_message("t", {"n": n}, key=f"k{n}") for n in range(4)]
            broker.messages.extend(before)
            ids = {str(m.id) for m in before}
            await relaying.until(lambda: len(acked) == 4, "applied before the failover", BOUND)
            await relaying.until(
                lambda: applied(pair.standby_url(DB)) == ids, "replicated to the standby", BOUND
            )
            pair.fence()
            pair.promote()
            failed_over = time.monotonic()
            after = [make_message("t", {"n": n}, key=f"k{n}") for n in range(4, 8)]
            broker.messages.extend(after)
            ids |= {str(m.id) for m in after}
            await relaying.until(
                lambda: len(acked) == 8, f"not applied in {BOUND:g}s of the failover", BOUND
            )
            print(f"applied {time.monotonic() - failed_over:.2f}s after the failover")
        finally:
            consumer.stop()
            done, _ = await asyncio.wait({task}, timeout=5)
            if not done:
                task.cancel()
                await asyncio.wait({task})
        new_primary = pair.standby_url(DB)
        # Every message acked was applied, on the new primary, once; none charged an attempt.
        assert applied(new_primary) == ids
        assert dead_letters(new_primary) == 0
        assert consumer.stats.failed == 0, consumer.stats
        assert consumer.stats.database_errors >= 1, consumer.stats
