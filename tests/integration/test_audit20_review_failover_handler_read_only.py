"""A handler on PostgreSQL that makes the consumer's transaction read-only itself (``SET
TRANSACTION READ ONLY``: a handler that only reads, guarding itself) and returns: the
consumer's own writes after the handlers, a redelivered message's suspect row and a
replayed dead letter's removal, are refused with SQLSTATE 25006.

08bbb8f took every 25006 of the consumer's own statements for a failover (a lost
connection): no attempt counted, the message applied again at once, then after the outage
backoff, for ever: a redelivered message of such a handler was never dead-lettered, its
key held back for good, and ``replay_dead_letters`` stopped with the error at the first
such dead letter. A transaction that began writable stays so whatever the server's fence
(its inbox claim wrote before any handler ran), so a 25006 after the handlers is the
handler's doing: its failure (HandlerMadeReadOnly), charged, retried, dead-lettered.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from outboxer.brokers.memory import memory_broker
from outboxer.consumer import Consumer, Delivery
from outboxer.receivers.base import Incoming
from outboxer.receivers.memory import MemoryReceiver
from outboxer.retry import Backoff
from outboxer.testing import make_message

READ_ONLY = "SET TRANSACTION READ ONLY"


def sync_handler(message: Delivery, conn: Any) -> None:
    conn.execute(READ_ONLY)


async def async_handler(message: Delivery, conn: Any) -> None:
    await conn.execute(READ_ONLY)


HANDLERS: dict[str, tuple[Callable[..., Any], str | None]] = {
    "psycopg": (sync_handler, None),
    "asyncpg": (async_handler, "asyncpg"),
    "psycopg-async": (async_handler, "psycopg"),
}


def dead_letters(url: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute(
            "SELECT message_id, attempts, error FROM outboxer.dead_letters"
        ).fetchall()


async def _within(check: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


def _consumer(url: str, driver: str, broker: str) -> Consumer:
    handler, async_driver = HANDLERS[driver]
    return Consumer(
        db=url,
        broker=f"memory://{broker}",
        group="g",
        handler=handler,
        max_attempts=2,
        backoff=Backoff(0.05, 2.0, 0.1, 0.0),
        async_driver=async_driver,
    )


@pytest.mark.parametrize("driver", list(HANDLERS))
async def test_a_suspect_whose_handler_made_it_read_only_is_dead_lettered(
    pg_url: str, driver: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    received = MemoryReceiver._receive

    async def redelivered(self: MemoryReceiver, limit: int, timeout: float) -> list[Incoming]:
        incomings = await received(self, limit, timeout)
        for incoming in incomings:
            incoming.redelivered = True  # as a broker flags a message it delivered before
        return incomings

    monkeypatch.setattr(MemoryReceiver, "_receive", redelivered)
    name = f"ro-handler-{uuid.uuid4().hex[:8]}"
    message = make_message("t", {"n": 1}, key="k")
    memory_broker(name).messages.append(message)
    consumer = _consumer(pg_url, driver, name)
    running = asyncio.create_task(consumer.run_async())
    try:
        dead = await _within(lambda: consumer.stats.dead_lettered == 1, 4)
    finally:
        consumer.stop()
        await asyncio.wait_for(running, 10)
    assert dead, f"not dead-lettered within 4 s: {consumer.stats}"
    [(message_id, attempts, error)] = dead_letters(pg_url)
    assert (message_id, attempts) == (message.id, 2)
    assert "read-only" in error, error
    assert consumer.stats.failed == 2, consumer.stats
    assert consumer.stats.database_errors == 0, consumer.stats


@pytest.mark.parametrize("driver", list(HANDLERS))
async def test_replaying_with_a_handler_that_made_it_read_only_records_the_failure(
    pg_url: str, driver: str
) -> None:
    message = make_message("t", {"n": 1}, key="k")
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO outboxer.dead_letters (consumer, message_id, topic, key, headers, "
            "content_type, payload, error, attempts) "
            "VALUES ('g', %s, 't', 'k', '{}', 'application/json', %s, 'before', 1)",
            (message.id, message.payload),
        )
    consumer = _consumer(pg_url, driver, f"ro-replay-{uuid.uuid4().hex[:8]}")
    report = await asyncio.wait_for(consumer.replay_dead_letters(), 5)
    assert report.get("failed") == 1, report
    [(message_id, attempts, error)] = dead_letters(pg_url)
    assert (message_id, attempts) == (message.id, 2)
    assert "read-only" in error, error
