"""A PUBLISH over Mosquitto's ``message_size_limit`` fails alone, as a final refusal.

Mosquitto does not advertise that limit (no Maximum Packet Size in the CONNACK, so the
publisher cannot check it before sending) and answers such a PUBLISH with a PUBACK of
reason code 0x95, which MQTT 5 does not list for a PUBACK. paho took it for a malformed
packet and dropped the connection: every message of the wave failed as "connection lost"
(retryable), and the oversized one did it again at every retry. Runs a private Mosquitto.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.reasoncodes import ReasonCode

from outboxer.brokers.base import OutcomeKind
from outboxer.brokers.mqtt import MqttPublisher
from outboxer.testing import make_message
from tests.services import private_mosquitto

HOST = "127.0.0.1"


@pytest.fixture
def limited_broker() -> Iterator[int]:
    with private_mosquitto("message_size_limit 1000\n") as port:
        yield port


async def test_a_message_over_message_size_limit_fails_alone(limited_broker: int) -> None:
    batch = [
        make_message("sized/a", {"n": 1}),
        make_message("sized/b", b"x" * 3000),
        make_message("sized/c", {"n": 3}),
    ]
    publisher = MqttPublisher(f"mqtt://{HOST}:{limited_broker}")
    async with publisher:
        assert publisher._client is not None and publisher._client.maximum_packet_size is None
        outcomes = await publisher.publish_batch(batch)
        assert publisher.connected
        again = await publisher.publish_batch([make_message("sized/d")])
    assert outcomes[0].published and outcomes[2].published and again[0].published
    assert (outcomes[1].kind, outcomes[1].retryable) == (OutcomeKind.FAILED, False)
    assert "0x95" in (outcomes[1].error or "")


@pytest.mark.parametrize(("code", "retryable"), [(0x95, False), (0x89, True), (0x96, True)])
def test_a_failure_code_mqtt_lists_for_no_puback_is_that_message_s_refusal(
    code: int, retryable: bool
) -> None:
    reason = ReasonCode(PacketTypes.PUBACK)
    reason.unpack(bytes([code]))
    refusal = MqttPublisher("mqtt://127.0.0.1")._refusal("t", reason)
    assert refusal.retryable is retryable and f"0x{code:02x}" in str(refusal)
