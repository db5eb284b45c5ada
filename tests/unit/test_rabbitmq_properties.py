"""The RabbitMQ adapter's own encoding of Basic properties is byte for byte pamqp's, and
when it writes whole waves."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("aio_pika")

from aiormq import spec

from outboxer.brokers.rabbitmq import _WAVE_ATTRIBUTES, _properties, wave_writes_unsupported

WHEN = datetime(2026, 11, 21, 9, 30, 15, 123456, tzinfo=UTC)
CASES: list[dict[str, Any]] = [
    {
        "content_type": "application/json",
        "delivery_mode": 2,
        "message_id": "0193-abc",
        "timestamp": WHEN,
        "headers": {
            "outboxer-id": "0193-abc",
            "outboxer-topic": "orders.created",
            "outboxer-key": "customer-7",
            "traceparent": "00-ab-cd-01",
        },
    },
    # unsorted names, non-ASCII names and values, an empty value
    {
        "content_type": "text/plain; charset=utf-8",
        "delivery_mode": 1,
        "message_id": "m",
        "timestamp": WHEN,
        "headers": {"zeta": "ω", "Ärger": "über", "a": "", "M": "x" * 300},
    },
    # no content type, no timestamp, no headers: pamqp leaves out "" and None
    {"content_type": "", "delivery_mode": 2, "message_id": "m2", "timestamp": None, "headers": {}},
    # a naive datetime is taken as UTC; another zone is converted
    {
        "content_type": "a/b",
        "delivery_mode": 2,
        "message_id": "m3",
        "timestamp": datetime(2026, 1, 1, 12, 0, 0),
        "headers": {"k": "v"},
    },
    {
        "content_type": "a/b",
        "delivery_mode": 2,
        "message_id": "m4",
        "timestamp": datetime(2026, 1, 1, 12, 0, 0, tzinfo=timezone(timedelta(hours=5))),
        "headers": {"k": "v"},
    },
]


@pytest.mark.parametrize("fields", CASES)
def test_encoding_matches_pamqp(fields: dict[str, Any]) -> None:
    ours = _properties(**fields)
    assert ours.wire is not None, "this case takes the fast path"  # type: ignore[attr-defined]
    expected = spec.Basic.Properties(**{**fields, "headers": dict(fields["headers"])}).marshal()
    assert ours.marshal() == expected


@pytest.mark.parametrize(
    "headers",
    [
        {"n": 5},  # not a string: pamqp's table encoding
        {"x" * 129: "v"},  # pamqp truncates names over 128 bytes
    ],
)
def test_other_headers_fall_back_to_pamqp(headers: dict[str, Any]) -> None:
    fields: dict[str, Any] = {
        "content_type": "a/b",
        "delivery_mode": 2,
        "message_id": "m",
        "timestamp": WHEN,
        "headers": headers,
    }
    ours = _properties(**fields)
    assert ours.wire is None  # type: ignore[attr-defined]
    assert ours.marshal() == spec.Basic.Properties(**fields).marshal()


def test_the_properties_read_back_as_given() -> None:
    fields = CASES[0]
    ours = _properties(**fields)
    header = spec.Basic.Properties()
    flags = int.from_bytes(ours.marshal()[:2], "big")
    header.unmarshal(flags, ours.marshal()[2:])
    assert header.headers == fields["headers"]
    assert (header.content_type, header.message_id, header.delivery_mode) == (
        "application/json",
        "0193-abc",
        2,
    )
    assert header.timestamp == WHEN.replace(microsecond=0)


def _publish(exchange: str, routing_key: str, body: bytes, message_id: str) -> Any:
    from outboxer.brokers.rabbitmq import _Publish

    return _Publish(
        exchange,
        routing_key,
        body,
        _properties(
            content_type="application/json",
            delivery_mode=2,
            message_id=message_id,
            timestamp=WHEN,
            headers={"outboxer-id": message_id, "traceparent": "00-ab-cd-01"},
        ),
    )


@pytest.mark.parametrize("mandatory", [True, False])
def test_wave_frames_are_pamqps_frames_back_to_back(mandatory: bool) -> None:
    """What a wave writes in one go is, byte for byte, what aiormq's basic_publish writes for
    each message in turn: method frame, content header, body split at the channel's
    max_content_size (frame_max - 8), no body frame for an empty body."""
    import pamqp.frame
    from pamqp.body import ContentBody
    from pamqp.header import ContentHeader

    from outboxer.brokers.rabbitmq import _wave_frames

    max_content_size = 1000
    publishes = [
        _publish("outboxer", "orders.created", b'{"n": 1}', "a"),
        _publish("", "some-queue", b"x" * 2500, "b"),  # three body frames
        _publish("other", "k", b"", "c"),  # none
        _publish("outboxer", "r", b"y" * 1000, "d"),
    ]  # exactly one frame's worth
    expected = b""
    for publish in publishes:
        frames: list[Any] = [
            spec.Basic.Publish(
                exchange=publish.exchange, routing_key=publish.routing_key, mandatory=mandatory
            ),
            ContentHeader(body_size=len(publish.body), properties=publish.properties),
            *(
                ContentBody(publish.body[i : i + max_content_size])
                for i in range(0, len(publish.body), max_content_size)
            ),
        ]
        expected += b"".join(pamqp.frame.marshal(frame, 7) for frame in frames)
    assert _wave_frames(7, max_content_size, publishes, mandatory) == expected


def test_wave_frames_reject_what_pamqp_rejects() -> None:
    from outboxer.brokers.rabbitmq import _wave_frames

    with pytest.raises(ValueError):
        _wave_frames(1, 1000, [_publish("bad exchange name!", "k", b"", "a")], True)


def test_wave_writes_need_a_verified_aiormq_and_its_channel_state() -> None:
    channel = SimpleNamespace(**dict.fromkeys(_WAVE_ATTRIBUTES))
    for inside in ("7.2.2", "7.2.4", "7.9.0rc1", "7.2.2.post1"):
        assert wave_writes_unsupported(channel, inside) is None, inside
    # 7.2.0 and 7.2.1 free a closed channel's number under the channel that reused it.
    for outside in ("7.2.1", "7.1.6", "8.0.0", "8.0rc1", "6.9.4", "unknown"):
        reason = wave_writes_unsupported(channel, outside)
        assert reason is not None and f"aiormq {outside} is outside" in reason, reason
        assert "(>=7.2.2,<8.0.0)" in reason
    del channel.write_queue, channel.lock
    assert (
        wave_writes_unsupported(channel, "7.2.4")
        == "aiormq 7.2.4's channel lacks lock, write_queue"
    )
