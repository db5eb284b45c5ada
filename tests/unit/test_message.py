from __future__ import annotations

import json
import uuid

import pytest

from outboxer import Message, PayloadError, uuid7
from outboxer.message import coerce_message_id, encode_payload, validate_envelope


def test_payload_kinds_and_content_types() -> None:
    assert encode_payload({"a": [1, "é"]}) == (
        json.dumps({"a": [1, "é"]}, separators=(",", ":"), ensure_ascii=False).encode(),
        "application/json",
    )
    assert encode_payload([1, 2]) == (b"[1,2]", "application/json")
    assert encode_payload("hi") == (b"hi", "text/plain; charset=utf-8")
    assert encode_payload(b"\x00") == (b"\x00", "application/octet-stream")
    assert encode_payload(bytearray(b"ab"), "application/x-protobuf") == (
        b"ab",
        "application/x-protobuf",
    )


@pytest.mark.parametrize("payload", [12, None, 1.5, {"x": {1, 2}}, {"nan": float("inf")}, object()])
def test_unencodable_payloads_raise_payload_error(payload: object) -> None:
    with pytest.raises(PayloadError):
        encode_payload(payload)


@pytest.mark.parametrize(
    ("topic", "key", "headers"),
    [
        ("", None, None),
        (7, None, None),
        ("t" * 256, None, None),
        ("t", "", None),
        ("t", "k" * 256, None),
        ("t", None, []),
        ("t", None, {"a": 1}),
        ("t", None, {"": "x"}),
    ],
)
def test_bad_envelopes_raise_payload_error(topic: object, key: object, headers: object) -> None:
    with pytest.raises(PayloadError):
        validate_envelope(topic, key, headers)


def test_uuid7_is_version_7_and_strictly_increasing() -> None:
    ids = [uuid7() for _ in range(5000)]
    assert all(i.version == 7 and i.variant == uuid.RFC_4122 for i in ids)
    assert ids == sorted(ids, key=lambda u: u.int) and len(set(ids)) == len(ids)


def test_message_ids_accept_uuid_or_text() -> None:
    fixed = uuid.uuid4()
    assert coerce_message_id(fixed) is fixed
    assert coerce_message_id(str(fixed)) == fixed
    assert coerce_message_id(None).version == 7
    with pytest.raises(PayloadError):
        coerce_message_id(42)


def test_envelope_headers_carry_id_topic_key_and_user_headers() -> None:
    message = Message(id=uuid7(), topic="t", payload=b"{}", key="k", headers={"trace": "1"})
    headers = message.envelope_headers()
    assert headers["outboxer-id"] == str(message.id)
    assert (headers["outboxer-topic"], headers["outboxer-key"], headers["trace"]) == ("t", "k", "1")
    with pytest.raises(ValueError, match="no seq"):
        _ = message.stored_seq
