"""The consumer's suspect counters on a real RabbitMQ redelivery, as /metrics shows them.

Two messages are received and not acked, the connection closed: RabbitMQ delivers both
again, flagged redelivered, to an ``outboxer.Consumer``. One of them already has
``max_attempts - 1`` recorded deaths (earlier processes died applying it, as in
test_audit14_crash_consumer_rabbitmq.py, which runs them for real): its attempt is the
last one, and it is dead-lettered without its handler. The other is applied. Both attempts
are counted (``suspect_attempts``), the dead letter too (``suspects_dead_lettered``), and
the Prometheus exposition carries them. Before, neither counter existed: an operator saw a
dead letter, not that the consumer had been dying on it.
"""

from __future__ import annotations

import asyncio
import sqlite3
import uuid
from pathlib import Path

import aio_pika
from prometheus_client import CollectorRegistry, generate_latest

from outboxer.brokers import create_publisher
from outboxer.consumer import Consumer, ConsumerCollector, Delivery
from outboxer.testing import make_message
from tests.acceptance.test_audit14_crash_consumer_rabbitmq import declare, remove
from tests.services import require

RABBIT = "amqp://guest:guest@127.0.0.1:5672/"
MAX_ATTEMPTS = 3


def record(message: Delivery, conn: sqlite3.Connection) -> None:
    conn.execute("INSERT INTO applied (message_id) VALUES (?)", (str(message.id),))


async def scenario(db: str, path: Path, exchange: str, group: str) -> Consumer:
    await declare(exchange, group, "susp.*")  # as the consumer declares it

    broker = f"{RABBIT}?exchange={exchange}"
    victim, other = make_message("susp.a", {"n": 1}), make_message("susp.a", {"n": 2})
    async with create_publisher(broker) as publisher:
        outcomes = await publisher.publish_batch([victim, other])
    assert all(outcome.published for outcome in outcomes), outcomes

    # Received, not acked, the connection gone: what a consumer's death looks like to
    # RabbitMQ, which requeues both with the redelivered flag.
    connection = await aio_pika.connect(RABBIT)
    try:
        channel = await connection.channel()
        queue = await channel.declare_queue(group, passive=True)
        received = [await queue.get(no_ack=False, timeout=5) for _ in range(2)]
        assert received[0] is not None and received[1] is not None
        assert not received[0].redelivered
    finally:
        await connection.close()

    with sqlite3.connect(path) as lite:
        lite.execute(
            "INSERT INTO inbox_suspects (consumer, message_id, deaths) VALUES (?, ?, ?)",
            (group, str(victim.id), MAX_ATTEMPTS - 1),
        )
    consumer = Consumer(
        db=db,
        broker=broker,
        group=group,
        handler=record,
        topics=["susp.*"],
        max_attempts=MAX_ATTEMPTS,
        exit_when_idle=True,
    )
    await asyncio.wait_for(consumer.run_async(), timeout=8)
    with sqlite3.connect(path) as lite:
        assert lite.execute("SELECT message_id FROM applied").fetchall() == [(str(other.id),)]
        dead = lite.execute("SELECT message_id, attempts FROM dead_letters").fetchall()
        assert dead == [(str(victim.id), MAX_ATTEMPTS)]
    return consumer


def test_suspect_attempts_and_their_dead_letters_are_counted_and_scraped(
    sqlite_url: str,
) -> None:
    require("rabbitmq")
    path = Path(sqlite_url.removeprefix("sqlite:///"))
    with sqlite3.connect(path) as lite:
        lite.execute("CREATE TABLE applied (message_id TEXT)")
    exchange = f"susp-{uuid.uuid4().hex[:8]}"
    group = f"g-{exchange}"
    try:
        consumer = asyncio.run(scenario(sqlite_url, path, exchange, group))
    finally:
        asyncio.run(remove(exchange, group))

    stats = consumer.stats
    assert (stats.suspect_attempts, stats.suspects_dead_lettered) == (2, 1)
    assert (stats.applied, stats.dead_lettered, stats.failed) == (1, 1, 0)

    registry = CollectorRegistry()
    registry.register(ConsumerCollector([consumer]))
    scraped = generate_latest(registry).decode()
    assert f'outboxer_consumer_suspect_attempts_total{{group="{group}"}} 2.0' in scraped
    assert f'outboxer_consumer_suspects_dead_lettered_total{{group="{group}"}} 1.0' in scraped
