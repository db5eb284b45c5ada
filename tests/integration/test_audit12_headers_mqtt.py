"""User headers and keys over MQTT v5 User Properties, as enqueue accepted them. Mosquitto
closes the connection on a PUBLISH whose strings hold a control character or a
non-character: a header value with a tab or a line break failed its whole wave, and itself
again at every retry, for ever. Each must arrive byte-identical instead."""

from __future__ import annotations

import uuid

from outboxer.brokers import create_publisher
from outboxer.receivers import create_receiver
from outboxer.testing import make_message
from tests.headers import accepted_messages, assert_delivered_unchanged
from tests.services import require

MQTT = "mqtt://127.0.0.1:1883"

CASES: list[tuple[dict[str, str], str | None]] = [
    ({"note": "a\r\nb"}, None),
    ({"tabbed": "\tx\t"}, None),
    ({"c1": "a\x85b", "del": "\x7f"}, None),
    ({"nonchar": "a\ufffeb\U0001ffff"}, None),
    ({"name\twith tab": "v"}, None),
    ({"percent": "100%25 done", "plain": "zürich ✓"}, None),
    ({}, "key\twith tab"),
]


async def test_hostile_headers_and_keys_arrive_as_enqueued() -> None:
    require("mosquitto")
    tag = uuid.uuid4().hex[:8]
    topic = f"t{tag}/x"
    receiver = create_receiver(MQTT, group=f"g-{tag}", topics=[topic], name="n")
    publisher = create_publisher(MQTT)
    messages = accepted_messages(topic, CASES)
    try:
        await receiver.connect()
        await assert_delivered_unchanged(publisher, receiver, messages)
    finally:
        await receiver.close()


def test_a_plain_header_still_travels_as_it_is() -> None:
    from outboxer.brokers.mqtt import publish_properties

    message = make_message("t", {"n": 1}, key="k", headers={"trace": "abc", "X-Tenant": "é"})
    sent = dict(publish_properties(message).UserProperty)
    assert sent["trace"] == "abc" and sent["X-Tenant"] == "é" and sent["outboxer-key"] == "k"
