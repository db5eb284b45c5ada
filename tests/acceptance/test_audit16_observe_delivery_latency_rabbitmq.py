"""The consumer's delivery latency on a real RabbitMQ, as /metrics shows it.

``outboxer_consumer_delivery_seconds{group}``: seconds from a message's creation (the
``created_at`` it carries from its enqueue transaction) to the commit that applied it, the
whole pipeline's delay as the consuming side sees it. Before, the consumer's /metrics had
counters only: an operator could not tell that events arrived minutes late, nor alert on it.
Two messages created 3 s and 40 s ago fall in the 5 s and 60 s buckets; a duplicate is not
observed (it was not applied)."""

from __future__ import annotations

import asyncio
import dataclasses
import sqlite3
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from outboxer.brokers import create_publisher
from outboxer.consumer import Consumer, ConsumerCollector, Delivery
from outboxer.testing import make_message
from tests.acceptance.test_audit14_crash_consumer_rabbitmq import declare, remove
from tests.services import require

RABBIT = "amqp://guest:guest@127.0.0.1:5672/"


def record(message: Delivery, conn: sqlite3.Connection) -> None:
    conn.execute("INSERT INTO applied (message_id) VALUES (?)", (str(message.id),))


async def scenario(db: str, exchange: str, group: str) -> Consumer:
    await declare(exchange, group, "lat.*")  # as the consumer declares it
    now = datetime.now(UTC)
    recent, old = (
        dataclasses.replace(make_message("lat.a", {"n": n}), created_at=now - timedelta(seconds=s))
        for n, s in ((1, 3), (2, 40))
    )
    async with create_publisher(f"{RABBIT}?exchange={exchange}") as publisher:
        # The second copy of ``recent`` is a duplicate: acked, not applied, not observed.
        outcomes = await publisher.publish_batch([recent, old, recent])
    assert all(outcome.published for outcome in outcomes), outcomes
    consumer = Consumer(
        db=db,
        broker=f"{RABBIT}?exchange={exchange}",
        group=group,
        handler=record,
        topics=["lat.*"],
        exit_when_idle=True,
    )
    await asyncio.wait_for(consumer.run_async(), timeout=8)
    return consumer


def test_applied_messages_are_timed_from_their_creation(sqlite_url: str) -> None:
    require("rabbitmq")
    path = Path(sqlite_url.removeprefix("sqlite:///"))
    with sqlite3.connect(path) as lite:
        lite.execute("CREATE TABLE applied (message_id TEXT)")
    exchange = f"lat-{uuid.uuid4().hex[:8]}"
    group = f"g-{exchange}"
    try:
        consumer = asyncio.run(scenario(sqlite_url, exchange, group))
    finally:
        asyncio.run(remove(exchange, group))
    assert (consumer.stats.applied, consumer.stats.duplicates) == (2, 1)

    registry = CollectorRegistry()
    registry.register(ConsumerCollector([consumer]))
    scraped = generate_latest(registry).decode()

    def bucket(le: str) -> float:
        line = f'outboxer_consumer_delivery_seconds_bucket{{group="{group}",le="{le}"}} '
        [value] = [row.removeprefix(line) for row in scraped.splitlines() if row.startswith(line)]
        return float(value)

    assert (bucket("2.5"), bucket("5.0"), bucket("30.0"), bucket("60.0")) == (0, 1, 1, 2)
    assert bucket("+Inf") == 2
    assert f'outboxer_consumer_delivery_seconds_count{{group="{group}"}} 2.0' in scraped
    [total] = [
        float(row.split()[-1])
        for row in scraped.splitlines()
        if row.startswith(f'outboxer_consumer_delivery_seconds_sum{{group="{group}"}}')
    ]
    assert 43 <= total < 50  # 3 s and 40 s, plus the few seconds of the test
