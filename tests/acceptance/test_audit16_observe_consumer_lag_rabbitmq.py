"""The group's backlog at the broker on a consumer's /metrics, on a real RabbitMQ.

``outboxer_consumer_lag_messages{group}`` is what the receiver's ``lag()`` last read (every
``LAG_INTERVAL``): for RabbitMQ the group queue's ready messages, those no consumer was
handed yet. Before, nothing on the consumer's side said how much waited for it, so a
stalled group (its handler hung, its prefetch full) showed only as silence. Six messages,
prefetch 2, a handler held: 4 wait; released, the group drains and the series is gone once
the consumer stopped (a stopped consumer reads nothing)."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import uuid
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from outboxer import consumer as consumer_module
from outboxer.brokers import create_publisher
from outboxer.consumer import Consumer, ConsumerCollector, Delivery
from outboxer.testing import make_message
from tests.acceptance.test_audit14_crash_consumer_rabbitmq import declare, remove
from tests.services import require

RABBIT = "amqp://guest:guest@127.0.0.1:5672/"


def lag_line(consumer: Consumer) -> str | None:
    registry = CollectorRegistry()
    registry.register(ConsumerCollector([consumer]))
    prefix = f'outboxer_consumer_lag_messages{{group="{consumer.group}"}} '
    rows = generate_latest(registry).decode().splitlines()
    return next((row.removeprefix(prefix) for row in rows if row.startswith(prefix)), None)


async def scenario(db: str, exchange: str, group: str) -> tuple[str | None, Consumer]:
    await declare(exchange, group, "lag.*")
    async with create_publisher(f"{RABBIT}?exchange={exchange}") as publisher:
        outcomes = await publisher.publish_batch(
            [make_message("lag.a", {"n": n}, key=f"k{n}") for n in range(6)]
        )
    assert all(outcome.published for outcome in outcomes), outcomes
    release = threading.Event()

    def held(message: Delivery, conn: sqlite3.Connection) -> None:
        assert release.wait(10), "never released"
        conn.execute("INSERT INTO applied (message_id) VALUES (?)", (str(message.id),))

    consumer = Consumer(
        db=db,
        broker=f"{RABBIT}?exchange={exchange}",
        group=group,
        handler=held,
        topics=["lag.*"],
        prefetch=2,
        concurrency=1,
        exit_when_idle=True,
    )
    running = asyncio.create_task(consumer.run_async())
    seen: str | None = None
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5
        while (seen := lag_line(consumer)) != "4.0" and loop.time() < deadline:
            await asyncio.sleep(0.05)
    finally:
        release.set()
        await asyncio.wait_for(running, timeout=10)
    return seen, consumer


def test_the_group_s_backlog_is_on_the_consumer_s_metrics(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    require("rabbitmq")
    monkeypatch.setattr(consumer_module, "LAG_INTERVAL", 0.1)
    path = Path(sqlite_url.removeprefix("sqlite:///"))
    with sqlite3.connect(path) as lite:
        lite.execute("CREATE TABLE applied (message_id TEXT)")
    exchange = f"lag-{uuid.uuid4().hex[:8]}"
    group = f"g-{exchange}"
    try:
        seen, consumer = asyncio.run(scenario(sqlite_url, exchange, group))
    finally:
        asyncio.run(remove(exchange, group))
    assert seen == "4.0"  # 6 published, 2 handed over (prefetch), the handler held
    assert consumer.stats.applied == 6
    assert lag_line(consumer) is None  # stopped: no reading
