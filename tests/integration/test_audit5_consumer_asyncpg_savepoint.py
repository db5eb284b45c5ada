"""An async handler on asyncpg (the default async driver) that writes in its own
``async with conn.transaction():`` block, asyncpg's way to a savepoint: before, the runner
began its transaction by hand, so asyncpg refused the block (InterfaceError "cannot use
Connection.transaction() in a manually started transaction") and every message of such a
handler became a dead letter. A handler that catches a failed statement and goes on still
fails its batch (AbortedTransaction), nothing acked."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import psycopg

from outboxer.brokers.memory import memory_broker
from outboxer.consumer import Consumer, Delivery
from outboxer.retry import Backoff
from outboxer.testing import make_message
from tests.consumer_handlers import APPLIED_DDL, record_async


def run(db: str, handler: Any, count: int, **options: Any) -> Consumer:
    broker = f"audit5-{uuid.uuid4().hex[:8]}"
    memory_broker(broker).messages.extend(
        [make_message("t", {"n": n}, key=f"k{n}") for n in range(count)]
    )
    consumer = Consumer(
        db=db,
        broker=f"memory://{broker}",
        group="g",
        handler=handler,
        concurrency=1,
        backoff=Backoff(base=0.01, multiplier=2, cap=0.05, jitter=0),
        exit_when_idle=True,
        **options,
    )
    asyncio.run(asyncio.wait_for(consumer.run_async(), 20))
    return consumer


def rows(db: str, sql: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(db) as conn:
        return conn.execute(sql).fetchall()


def test_asyncpg_a_handler_with_its_own_transaction_block_is_applied(pg_url: str) -> None:
    with psycopg.connect(pg_url) as conn:
        conn.execute(APPLIED_DDL)

    async def handler(message: Delivery, conn: Any) -> None:
        async with conn.transaction():  # a savepoint in the runner's transaction
            await record_async(message, conn)
        if message.payload["n"] == 1:
            try:
                async with conn.transaction():  # rolled back alone; the message goes on
                    await conn.execute("SELECT 1/0")
            except Exception as exc:  # the handler's own choice
                assert "division by zero" in str(exc)

    consumer = run(pg_url, handler, 3, max_attempts=1)
    assert rows(pg_url, "SELECT count(*) FROM outboxer.dead_letters") == [(0,)]
    assert sorted(row[0] for row in rows(pg_url, "SELECT n FROM applied")) == [0, 1, 2]
    assert rows(pg_url, "SELECT count(*) FROM outboxer.inbox") == [(3,)]
    assert (consumer.stats.applied, consumer.stats.failed) == (3, 0)


def test_asyncpg_a_handler_that_goes_on_after_a_failed_statement_applies_nothing(
    pg_url: str,
) -> None:
    with psycopg.connect(pg_url) as conn:
        conn.execute(APPLIED_DDL)

    swallowed: list[Exception] = []

    async def handler(message: Delivery, conn: Any) -> None:
        await record_async(message, conn)
        try:
            await conn.execute("SELECT 1/0")  # aborts the transaction
        except Exception as exc:  # the mistake under test: it goes on
            swallowed.append(exc)

    consumer = run(pg_url, handler, 1, max_attempts=2)
    assert len(swallowed) == 2
    assert rows(pg_url, "SELECT count(*) FROM applied") == [(0,)]
    assert rows(pg_url, "SELECT count(*) FROM outboxer.inbox") == [(0,)]
    assert rows(pg_url, "SELECT attempts FROM outboxer.dead_letters") == [(2,)]
    assert consumer.stats.applied == 0
