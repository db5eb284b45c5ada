"""MqttPublisher against the real Mosquitto on 127.0.0.1:1883: the contract plus MQTT specifics.

Refusals by the broker (ACL, maximum packet size) are tested against a private
Mosquitto that this module starts on a free port with such limits, and stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiomqtt
import pytest

from outboxer.brokers import create_publisher
from outboxer.brokers.base import OutcomeKind, Publisher
from outboxer.brokers.mqtt import MqttPublisher
from outboxer.errors import ConfigError
from outboxer.message import HEADER_ID, HEADER_KEY, HEADER_TOPIC, Message
from outboxer.testing import Consumer, PublisherContract, Received, TcpProxy, make_message
from tests.services import private_mosquitto, require, start, stop

HOST, PORT = "127.0.0.1", 1883
URL = f"mqtt://{HOST}:{PORT}"
PREFIX = f"outboxer-test/{uuid.uuid4().hex[:8]}/"


@pytest.fixture(autouse=True)
def _mosquitto() -> None:
    require("mosquitto")


class TopicConsumer(Consumer):
    """An MQTT v5 subscriber (QoS 1) on one topic, subscribed before ``start()`` returns."""

    def __init__(self, topic: str, port: int = PORT) -> None:
        self.topic = topic
        self.port = port
        self.items: list[aiomqtt.Message] = []
        self.client: aiomqtt.Client | None = None
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> TopicConsumer:
        self.client = aiomqtt.Client(
            HOST,
            self.port,
            protocol=aiomqtt.ProtocolVersion.V5,
            identifier=f"consumer-{uuid.uuid4().hex[:8]}",
        )
        await self.client.__aenter__()
        await self.client.subscribe(self.topic, qos=1)
        self.task = asyncio.create_task(self._collect())
        return self

    async def _collect(self) -> None:
        assert self.client is not None
        async for message in self.client.messages:
            self.items.append(message)

    async def messages(self, count: int, wait: float) -> list[aiomqtt.Message]:
        deadline = time.monotonic() + wait
        while len(self.items) < count and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return list(self.items)

    async def receive(self, count: int, timeout: float = 10.0) -> list[Received]:
        found = []
        for message in await self.messages(count, timeout):
            headers = dict(message.properties.UserProperty)  # type: ignore[union-attr]
            found.append(
                Received(
                    id=headers[HEADER_ID],
                    topic=headers[HEADER_TOPIC],
                    key=headers.get(HEADER_KEY),
                    headers=headers,
                    payload=bytes(message.payload),
                )
            )  # type: ignore[arg-type]
        return found

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, aiomqtt.MqttError):
                await self.task
        if self.client is not None:
            with contextlib.suppress(aiomqtt.MqttError):
                await self.client.__aexit__(None, None, None)


def mosquitto_pid() -> int | None:
    """The machine's broker (its pid_file is set in /etc/mosquitto/mosquitto.conf)."""
    try:
        pid = int(Path("/run/mosquitto/mosquitto.pid").read_text().strip())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return None
    return pid


def stop_mosquitto() -> None:
    stop(mosquitto_pid(), PORT)


class TestMqttPublisherContract(PublisherContract):
    def make_publisher(self) -> Publisher:
        return MqttPublisher(f"{URL}?topic_prefix={PREFIX}")

    def make_unreachable_publisher(self) -> Publisher:
        return MqttPublisher("mqtt://127.0.0.1:1")

    async def start_consumer(self, topic: str) -> Consumer:
        return await TopicConsumer(PREFIX + topic).start()

    def rejected_message(self, topic: str) -> Message:
        return make_message(f"{topic}/#")  # a wildcard is no topic to publish to

    async def restart_server(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(None, stop_mosquitto)
        finally:
            await loop.run_in_executor(None, start, "mosquitto")


# ----- a private Mosquitto with an ACL and a maximum packet size --------------------------------


@pytest.fixture(scope="module")
def strict_broker() -> Iterator[int]:
    """Port of a Mosquitto that lets anonymous clients publish only to ``allowed/#``."""
    with private_mosquitto(
        "max_packet_size 2000\nacl_file {folder}/acl\n",
        {"acl": "topic readwrite allowed/#\n"},
    ) as port:
        yield port


async def test_broker_refusals_are_permanent_and_spare_the_rest(strict_broker: int) -> None:
    consumer = await TopicConsumer("allowed/#", strict_broker).start()
    batch = [
        make_message("allowed/a", {"n": 1}),
        make_message("denied/a", {"n": 2}),  # ACL: PUBACK 0x87 Not authorized
        make_message("allowed/b", b"x" * 3000),  # above the broker's maximum packet size
        make_message("allowed/c", {"n": 4}),
    ]
    async with MqttPublisher(f"mqtt://{HOST}:{strict_broker}") as publisher:
        outcomes = await publisher.publish_batch(batch)
        assert publisher.connected
    got = await consumer.messages(2, 5)
    await consumer.close()
    assert outcomes[0].published and outcomes[3].published
    assert (outcomes[1].kind, outcomes[1].retryable) == (OutcomeKind.FAILED, False)
    assert "0x87" in (outcomes[1].error or "")
    assert (outcomes[2].kind, outcomes[2].retryable) == (OutcomeKind.FAILED, False)
    assert "maximum packet size" in (outcomes[2].error or "")
    assert sorted(m.topic.value for m in got) == ["allowed/a", "allowed/c"]


async def test_inflight_window_follows_the_brokers_receive_maximum(strict_broker: int) -> None:
    async with MqttPublisher(f"mqtt://{HOST}:{strict_broker}", max_inflight=500) as publisher:
        client: Any = publisher._client
        assert client.receive_maximum == 20  # Mosquitto's default
        assert client._client._max_inflight_messages == 20
        outcomes = await publisher.publish_batch([make_message("allowed/w") for _ in range(200)])
    assert all(o.published for o in outcomes)


# ----- MQTT specifics on the machine's broker ---------------------------------------------------


async def test_envelope_travels_as_v5_properties() -> None:
    topic = f"props.{uuid.uuid4().hex[:8]}"
    consumer = await TopicConsumer(PREFIX + topic).start()
    message = make_message(topic, {"a": 1}, key="order-1", headers={"trace": "t-1", "ü": "✓"})
    async with MqttPublisher(URL, topic_prefix=PREFIX) as publisher:
        assert (await publisher.publish_batch([message]))[0].published
    [got] = await consumer.messages(1, 5)
    await consumer.close()
    assert got.topic.value == PREFIX + topic
    assert got.payload == b'{"a":1}'
    assert got.qos == 1 and not got.retain
    assert got.properties.ContentType == "application/json"  # type: ignore[union-attr]
    assert got.properties.CorrelationData == str(message.id).encode()  # type: ignore[union-attr]
    assert dict(got.properties.UserProperty) == {  # type: ignore[union-attr]
        HEADER_ID: str(message.id),
        HEADER_TOPIC: topic,
        HEADER_KEY: "order-1",
        "content-type": "application/json",
        "trace": "t-1",
        "ü": "✓",
    }


async def test_retain_option_keeps_the_last_message_for_late_subscribers() -> None:
    topic = f"retained/{uuid.uuid4().hex[:8]}"
    message = make_message(topic, "last")
    try:
        async with create_publisher(f"{URL}?retain=true") as publisher:
            assert (await publisher.publish_batch([message]))[0].published
        consumer = await TopicConsumer(topic).start()  # subscribes after the publish
        [got] = await consumer.receive(1, 5)
        await consumer.close()
        assert got.id == str(message.id)
    finally:  # an empty retained message clears it
        async with aiomqtt.Client(HOST, PORT) as client:
            await client.publish(topic, b"", qos=1, retain=True)


async def test_wave_keeps_many_publishes_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    from outboxer.brokers import mqtt

    sent_before_first_ack: list[int] = []
    sends = 0
    original_send, original_ack = mqtt._Client.send, mqtt._Client._on_publish

    def counting_send(self: Any, *args: Any) -> Any:
        nonlocal sends
        sends += 1
        return original_send(self, *args)

    def counting_ack(self: Any, *args: Any) -> None:
        if not sent_before_first_ack:
            sent_before_first_ack.append(sends)
        original_ack(self, *args)

    monkeypatch.setattr(mqtt._Client, "send", counting_send)
    monkeypatch.setattr(mqtt._Client, "_on_publish", counting_ack)
    topic = f"many.{uuid.uuid4().hex[:8]}"
    batch = [make_message(topic, {"n": n}, key=f"k{n % 100}") for n in range(300)]
    async with MqttPublisher(URL, topic_prefix=PREFIX) as publisher:
        outcomes = await publisher.publish_batch(batch)
    assert all(o.published for o in outcomes)
    assert sent_before_first_ack == [100]  # the whole first wave was handed over before any PUBACK


async def test_connection_lost_mid_wave_fails_fast() -> None:
    proxy = await TcpProxy(HOST, PORT).start()
    publisher = MqttPublisher(f"mqtt://{HOST}:{proxy.port}", publish_timeout=30)
    try:
        await publisher.connect()
        client: Any = publisher._client
        # Hold PUBACKs back: the wave stays unconfirmed until the connection is cut.
        client._on_publish = lambda *args: None
        client._client.on_publish = client._on_publish

        async def cut_later() -> float:
            await asyncio.sleep(0.3)
            await proxy.cut()
            return time.monotonic()

        outcomes, cut_at = await asyncio.wait_for(
            asyncio.gather(
                publisher.publish_batch([make_message(f"{PREFIX}lost") for _ in range(5)]),
                cut_later(),
            ),
            10,
        )
        assert time.monotonic() - cut_at < 5
        assert all(o.kind is OutcomeKind.FAILED and o.retryable for o in outcomes), outcomes
        assert not publisher.connected
        await proxy.restore()
        await publisher.connect()
        assert (await publisher.publish_batch([make_message(f"{PREFIX}after")]))[0].published
    finally:
        await publisher.close()
        await proxy.stop()


def test_options() -> None:
    publisher = MqttPublisher(
        "mqtts://user:secret@broker.example?topic_prefix=app/&retain=yes"
        "&client_id=relay-1&keepalive=30&max_inflight=50"
    )
    assert (publisher.hostname, publisher.port, publisher.tls) == ("broker.example", 8883, True)
    assert (publisher.username, publisher.password) == ("user", "secret")
    assert (publisher.topic_prefix, publisher.retain) == ("app/", True)
    # The URL's client_id is a prefix: every relay replica shares the URL.
    assert publisher.client_id.startswith("relay-1-")
    assert (publisher.keepalive, publisher.max_inflight) == (30, 50)
    assert publisher.topic_for(make_message("orders")) == "app/orders"
    assert "secret" not in publisher.safe_url
    keyword = MqttPublisher(f"{URL}?retain=true&max_inflight=50", retain=False, max_inflight=7)
    assert (keyword.retain, keyword.max_inflight, keyword.port) == (False, 7, 1883)
    assert MqttPublisher(URL).client_id.startswith("outboxer-")
    with pytest.raises(ConfigError, match="retain"):
        MqttPublisher(f"{URL}?retain=sometimes")
    # The same yes/no words as every other option (outboxer.options.parse_bool).
    assert MqttPublisher(f"{URL}?retain=on").retain is True
    assert MqttPublisher(f"{URL}?retain=OFF").retain is False
    with pytest.raises(ConfigError, match="max_inflight"):
        MqttPublisher(f"{URL}?max_inflight=many")
    with pytest.raises(ConfigError, match="mqtt option keepalive"):
        MqttPublisher(URL, keepalive=0)
