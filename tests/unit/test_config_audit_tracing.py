"""Trace headers a consumer's broker hands over are hostile input: odd types, huge values.

(In tests/unit with the config audit's prefix: tracing is part of the settings, logs,
metrics and tracing area.)
"""

from __future__ import annotations

import logging
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from outboxer.brokers.base import PUBLISHED, Outcome, OutcomeKind
from outboxer.message import Message
from outboxer.tracing import consumer_span, extract_trace_context, start_publish_spans

TRACE_ID = 0x0AF7651916CD43DD8448EB211C80319C
TRACEPARENT = f"00-{TRACE_ID:032x}-b7ad6b7169203331-01"


def received(headers: dict[str, Any]) -> Message:
    """A message as an application builds it from its broker's delivery (AMQP, Kafka and
    MQTT libraries give header values as bytes, ints or lists)."""
    return Message(
        id=uuid.uuid4(),
        topic="order.placed",
        payload=b"{}",
        headers=headers,
        created_at=datetime.now(UTC),
    )


@pytest.mark.parametrize(
    "headers",
    [
        {"traceparent": TRACEPARENT.encode()},
        {"traceparent": 5},
        {"traceparent": TRACEPARENT, "tracestate": 7},
        {"traceparent": TRACEPARENT, "baggage": b"k=v"},
    ],
    ids=["bytes-traceparent", "int-traceparent", "int-tracestate", "bytes-baggage"],
)
def test_a_consumer_span_survives_header_values_that_are_no_text(
    exporter: InMemorySpanExporter, headers: dict[str, Any]
) -> None:
    exporter.clear()
    handled = False
    with consumer_span(received(headers), system="rabbitmq") as span:
        handled = True
    assert handled and span is not None
    (finished,) = exporter.get_finished_spans()
    assert finished.kind is trace.SpanKind.CONSUMER
    # A text traceparent is still followed when only another header is unreadable.
    if isinstance(headers["traceparent"], str):
        assert finished.context is not None and finished.context.trace_id == TRACE_ID


def test_extract_ignores_what_is_no_text_and_keeps_the_rest() -> None:
    context = extract_trace_context({"traceparent": TRACEPARENT, "tracestate": 7})
    assert context is not None
    assert trace.get_current_span(context).get_span_context().trace_id == TRACE_ID
    assert extract_trace_context({"traceparent": TRACEPARENT.encode()}) is None  # type: ignore[dict-item]


@pytest.mark.parametrize("header", ["baggage", "tracestate"])
def test_a_huge_propagation_header_is_dropped_not_logged_nor_sent_on(
    exporter: InMemorySpanExporter, caplog: pytest.LogCaptureFixture, header: str
) -> None:
    """A 200 kB baggage made OpenTelemetry log it whole, at every publish attempt."""
    exporter.clear()
    huge = "k=" + "v" * 200_000 if header == "baggage" else "a=b," * 50_000 + "c=d"
    message = received({"traceparent": TRACEPARENT, header: huge})
    with caplog.at_level(logging.DEBUG):
        assert extract_trace_context(message.headers) is not None
        spans = start_publish_spans(
            [message], system="rabbitmq", destination_name=lambda m: m.topic
        )
        spans.end([PUBLISHED])
    assert max((len(record.getMessage()) for record in caplog.records), default=0) < 1000
    (sent,) = spans.messages
    assert all(len(value) < 1000 for value in sent.headers.values())
    assert (
        trace.get_current_span(extract_trace_context(sent.headers)).get_span_context().trace_id
        == TRACE_ID
    )


def test_span_errors_are_redacted_as_log_lines_are(exporter: InMemorySpanExporter) -> None:
    """A driver's error text may hold its URL with the password: the log line masks it,
    the span (exported to a tracing backend) carried it as it was."""
    exporter.clear()
    error = "ConnectionError: cannot reach amqp://app:span-secret-pw-1@mq:5672/ (refused)"
    message = received({"traceparent": TRACEPARENT})
    spans = start_publish_spans([message], system="rabbitmq", destination_name=lambda m: m.topic)
    spans.end([Outcome(OutcomeKind.FAILED, error)])
    with (
        pytest.raises(RuntimeError),
        consumer_span(message, system="rabbitmq"),
    ):
        raise RuntimeError("handler lost amqp://app:span-secret-pw-2@mq/ on the way")
    producer, consumer = exporter.get_finished_spans()
    for span in (producer, consumer):
        assert span.status.status_code is StatusCode.ERROR
        exported = [span.status.description or "", *map(str, span.attributes.values())]
        exported += [str(v) for event in span.events for v in event.attributes.values()]
        assert not [text for text in exported if "span-secret-pw" in text], exported
    assert "mq:5672" in (producer.status.description or "")
    (event,) = consumer.events
    assert event.name == "exception" and "handler lost" in str(
        event.attributes["exception.message"]
    )
