"""A consumer's MQTT session the broker no longer has when the consumer reconnects.

The consumer connects with Clean Start off under a stable client id so that the broker
keeps what it holds for it while the connection is down. When the broker kept nothing (the
session expired, or a Mosquitto with ``persistence false``, its default, restarted), the
messages it held were dropped without a word: the relay had its PUBACKs, and the consumer
reconnected and subscribed again as if nothing happened. The CONNACK's Session Present
flag says so; a reconnect without it is now a warning and counted (``sessions_lost``).
A private Mosquitto.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Iterator

import pytest

from outboxer.brokers.mqtt import MqttPublisher
from outboxer.receivers.mqtt import MqttReceiver
from outboxer.testing import make_message
from tests.services import private_mosquitto

HOST = "127.0.0.1"
pytestmark = pytest.mark.timeout(30)


@pytest.fixture(scope="module")
def broker() -> Iterator[int]:
    with private_mosquitto("") as port:
        yield port


async def test_a_reconnect_that_finds_no_session_is_reported(
    broker: int, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "outboxer.receiver")
    url = f"mqtt://{HOST}:{broker}"
    group = f"g{uuid.uuid4().hex[:8]}"
    receiver = MqttReceiver(
        url, group=group, topics=["lost/#"], name="n1", session_expiry=1, connect_timeout=5
    )
    await receiver.connect()
    await receiver.close()  # the session (and its subscription) stays for a second
    async with MqttPublisher(url) as publisher:
        outcomes = await publisher.publish_batch([make_message("lost/a", {"n": 1})])
    assert outcomes[0].published  # held in the consumer's session ...
    await asyncio.sleep(2.5)  # ... which expires
    await receiver.connect()
    try:
        assert await receiver.receive(10, 0.5) == []  # the broker dropped it
        assert receiver.sessions_lost == 1
        assert "kept no session" in caplog.text and group in caplog.text
    finally:
        await receiver.close()


async def test_a_reconnect_that_resumes_its_session_is_quiet(
    broker: int, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "outboxer.receiver")
    url = f"mqtt://{HOST}:{broker}"
    receiver = MqttReceiver(
        url, group=f"g{uuid.uuid4().hex[:8]}", topics=["kept/#"], name="n1", connect_timeout=5
    )
    await receiver.connect()
    await receiver.close()
    message = make_message("kept/a", {"n": 1})
    async with MqttPublisher(url) as publisher:
        assert (await publisher.publish_batch([message]))[0].published
    await receiver.connect()
    try:
        got = await receiver.receive(10, 3)
        assert [incoming.delivery.id for incoming in got] == [message.id]
        await receiver.ack(got)
        assert receiver.sessions_lost == 0
        assert "kept no session" not in caplog.text
    finally:
        await receiver.close()
