"""A shutdown that cuts a suspect's attempt short is no death (RabbitMQ, PostgreSQL).

A message RabbitMQ delivers again (flagged redelivered) is a suspect: its attempt is recorded
in inbox_suspects before its handler runs, and a row still there at its next delivery counts
as a death (the process died under it). A graceful shutdown (``Consumer.stop``, SIGTERM to
``outboxer consume``) that cancels the running handler, or abandons a sync one that does not
return, ended the attempt itself, yet left the row: the next delivery counted a death, and
with ``max_attempts=1`` dead-lettered the message without calling its handler. Now the
shutdown deletes the row before handing the message back: the next consumer applies it.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from typing import Any

import aio_pika
import psycopg
import pytest

from outboxer.brokers import create_publisher
from outboxer.consumer import Consumer, Delivery
from outboxer.errors import ConsumerShutdownError
from outboxer.testing import make_message
from tests.acceptance.test_audit14_crash_consumer_rabbitmq import declare, remove
from tests.services import require

RABBIT = "amqp://guest:guest@127.0.0.1:5672/"
WAIT = 5.0


def suspect_rows(db: str, group: str) -> list[tuple[str, int]]:
    with psycopg.connect(db) as conn:
        rows = conn.execute(
            "SELECT message_id, deaths FROM outboxer.inbox_suspects WHERE consumer = %s",
            (group,),
        ).fetchall()
    return [(str(message_id), int(deaths)) for message_id, deaths in rows]


def dead_letters(db: str, group: str) -> list[str]:
    with psycopg.connect(db) as conn:
        rows = conn.execute(
            "SELECT message_id FROM outboxer.dead_letters WHERE consumer = %s", (group,)
        ).fetchall()
    return [str(message_id) for (message_id,) in rows]


async def redelivered_once(exchange: str, group: str) -> uuid.UUID:
    """One message in the group's queue, received and not acked on a connection that then
    closed: RabbitMQ requeues it flagged redelivered, a suspect for the next consumer."""
    await declare(exchange, group, "susp.*")  # as the consumer declares it
    message = make_message("susp.a", {"n": 1})
    async with create_publisher(f"{RABBIT}?exchange={exchange}") as publisher:
        outcomes = await publisher.publish_batch([message])
    assert all(outcome.published for outcome in outcomes), outcomes
    connection = await aio_pika.connect(RABBIT)
    try:
        channel = await connection.channel()
        queue = await channel.declare_queue(group, passive=True)
        received = await queue.get(no_ack=False, timeout=WAIT)
        assert received is not None and not received.redelivered
    finally:
        await connection.close()
    return message.id


async def cut_short(db: str, exchange: str, group: str, kind: str) -> None:
    """Run a consumer whose handler blocks until the consumer's shutdown cuts it short: an
    async handler cancelled, or a sync one that does not return (abandoned)."""
    started = asyncio.Event()
    loop = asyncio.get_running_loop()
    release = threading.Event()

    async def blocks_async(message: Delivery, conn: Any) -> None:
        started.set()
        await asyncio.Event().wait()  # until cancelled

    def blocks_sync(message: Delivery, conn: Any) -> None:
        loop.call_soon_threadsafe(started.set)
        release.wait(WAIT)

    consumer = Consumer(
        db=db,
        broker=f"{RABBIT}?exchange={exchange}",
        group=group,
        handler=blocks_async if kind == "async" else blocks_sync,
        topics=["susp.*"],
        max_attempts=1,
        shutdown_timeout=0.3,
        concurrency=1,
    )
    run = asyncio.create_task(consumer.run_async())
    waiting = asyncio.ensure_future(started.wait())
    await asyncio.wait({run, waiting}, timeout=WAIT, return_when=asyncio.FIRST_COMPLETED)
    waiting.cancel()
    assert started.is_set(), "the handler never started"
    assert consumer.stats.suspect_attempts == 1
    consumer.stop()
    with pytest.raises(ConsumerShutdownError) as stopped:
        await asyncio.wait_for(run, timeout=WAIT)
    assert stopped.value.hung is (kind == "sync")
    # What the end of `outboxer consume` does to the abandoned handler's transaction (its
    # inbox claim would hold the next delivery's): the thread returns, the batch rolls back.
    release.set()


async def next_delivery(db: str, exchange: str, group: str) -> tuple[Consumer, list[uuid.UUID]]:
    applied: list[uuid.UUID] = []

    def record(message: Delivery, conn: Any) -> None:
        applied.append(message.id)

    consumer = Consumer(
        db=db,
        broker=f"{RABBIT}?exchange={exchange}",
        group=group,
        handler=record,
        topics=["susp.*"],
        max_attempts=1,
        exit_when_idle=True,
    )
    await asyncio.wait_for(consumer.run_async(), timeout=WAIT)
    return consumer, applied


@pytest.mark.parametrize("kind", ["async", "sync"])
def test_a_suspect_attempt_the_shutdown_cuts_short_counts_no_death(pg_url: str, kind: str) -> None:
    require("rabbitmq")
    exchange = f"susp16-{uuid.uuid4().hex[:8]}"
    group = f"g-{exchange}"
    try:
        message_id = asyncio.run(redelivered_once(exchange, group))
        asyncio.run(cut_short(pg_url, exchange, group, kind))
        # Before: the row of the cut-short attempt stayed, (id, 0): a death at the next
        # delivery.
        assert suspect_rows(pg_url, group) == []
        consumer, applied = asyncio.run(next_delivery(pg_url, exchange, group))
        # Before: deaths=1 >= max_attempts=1, dead-lettered without its handler.
        assert dead_letters(pg_url, group) == []
        assert applied == [message_id]
        assert (consumer.stats.suspect_attempts, consumer.stats.applied) == (1, 1)
        assert suspect_rows(pg_url, group) == []
    finally:
        asyncio.run(remove(exchange, group))
