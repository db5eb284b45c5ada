"""An MQTT consumer's group and topics, checked when the consumer is built, on the real
Mosquitto.

The group is the shared subscription's name, ``$share/<group>/<filter>``, where MQTT 5
allows no ``/``, ``+`` or ``#``. Before, a group ``orders/eu`` subscribed ``$share/orders``
to the filter ``eu/<topic>``: the consumer ran and received nothing of its topic; a group
or a topic filter with a misplaced ``+`` or ``#`` made aiomqtt refuse the subscription,
which the consumer took for a broker outage and retried for ever.
"""

from __future__ import annotations

import uuid

import pytest

from outboxer.brokers import create_publisher
from outboxer.errors import ConfigError
from outboxer.receivers import create_receiver
from outboxer.testing import make_message
from tests.services import require

MQTT = "mqtt://127.0.0.1:1883?session_expiry=60"


@pytest.mark.parametrize(
    ("group", "topics"),
    [("orders/eu", ["t"]), ("orders+", ["t"]), ("orders#", ["t"]), ("g", ["a/#/b"]), ("g", ["a+"])],
)
def test_a_group_or_topic_mqtt_cannot_subscribe_is_a_configuration_error(
    group: str, topics: list[str]
) -> None:
    with pytest.raises(ConfigError, match="MQTT"):
        create_receiver(MQTT, group=group, topics=topics, name="n")


async def test_a_valid_group_and_filter_still_receive() -> None:
    require("mosquitto")
    tag = uuid.uuid4().hex[:8]
    receiver = create_receiver(MQTT, group=f"g-{tag}", topics=[f"t{tag}/+"], name="n")
    publisher = create_publisher("mqtt://127.0.0.1:1883")
    await receiver.connect()
    try:
        await publisher.connect()
        message = make_message(f"t{tag}/x", {"n": 1})
        await publisher.publish_batch([message])
        received = []
        for _ in range(20):  # up to 10 s; the first arrival ends the wait
            received += await receiver.receive(10, 0.5)
            if received:
                break
        assert [incoming.delivery.id for incoming in received] == [message.id]
        await receiver.ack(received)
    finally:
        await publisher.close()
        await receiver.close()
