"""Trace context through the outbox: enqueue injects it, the relay's PRODUCER span and a
consumer's CONSUMER span continue it (OpenTelemetry SDK, in-memory exporter)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import uuid
from datetime import UTC, datetime

import pytest
from opentelemetry import baggage, context, trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from outboxer.brokers.base import PUBLISHED, SKIPPED, Outcome, OutcomeKind
from outboxer.message import Message
from outboxer.tracing import (
    consumer_span,
    extract_trace_context,
    inject_trace_context,
    messaging_system,
    start_publish_spans,
)
from tests.otel import BLOCK_OPENTELEMETRY, traceparent_of

tracer = trace.get_tracer("tests")


def stored(headers: dict[str, str] | None, *, key: str | None = "k", attempts: int = 0) -> Message:
    """A message as the relay claims it: headers as enqueue stored them."""
    return Message(
        id=uuid.uuid4(),
        topic="order.placed",
        payload=b'{"id": 1}',
        key=key,
        headers=headers or {},
        destination="internal",
        created_at=datetime.now(UTC),
        attempts=attempts,
        seq=1,
    )


def test_enqueue_headers_get_the_current_span_tracestate_and_baggage(
    exporter: InMemorySpanExporter,
) -> None:
    token = context.attach(baggage.set_baggage("tenant", "acme"))
    try:
        with tracer.start_as_current_span("POST /orders") as request:
            headers = inject_trace_context({"source": "web"})
    finally:
        context.detach(token)
    assert headers is not None
    assert headers["source"] == "web"
    assert headers["traceparent"] == traceparent_of(request)
    assert headers["baggage"] == "tenant=acme"


def test_a_traceparent_the_caller_set_is_kept_whatever_its_case(
    exporter: InMemorySpanExporter,
) -> None:
    mine = {"TraceParent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    with tracer.start_as_current_span("request"):
        assert inject_trace_context(mine) is mine


def test_without_an_active_span_headers_are_returned_untouched() -> None:
    headers = {"a": "b"}
    assert inject_trace_context(headers) is headers
    assert inject_trace_context(None) is None


def test_extract_reads_back_what_inject_wrote(exporter: InMemorySpanExporter) -> None:
    with tracer.start_as_current_span("request") as request:
        headers = inject_trace_context(None)
    assert headers is not None
    # Brokers may hand headers back in another case.
    parent = extract_trace_context({name.upper(): value for name, value in headers.items()})
    assert parent is not None
    extracted = trace.get_current_span(parent).get_span_context()
    assert extracted.trace_id == request.get_span_context().trace_id
    assert extracted.span_id == request.get_span_context().span_id
    assert extract_trace_context({"other": "x"}) is None


def test_the_relay_records_a_producer_span_per_message_in_the_trace_that_enqueued_it(
    exporter: InMemorySpanExporter,
) -> None:
    with tracer.start_as_current_span("request A") as request_a:
        first = stored(dict(inject_trace_context({"x-user": "1"}) or {}))
    with tracer.start_as_current_span("request B") as request_b:
        second = stored(dict(inject_trace_context(None) or {}), key=None, attempts=2)
    untraced = stored({"x-user": "3"})
    exporter.clear()

    spans = start_publish_spans(
        [first, second, untraced], system="rabbitmq", destination_name=lambda m: f"ex/{m.topic}"
    )
    spans.end([PUBLISHED, Outcome(OutcomeKind.FAILED, "TimeoutError: no confirm in 30s"), SKIPPED])

    # One span per traced message: the untraced one gets none.
    producer_a, producer_b = exporter.get_finished_spans()
    for producer, request, message in (
        (producer_a, request_a, first),
        (producer_b, request_b, second),
    ):
        assert producer.kind is SpanKind.PRODUCER
        assert producer.context.trace_id == request.get_span_context().trace_id
        assert producer.parent is not None
        assert producer.parent.span_id == request.get_span_context().span_id
        assert producer.attributes is not None
        assert producer.attributes["messaging.system"] == "rabbitmq"
        assert producer.attributes["messaging.operation.type"] == "send"
        assert producer.attributes["messaging.destination.name"] == "ex/order.placed"
        assert producer.attributes["messaging.message.id"] == str(message.id)
        assert producer.attributes["outboxer.destination"] == "internal"
    assert producer_a.attributes is not None and producer_b.attributes is not None
    assert producer_a.attributes["outboxer.attempt"] == 1
    assert producer_a.attributes["outboxer.key"] == "k"
    assert producer_a.attributes["outboxer.outcome"] == "published"
    assert producer_a.status.status_code is StatusCode.UNSET
    assert producer_b.attributes["outboxer.attempt"] == 3
    assert "outboxer.key" not in producer_b.attributes
    assert producer_b.attributes["error.type"] == "TimeoutError"
    assert producer_b.status.status_code is StatusCode.ERROR

    # What goes to the broker: the producer span's context, the other headers kept.
    out_a, out_b, out_untraced = spans.messages
    assert out_a.headers["traceparent"] == traceparent_of(producer_a)
    assert out_a.headers["x-user"] == "1"
    assert out_b.headers["traceparent"] == traceparent_of(producer_b)
    assert out_untraced is untraced
    # The stored message is not changed.
    assert first.headers["traceparent"] == traceparent_of(request_a)


def test_one_trace_from_the_request_through_the_publish_to_the_consume(
    exporter: InMemorySpanExporter,
) -> None:
    with tracer.start_as_current_span("POST /orders", kind=SpanKind.SERVER):
        message = stored(dict(inject_trace_context(None) or {}))
    publish = start_publish_spans([message], system="kafka", destination_name=lambda m: m.topic)
    publish.end([PUBLISHED])
    delivered = publish.messages[0]

    with (
        pytest.raises(RuntimeError, match="handler broke"),
        consumer_span(delivered, system="kafka", delivery_attempt=1) as consuming,
    ):
        assert consuming is not None
        with tracer.start_as_current_span("INSERT shipments"):
            pass
        raise RuntimeError("handler broke")

    by_name = {span.name: span for span in exporter.get_finished_spans()}
    assert set(by_name) == {
        "POST /orders",
        "send order.placed",
        "process order.placed",
        "INSERT shipments",
    }
    assert len({span.context.trace_id for span in by_name.values()}) == 1

    def parent_of(name: str) -> str:
        parent = by_name[name].parent
        assert parent is not None
        return next(n for n, s in by_name.items() if s.context.span_id == parent.span_id)

    assert parent_of("send order.placed") == "POST /orders"
    assert parent_of("process order.placed") == "send order.placed"
    assert parent_of("INSERT shipments") == "process order.placed"
    process = by_name["process order.placed"]
    assert process.kind is SpanKind.CONSUMER
    assert process.attributes is not None
    assert process.attributes["messaging.operation.type"] == "process"
    assert process.attributes["outboxer.attempt"] == 1
    assert process.status.status_code is StatusCode.ERROR
    assert [event.name for event in process.events] == ["exception"]


def test_messaging_system_names() -> None:
    assert messaging_system("amqps://u:p@h/") == "rabbitmq"
    assert messaging_system("kafka://h:9092") == "kafka"
    assert messaging_system("https://hooks.example/x") == "webhook"
    assert messaging_system("memory://t") == "memory"


_NO_OTEL = textwrap.dedent(
    """
    import sys, uuid

    import outboxer
    from outboxer.message import Message
    from outboxer.tracing import consumer_span, inject_trace_context, start_publish_spans
    from outboxer.brokers.base import PUBLISHED

    headers = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    assert inject_trace_context(headers) is headers
    assert inject_trace_context(None) is None
    message = Message(id=uuid.uuid4(), topic="t", payload=b"", headers=headers, seq=1)
    spans = start_publish_spans([message], system="kafka", destination_name=lambda m: m.topic)
    assert spans.messages == [message]
    spans.end([PUBLISHED])
    with consumer_span(message, system="kafka") as span:
        assert span is None
    loaded = sorted(name for name in sys.modules if name.startswith("opentelemetry"))
    assert not loaded, loaded
    print("ok")
    """
)


@pytest.mark.parametrize("block", [True, False], ids=["otel-absent", "otel-installed-unused"])
def test_tracing_imports_nothing_and_does_nothing_without_opentelemetry_in_use(block: bool) -> None:
    result = subprocess.run(
        [sys.executable, "-c", (BLOCK_OPENTELEMETRY if block else "") + _NO_OTEL],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
