"""MQTT receiver audit: the session across a connection cut (QoS 1 messages published while
the consumer is away, messages in flight when the connection drops mid-batch), and
messages a foreign client published with hostile envelope fields."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import aiomqtt
import psycopg
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from outboxer.brokers import create_publisher
from outboxer.consumer import Consumer, Delivery
from outboxer.errors import BrokerUnavailableError
from outboxer.receivers import create_receiver
from outboxer.receivers.base import Incoming, Receiver
from outboxer.testing import make_message
from tests.chaos.proxy import FaultProxy
from tests.consumer_handlers import APPLIED_DDL, record
from tests.services import require

BROKER = "mqtt://127.0.0.1:1883?session_expiry=60"


@pytest.fixture
def proxy() -> Iterator[FaultProxy]:
    require("mosquitto")
    proxy = FaultProxy(1883).start()
    yield proxy
    proxy.stop()


def fresh_topic() -> str:
    return f"audit/{uuid.uuid4().hex[:10]}"


async def publish(topic: str, numbers: range) -> list[uuid.UUID]:
    messages = [make_message(topic, {"n": n}, key=f"k{n}") for n in numbers]
    async with create_publisher(BROKER) as publisher:
        outcomes = await publisher.publish_batch(messages)
    assert all(o.published for o in outcomes), outcomes
    return [m.id for m in messages]


async def collect(receiver: Receiver, count: int, timeout: float = 10.0) -> list[Incoming]:
    """Receive until ``count`` arrived, connecting again after a lost connection."""
    received: list[Incoming] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while len(received) < count and loop.time() < deadline:
        if not receiver.connected:
            await receiver.connect()
        try:
            received += await receiver.receive(count - len(received), 0.2)
        except BrokerUnavailableError:
            continue
    return received


async def test_qos1_messages_published_while_away_come_after_the_reconnect(
    proxy: FaultProxy,
) -> None:
    topic = fresh_topic()
    url = f"mqtt://127.0.0.1:{proxy.port}?session_expiry=60"
    receiver = create_receiver(url, group=f"g{uuid.uuid4().hex[:8]}", topics=[topic], name="a")
    await receiver.connect()
    try:
        ids = await publish(topic, range(1))
        held = await collect(receiver, 1)
        assert [i.delivery.id for i in held] == ids
        assert proxy.cut() >= 1  # the message in flight: never PUBACKed
        with pytest.raises(BrokerUnavailableError):
            for _ in range(50):
                await receiver.receive(10, 0.2)
        ids += await publish(topic, range(1, 3))  # while the consumer is away
        await receiver.ack(held)  # committed meanwhile: the ack is for a dead connection
        assert receiver.stats.stale_acks == 1
        again = await collect(receiver, 3)
        assert [i.delivery.id for i in again] == ids  # kept by the session, in order
        await receiver.ack(again)
        await receiver.close()
        await receiver.connect()
        assert await collect(receiver, 1, 1.5) == []  # all PUBACKed: the session is empty
    finally:
        await receiver.close()


def test_a_cut_while_a_batch_applies_redelivers_and_the_inbox_skips_it(
    pg_url: str, proxy: FaultProxy
) -> None:
    require("mosquitto")
    topic = fresh_topic()
    ids = asyncio.run(publish(topic, range(5)))  # no session yet: subscribe first
    group = f"g{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_url) as conn:
        conn.execute(APPLIED_DDL)
    cut = threading.Event()

    def cut_once(message: Delivery, conn: Any) -> None:
        record(message, conn)
        if message.payload["n"] == 7 and not cut.is_set():
            cut.set()
            assert proxy.cut() >= 1  # after the handler, before commit and PUBACK

    consumer = Consumer(
        db=f"{pg_url}",
        broker=f"mqtt://127.0.0.1:{proxy.port}?session_expiry=60",
        group=group,
        handler=cut_once,
        topics=[topic],
        name="audit",
        concurrency=1,
    )

    async def run() -> None:
        task = asyncio.create_task(consumer.run_async())
        loop = asyncio.get_running_loop()
        while consumer.receiver.stats.connects == 0:  # subscribed: the session takes them
            await asyncio.sleep(0.05)
        ids.extend(await publish(topic, range(5, 10)))
        deadline = loop.time() + 30
        while loop.time() < deadline:
            with psycopg.connect(pg_url) as conn:
                done = conn.execute("SELECT count(DISTINCT message_id) FROM applied").fetchone()
            if done and done[0] == 5 and consumer.receiver.stats.acked >= 5:
                break
            await asyncio.sleep(0.1)
        consumer.stop()
        await asyncio.wait_for(task, 30)

    asyncio.run(run())
    applied = [m for (m,) in psycopg.connect(pg_url).execute("SELECT message_id FROM applied")]
    assert cut.is_set()
    assert sorted(applied) == sorted(ids[5:])  # each exactly once
    assert consumer.stats.duplicates >= 1 and consumer.receiver.stats.connects >= 2


def _properties(**values: Any) -> Properties:
    properties = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    for name, value in values.items():
        setattr(properties, name, value)
    return properties


@pytest.mark.parametrize(
    ("payload", "properties"),
    [
        (b"\xff\xfe", {"ContentType": "text/plain", "CorrelationData": b"\xff\x00"}),
        (b"{not json", {"ContentType": "application/json"}),
        (b"raw", {}),
        (b"\x00" * 200_000, {"UserProperty": [("outboxer-id", "x" * 10_000)]}),
        (
            b"{}",
            {
                "CorrelationData": str(uuid.uuid4()).encode(),
                "ContentType": "text/plain",
                "UserProperty": [("outboxer-key", "k\u2028"), ("h", "\U0001f600")],
            },
        ),
    ],
    ids=["not-utf8", "not-json", "no-envelope", "huge", "control-chars"],
)
def test_runner_dead_letters_a_foreign_message_and_goes_on(
    pg_url: str, payload: bytes, properties: dict[str, Any]
) -> None:
    require("mosquitto")
    topic = fresh_topic()
    group = f"g{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_url) as conn:
        conn.execute(APPLIED_DDL)

    def handler(message: Delivery, conn: Any) -> None:
        if not isinstance(message.payload, dict) or "n" not in message.payload:
            raise RuntimeError("not ours")
        record(message, conn)

    consumer = Consumer(
        db=pg_url,
        broker=BROKER,
        group=group,
        handler=handler,
        topics=[topic],
        name="audit",
        max_attempts=1,
    )

    async def run() -> None:
        task = asyncio.create_task(consumer.run_async())
        while consumer.receiver.stats.connects == 0:
            await asyncio.sleep(0.05)
        async with aiomqtt.Client(
            "127.0.0.1", 1883, protocol=aiomqtt.ProtocolVersion.V5, identifier=f"f-{group}"
        ) as client:
            await client.publish(topic, payload, qos=1, properties=_properties(**properties))
        await publish(topic, range(1))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 20
        while consumer.receiver.stats.acked < 2 and loop.time() < deadline:
            await asyncio.sleep(0.1)
        consumer.stop()
        await asyncio.wait_for(task, 30)

    asyncio.run(run())
    with psycopg.connect(pg_url) as conn:
        applied = conn.execute("SELECT n FROM applied").fetchall()
        dead = conn.execute("SELECT count(*) FROM outboxer.dead_letters").fetchone()
    assert applied == [(0,)]
    assert dead == (1,)
    assert consumer.receiver.stats.acked == 2 and consumer.stats.broker_errors == 0
