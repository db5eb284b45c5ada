"""`exit_when_idle` waits for what a receiver is still getting ready to deliver: NATS's
redeliveries of a crashed holder (after ack_wait), a Kafka group's first assignment."""

from __future__ import annotations

import asyncio
import sqlite3
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from outboxer.brokers import create_publisher
from outboxer.consumer import Consumer, Delivery
from outboxer.receivers import create_receiver
from outboxer.testing import make_message
from tests.services import require


def consumed(db: str, url: str, group: str, topic: str, **options: Any) -> list[int]:
    path = db.removeprefix("sqlite:///")
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS applied (n INT)")

    def record(message: Delivery, conn: sqlite3.Connection) -> None:
        conn.execute("INSERT INTO applied (n) VALUES (?)", (message.payload["n"],))

    consumer = Consumer(
        db=db,
        broker=url,
        group=group,
        handler=record,
        topics=[topic],
        exit_when_idle=True,
        broker_options=options,
    )
    asyncio.run(asyncio.wait_for(consumer.run_async(), 60))
    with sqlite3.connect(path) as conn:
        return sorted(n for (n,) in conn.execute("SELECT n FROM applied"))


async def publish(url: str, topic: str, count: int) -> None:
    async with create_publisher(url) as publisher:
        outcomes = await publisher.publish_batch(
            [make_message(topic, {"n": n}, key="k") for n in range(count)]
        )
    assert all(o.published for o in outcomes)


def test_nats_waits_for_the_redeliveries_of_a_crashed_holder(sqlite_url: str) -> None:
    require("nats")
    stream = f"idle_{uuid.uuid4().hex[:8]}"
    topic, group = f"{stream}.t", f"g-{stream}"
    url = f"nats://127.0.0.1:4222?stream={stream}&create_stream=true&subjects={stream}.>"

    async def crash() -> None:
        holder = create_receiver(url, group=group, topics=[topic], ack_wait=1)
        await holder.connect()
        await publish(url, topic, 3)
        held: list[Any] = []
        while len(held) < 3:
            held += await holder.receive(3, 1.0)
        await holder.close()  # never acked: the process died

    asyncio.run(crash())
    try:
        assert consumed(sqlite_url, url, group, topic, ack_wait=1) == [0, 1, 2]
    finally:

        async def cleanup() -> None:
            import nats

            nc = await nats.connect("nats://127.0.0.1:4222")
            await nc.jetstream().delete_stream(stream)
            await nc.close()

        asyncio.run(cleanup())


@pytest.fixture(scope="module")
def kafka_bootstrap() -> Iterator[str]:
    from tests.integration.test_broker_kafka import MockCluster

    cluster = MockCluster()
    yield cluster.bootstrap
    cluster.stop()


def test_kafka_waits_for_its_first_assignment(sqlite_url: str, kafka_bootstrap: str) -> None:
    from confluent_kafka.admin import AdminClient

    topic = f"idle-{uuid.uuid4().hex[:8]}"
    AdminClient({"bootstrap.servers": kafka_bootstrap}).list_topics(topic=topic, timeout=10)
    url = f"kafka://{kafka_bootstrap}"
    asyncio.run(publish(url, topic, 3))
    assert consumed(sqlite_url, url, f"g-{topic}", topic) == [0, 1, 2]
