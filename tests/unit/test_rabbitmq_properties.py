"""The RabbitMQ adapter's own encoding of Basic properties is byte for byte pamqp's."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest

pytest.importorskip("aio_pika")

from aiormq import spec

from outboxer.brokers.rabbitmq import _properties

WHEN = datetime(2026, 11, 21, 9, 30, 15, 123456, tzinfo=UTC)
CASES: list[dict[str, Any]] = [
    {"content_type": "application/json", "delivery_mode": 2, "message_id": "0193-abc",
     "timestamp": WHEN, "headers": {"outboxer-id": "0193-abc", "outboxer-topic": "orders.created",
                                    "outboxer-key": "customer-7", "traceparent": "00-ab-cd-01"}},
    # unsorted names, non-ASCII names and values, an empty value
    {"content_type": "text/plain; charset=utf-8", "delivery_mode": 1, "message_id": "m",
     "timestamp": WHEN, "headers": {"zeta": "ω", "Ärger": "über", "a": "", "M": "x" * 300}},
    # no content type, no timestamp, no headers: pamqp leaves out "" and None
    {"content_type": "", "delivery_mode": 2, "message_id": "m2", "timestamp": None, "headers": {}},
    # a naive datetime is taken as UTC; another zone is converted
    {"content_type": "a/b", "delivery_mode": 2, "message_id": "m3",
     "timestamp": datetime(2026, 1, 1, 12, 0, 0), "headers": {"k": "v"}},
    {"content_type": "a/b", "delivery_mode": 2, "message_id": "m4",
     "timestamp": datetime(2026, 1, 1, 12, 0, 0, tzinfo=timezone(timedelta(hours=5))),
     "headers": {"k": "v"}},
]


@pytest.mark.parametrize("fields", CASES)
def test_encoding_matches_pamqp(fields: dict[str, Any]) -> None:
    ours = _properties(**fields)
    assert ours.wire is not None, "this case takes the fast path"  # type: ignore[attr-defined]
    expected = spec.Basic.Properties(**{**fields, "headers": dict(fields["headers"])}).marshal()
    assert ours.marshal() == expected


@pytest.mark.parametrize("headers", [
    {"n": 5},  # not a string: pamqp's table encoding
    {"x" * 129: "v"},  # pamqp truncates names over 128 bytes
])
def test_other_headers_fall_back_to_pamqp(headers: dict[str, Any]) -> None:
    fields: dict[str, Any] = {"content_type": "a/b", "delivery_mode": 2, "message_id": "m",
                              "timestamp": WHEN, "headers": headers}
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
        "application/json", "0193-abc", 2)
    assert header.timestamp == WHEN.replace(microsecond=0)
