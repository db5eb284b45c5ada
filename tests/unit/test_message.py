from __future__ import annotations

import json
import uuid

import pytest

from outboxer import ConfigError, Message, Outbox, PayloadError, uuid7
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


# ----- text no database stores, and sizes --------------------------------------------------


@pytest.mark.parametrize(
    ("topic", "key", "headers", "fragment"),
    [
        ("order\x00placed", None, None, "the topic contains a NUL"),
        ("order\ud800", None, None, "the topic contains a lone surrogate '\\ud800' at index 5"),
        ("t", "k\x00", None, "the key contains a NUL"),
        ("t", "\udfffk", None, "the key contains a lone surrogate"),
        ("t", None, {"trace\x00": "1"}, "the header name 'trace\\x00' contains a NUL"),
        ("t", None, {"trace": "a\x00b"}, "the value of header 'trace' contains a NUL"),
        ("t", None, {"trace": "\udc80"}, "the value of header 'trace' contains a lone surrogate"),
        ("t", None, {"\ud800": "1"}, "contains a lone surrogate"),
    ],
)
def test_nul_and_lone_surrogates_in_the_envelope_are_refused(
    topic: str, key: str | None, headers: dict[str, str] | None, fragment: str
) -> None:
    with pytest.raises(PayloadError) as raised:
        validate_envelope(topic, key, headers)
    assert fragment in str(raised.value)


@pytest.mark.parametrize(
    ("payload", "fragment"),
    [
        ("caf\x00e", "a text payload contains a NUL character (\\x00); send bytes"),
        ("caf\udce9", "a text payload contains a lone surrogate '\\udce9' at index 3"),
        ({"name": "caf\udce9"}, "a string in the payload contains a lone surrogate '\\udce9'"),
        ({"\ud800": 1}, "lone surrogate"),
        (["\udbff"], "lone surrogate"),
    ],
)
def test_text_payloads_that_are_not_unicode_text_are_refused(
    payload: object, fragment: str
) -> None:
    with pytest.raises(PayloadError) as raised:
        encode_payload(payload)
    assert fragment in str(raised.value)


def test_a_nul_inside_a_json_string_is_escaped_and_kept() -> None:
    body, _ = encode_payload({"text": "a\x00b"})
    assert body == b'{"text":"a\\u0000b"}'
    assert json.loads(body) == {"text": "a\x00b"}


def test_json_too_deep_to_encode_is_a_payload_error() -> None:
    deep: list[object] = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(PayloadError, match="not JSON-serializable"):
        encode_payload(deep)


@pytest.mark.parametrize(
    "content_type", ["", "text/plain\r\nX-Injected: 1", "caf\u00e9/x", "a" * 256, 5, b"text/plain"]
)
def test_content_types_must_be_printable_ascii(content_type: object) -> None:
    with pytest.raises(PayloadError, match="content_type must be None or a media type"):
        encode_payload("x", content_type)  # type: ignore[arg-type]


def test_max_bytes_counts_the_encoded_payload() -> None:
    assert encode_payload(b"x" * 10, max_bytes=10) == (b"x" * 10, "application/octet-stream")
    with pytest.raises(PayloadError, match=r"is 12 bytes encoded, over max_payload_bytes=10"):
        encode_payload("é" * 6, max_bytes=10)  # six characters, twelve bytes of UTF-8
    with pytest.raises(PayloadError, match="is 11 bytes"):
        encode_payload({"a": "123"}, max_bytes=10)  # {"a":"123"}
    assert encode_payload({"a": "12"}, max_bytes=10)[0] == b'{"a":"12"}'


@pytest.mark.parametrize("limit", [0, -1, True, 1.5, "1024"])
def test_max_payload_bytes_must_be_a_positive_whole_number(limit: object) -> None:
    with pytest.raises(ConfigError, match="max_payload_bytes must be None or a whole number"):
        Outbox(max_payload_bytes=limit)  # type: ignore[arg-type]


def test_outbox_refuses_a_payload_over_its_limit_before_building_anything() -> None:
    outbox = Outbox(max_payload_bytes=16)
    assert [m.payload for m in outbox.build("t", b"x" * 16)] == [b"x" * 16]
    with pytest.raises(PayloadError, match="over max_payload_bytes=16"):
        outbox.build("t", b"x" * 17)


@pytest.mark.parametrize(
    "destinations", ["partner", [], ["ok", ""], ["a\x00"], ["\ud800"], ["d" * 256], [1]]
)
def test_destination_names_are_checked(destinations: object) -> None:
    with pytest.raises(ConfigError, match="destination"):
        Outbox(destinations=destinations)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="destination"):
        Outbox().build("t", {}, destinations=destinations)  # type: ignore[arg-type]


def test_destinations_may_be_any_iterable_of_names() -> None:
    outbox = Outbox(destinations=["a", "b"])  # type: ignore[arg-type]
    assert outbox.destinations == ("a", "b")
    built = outbox.build("t", {}, destinations=(name for name in ("x", "y")))
    assert [m.destination for m in built] == ["x", "y"]
