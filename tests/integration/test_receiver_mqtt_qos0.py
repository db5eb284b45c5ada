"""A message a foreign publisher sent at QoS 0 reaches the MQTT receiver among outboxer's QoS 1
ones. It gets no PUBACK: the receiver used to send one for packet id 0, a protocol error for
which Mosquitto drops the connection, losing every PUBACK in flight (all redelivered). And it
is not flow-controlled by Receive Maximum, so the receiver bounds those waiting itself."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import aiomqtt
import psycopg
import pytest

from outboxer.brokers import create_publisher
from outboxer.brokers.mqtt import publish_properties
from outboxer.consumer import Consumer
from outboxer.receivers import create_receiver
from outboxer.receivers.base import Incoming, Receiver
from outboxer.receivers.mqtt import MqttReceiver
from outboxer.testing import make_message
from tests.consumer_handlers import APPLIED_DDL, record
from tests.services import require

BROKER = "mqtt://127.0.0.1:1883?session_expiry=60"


@pytest.fixture(autouse=True)
def _mosquitto() -> None:
    require("mosquitto")


def fresh_topic() -> str:
    return f"qos0/{uuid.uuid4().hex[:10]}"


async def publish(topic: str, numbers: range) -> None:
    """outboxer's own publisher: QoS 1."""
    async with create_publisher(BROKER) as publisher:
        outcomes = await publisher.publish_batch(
            [make_message(topic, {"n": n}, key=f"k{n}") for n in numbers]
        )
    assert all(o.published for o in outcomes), outcomes


async def publish_foreign(
    topic: str, numbers: range, qos: int = 0, *, then: range = range(0)
) -> None:
    """Another MQTT client, with the envelope as properties, at ``qos``; then ``then`` at QoS 1
    on the same connection, so that the broker has taken every earlier one when it answers.

    Each call is a client of its own: a QoS 0 publish is done once written to the socket,
    and a second connection with the same client id made the broker close the first one
    before it had read the rest (the broker's log: "already connected, closing old
    connection"), losing those messages."""
    async with aiomqtt.Client(
        "127.0.0.1",
        1883,
        protocol=aiomqtt.ProtocolVersion.V5,
        identifier=f"foreign-{uuid.uuid4().hex[:12]}",
    ) as client:
        for n, message_qos in [(n, qos) for n in numbers] + [(n, 1) for n in then]:
            message = make_message(topic, {"n": n}, key=f"k{n}")
            await client.publish(
                topic, message.payload, qos=message_qos, properties=publish_properties(message)
            )


async def collect(receiver: Receiver, count: int, timeout: float = 10.0) -> list[Incoming]:
    received: list[Incoming] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while len(received) < count and loop.time() < deadline:
        received += await receiver.receive(count - len(received), 0.2)
    return received


def numbers(incomings: list[Incoming]) -> list[int]:
    return sorted(i.delivery.payload["n"] for i in incomings)


async def test_a_qos0_message_gets_no_puback_and_the_connection_stays() -> None:
    topic, group = fresh_topic(), f"g-{uuid.uuid4().hex[:8]}"
    receiver = create_receiver(BROKER, group=group, topics=[topic], name="qos0")
    await receiver.connect()
    try:
        await publish(topic, range(0, 2))
        await publish_foreign(topic, range(2, 3))
        await publish(topic, range(3, 5))
        received = await collect(receiver, 5)
        assert numbers(received) == [0, 1, 2, 3, 4]
        await receiver.ack(received)
        # The broker kept the connection: nothing more, and no lost connection, comes.
        assert await receiver.receive(5, 1.0) == []
        assert receiver.connected and receiver.stats.connects == 1
        assert (receiver.stats.acked, receiver.stats.failed_acks) == (5, 0)
        # Every QoS 1 PUBACK reached the broker: the session holds nothing to send again.
        await receiver.close()
        await receiver.connect()
        assert await collect(receiver, 1, 2.0) == []
    finally:
        await receiver.close()


async def test_a_qos0_message_not_done_holds_back_no_puback() -> None:
    """A QoS 0 message has no place in the PUBACK order: those after it go out without it."""
    topic, group = fresh_topic(), f"g-{uuid.uuid4().hex[:8]}"
    receiver = create_receiver(BROKER, group=group, topics=[topic], name="qos0")
    await receiver.connect()
    try:
        await publish_foreign(topic, range(0, 1))
        first = await collect(receiver, 1)
        await publish(topic, range(1, 3))
        later = await collect(receiver, 2)
        await receiver.ack(later)  # the QoS 0 message is never acked (say it is retrying)
        await receiver.close()
        await receiver.connect()
        assert await collect(receiver, 1, 2.0) == []
        assert numbers(first) == [0]
    finally:
        await receiver.close()


async def test_qos0_messages_waiting_are_bounded_by_prefetch() -> None:
    topic, group = fresh_topic(), f"g-{uuid.uuid4().hex[:8]}"
    receiver = create_receiver(BROKER, group=group, topics=[topic], name="qos0", prefetch=3)
    assert isinstance(receiver, MqttReceiver)
    await receiver.connect()
    try:
        # Nothing is received meanwhile: all ten wait (a QoS 1 message follows them).
        await publish_foreign(topic, range(10), then=range(10, 11))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5
        while receiver.qos0_dropped < 7 and loop.time() < deadline:
            await asyncio.sleep(0.05)
        received = await collect(receiver, 11, 2.0)
        assert numbers(received) == [0, 1, 2, 10]
        assert receiver.qos0_dropped == 7
        await receiver.ack(received)
        # Room again once received: the next ones are kept.
        await publish_foreign(topic, range(20, 22))
        assert numbers(await collect(receiver, 2)) == [20, 21]
        assert receiver.qos0_dropped == 7
    finally:
        await receiver.close()


def test_runner_applies_qos0_and_qos1_messages_without_reconnecting(pg_url: str) -> None:
    with psycopg.connect(pg_url) as conn:
        conn.execute(APPLIED_DDL)
    topic, group = fresh_topic(), f"g-{uuid.uuid4().hex[:8]}"

    def applied() -> list[int]:
        with psycopg.connect(pg_url) as conn:
            return sorted(r[0] for r in conn.execute("SELECT n FROM applied").fetchall())

    async def run() -> Consumer:
        consumer = Consumer(
            db=pg_url,
            broker=BROKER,
            group=group,
            handler=record,
            topics=[topic],
            name="qos0",
        )
        task = asyncio.create_task(consumer.run_async())
        try:
            while not consumer.receiver.connected:
                assert not task.done()
                await asyncio.sleep(0.05)
            await publish(topic, range(0, 3))
            await publish_foreign(topic, range(3, 5))
            await publish(topic, range(5, 8))
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 15
            while len(await asyncio.to_thread(applied)) < 8 and loop.time() < deadline:
                await asyncio.sleep(0.1)
            await asyncio.sleep(0.5)  # room for redeliveries, had the connection dropped
        finally:
            consumer.stop()
            await asyncio.wait_for(task, 30)
        return consumer

    consumer = asyncio.run(run())
    assert applied() == list(range(8))
    stats: Any = consumer.stats
    assert (stats.applied, stats.duplicates, stats.broker_errors) == (8, 0, 0)
    assert consumer.receiver.stats.connects == 1
