"""A user header named ``content-type``: the envelope's content type travels under that
name (Kafka, NATS, MQTT, AMQP headers; HTTP folds case), so the user's value was replaced
by it on the way and dropped from the delivery as envelope. Enqueue refuses it instead."""

from __future__ import annotations

import pytest

from outboxer import Outbox, PayloadError


@pytest.mark.parametrize("name", ["content-type", "Content-Type", "CONTENT-TYPE"])
def test_a_content_type_header_is_refused_at_enqueue(name: str) -> None:
    with pytest.raises(PayloadError, match=r"reserved.*content_type argument"):
        Outbox().build("t", {"a": 1}, headers={name: "application/x-mine"})


def test_other_headers_are_still_accepted() -> None:
    [message] = Outbox().build("t", {"a": 1}, headers={"content-language": "fr", "x-type": "a"})
    assert dict(message.headers) == {"content-language": "fr", "x-type": "a"}


def test_a_header_name_over_128_bytes_is_refused_at_enqueue() -> None:
    """AMQP's field-table keys hold 128 bytes: such a message was accepted, then failed
    for good at publish ("longer than an AMQP field table's 128 bytes")."""
    Outbox().build("t", {"a": 1}, headers={"n" * 128: "v", "é" * 64: "v"})  # 128 bytes
    for name in ("n" * 129, "é" * 65):
        with pytest.raises(PayloadError, match="over 128"):
            Outbox().build("t", {"a": 1}, headers={name: "v"})
