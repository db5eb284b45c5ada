"""``handler_timeout`` with an async handler that ignores its cancellation, at shutdown
(review; Redis, PostgreSQL through asyncpg and psycopg).

- Cut short by the shutdown (``shutdown_timeout`` shorter than ``handler_timeout``), its
  session was left open under it: its transaction, holding the inbox claims of its batch,
  stayed open after ``run_async`` had raised (its messages handed back to the broker, whose
  next delivery waited on those claims), unlike a handler abandoned at ``handler_timeout``,
  whose connection the shutdown closes.
- ``Consumer.run()`` (asyncio.run) waited for such a handler for ever: asyncio's end cancels
  every task left and waits for each, and this one ignores its cancellation.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import pytest

from outboxer.consumer import Consumer, Delivery
from outboxer.errors import ConsumerShutdownError
from tests.integration.test_audit16_htimeout_consumer import FAST, REDIS, dead_letters, drop
from tests.integration.test_audit17_handlertimeout_async_abandon import (
    DRIVERS,
    Stubborn,
    applied,
    idle_in_transaction,
    prepare,
    publish,
    until,
)
from tests.services import require


@pytest.mark.parametrize("driver", DRIVERS)
def test_a_handler_cut_short_by_the_shutdown_leaves_no_transaction_open(
    pg_url: str, driver: str
) -> None:
    require("redis")
    prepare(pg_url)
    stream = f"hs-{uuid.uuid4().hex[:12]}"

    async def scenario() -> tuple[ConsumerShutdownError, int, float, Stubborn]:
        ids = await publish(stream)
        handler = Stubborn({0})
        consumer = Consumer(
            db=pg_url,
            broker=REDIS,
            group=f"g-{uuid.uuid4().hex[:8]}",
            handler=handler,
            topics=[stream],
            async_driver=driver,
            concurrency=2,
            backoff=FAST,
            handler_timeout=30,  # never reached: the shutdown cuts it short first
            shutdown_timeout=0.3,
        )
        run = asyncio.create_task(consumer.run_async())
        try:
            await until(
                lambda: handler.running == 1 and applied(pg_url) == [(2, "b")],
                8,
                "the stubborn handler running and key b's message applied",
            )
            began = time.monotonic()
            consumer.stop()
            with pytest.raises(ConsumerShutdownError) as stopped:
                await asyncio.wait_for(run, 5)
            took = time.monotonic() - began
            # Before: its transaction (the inbox claim of message 0) stayed open under it.
            left = idle_in_transaction(pg_url)
            assert handler.running == 1  # still ignoring its cancellation
        finally:
            handler.release.set()
            consumer.stop()
            if not run.done():
                await asyncio.wait({run}, timeout=5)
            await drop(stream)
        assert stopped.value.message_ids == [str(ids[0])]
        return stopped.value, left, took, handler

    error, left, took, handler = asyncio.run(scenario())
    assert error.hung
    assert left == 0
    assert took < 3
    # Its late write found its connection closed; message 1 (key "a", behind it) waits for
    # the next run.
    assert len(handler.late) == 1 and handler.late[0] is not None
    assert applied(pg_url) == [(2, "b")]


def test_run_does_not_wait_for_an_abandoned_handler_that_ignores_its_cancellation(
    pg_url: str,
) -> None:
    require("redis")
    prepare(pg_url)
    stream = f"hs-{uuid.uuid4().hex[:12]}"
    ids = asyncio.run(publish(stream))
    #: The handler ignores its cancellations until then: a bound for the old code's wait.
    gives_up_at = time.monotonic() + 8
    cancellations = 0

    async def stubborn(message: Delivery, conn: Any) -> None:
        nonlocal cancellations
        if message.payload["n"] == 0:
            while time.monotonic() < gives_up_at:
                try:
                    await asyncio.sleep(gives_up_at - time.monotonic())
                except asyncio.CancelledError:
                    cancellations += 1
            return
        await conn.execute(
            "INSERT INTO applied (n, key) VALUES ($1, $2)", message.payload["n"], message.key
        )

    consumer = Consumer(
        db=pg_url,
        broker=REDIS,
        group=f"g-{uuid.uuid4().hex[:8]}",
        handler=stubborn,
        topics=[stream],
        concurrency=2,
        max_attempts=1,
        backoff=FAST,
        handler_timeout=0.3,
        exit_when_idle=True,
    )
    began = time.monotonic()
    try:
        with pytest.raises(ConsumerShutdownError) as stopped:
            consumer.run()
        took = time.monotonic() - began
    finally:
        asyncio.run(drop(stream))
    assert stopped.value.hung and stopped.value.message_ids == [str(ids[0])]
    # Before: asyncio.run's end waited until the handler gave up (8 s).
    assert took < 5, took
    assert cancellations >= 2
    [(message_id, attempts, _)] = dead_letters(pg_url, consumer.group)
    assert (message_id, attempts) == (str(ids[0]), 1)
    assert sorted(applied(pg_url)) == [(1, "a"), (2, "b")]
    assert idle_in_transaction(pg_url) == 0
