"""MQTT client ids: a relay sharing the consumers' URL, and two clients with one id.

The URL's ``client_id`` is a consumer's stable id (outboxer.receivers.mqtt). A relay given
the same URL connected under that id with Clean Start on: the broker gave it the consumer's
session and wiped it, so what the broker held for the consumer was lost, and the two then
took the connection from each other at every reconnect. A publisher now takes the URL's
``client_id`` as a prefix of an id of its own. (How a collision that still happens is
reported: tests/unit/test_audit16_mqttid_taken_over.py; this Mosquitto, 2.0.11, closes
the old connection without the DISCONNECT that says why.)"""

from __future__ import annotations

import uuid

import pytest

from outboxer.brokers import create_publisher
from outboxer.brokers.mqtt import MqttPublisher
from outboxer.receivers import create_receiver
from outboxer.testing import make_message
from tests.integration.test_receiver_audit_mqtt import collect
from tests.services import require


@pytest.fixture(autouse=True)
def _mosquitto() -> None:
    require("mosquitto")


def shared_url() -> str:
    return f"mqtt://127.0.0.1:1883?session_expiry=60&client_id=a16-{uuid.uuid4().hex[:8]}"


def test_a_publisher_takes_the_url_s_client_id_as_a_prefix() -> None:
    url = shared_url()
    consumer_id = url.rsplit("=", 1)[1]
    first, second = MqttPublisher(url), MqttPublisher(url)
    assert first.client_id.startswith(f"{consumer_id}-")
    assert len({consumer_id, first.client_id, second.client_id}) == 3
    assert MqttPublisher(url, client_id="exact").client_id == "exact"


async def test_a_relay_on_the_consumers_url_leaves_the_consumer_s_session_alone() -> None:
    url, topic = shared_url(), f"a16/{uuid.uuid4().hex[:10]}"
    receiver = create_receiver(url, group=f"g{uuid.uuid4().hex[:8]}", topics=[topic])
    await receiver.connect()  # the session and its subscription exist from here
    await receiver.close()
    try:
        # The consumer is away; the relay, configured with the same URL, publishes.
        async with create_publisher(url) as publisher:
            outcomes = await publisher.publish_batch(
                [make_message(topic, {"n": n}) for n in range(3)]
            )
        assert all(o.published for o in outcomes), outcomes
        received = await collect(receiver, 3, timeout=5.0)
        assert sorted(i.delivery.payload["n"] for i in received) == [0, 1, 2]
        await receiver.ack(received)
    finally:
        await receiver.close()
