"""OpenTelemetry tracing: one trace from the request that enqueued, through the relay's
publish, to the consumer that applies the message.

``inject_trace_context`` puts the current context (W3C ``traceparent``, ``tracestate``,
``baggage``) into a message's headers at ``enqueue`` time, so it is stored with the row.
The relay opens a PRODUCER span per message in that trace (``start_publish_spans``) and
sends the producer span's own context in the published headers; a consumer continues it
with a CONSUMER span (``consumer_span``). Attributes follow OpenTelemetry's messaging
semantic conventions: ``messaging.system``, ``messaging.destination.name``,
``messaging.message.id``, ``messaging.operation.type``; outboxer adds ``outboxer.attempt``,
``outboxer.destination`` and ``outboxer.key``.

DESIGN: nothing here imports OpenTelemetry unless the application already has. A span can be
active, and a tracer provider configured, only in a process that imported
``opentelemetry.trace``; so every function first looks that module up in ``sys.modules`` (a
dictionary lookup, tens of nanoseconds: ``bench/tracing_overhead.py``) and does nothing when
it is absent. So ``outboxer[otel]`` (``opentelemetry-api``) costs nothing when it is not
installed, and nothing either when it is installed but the application does not trace.
Configure the SDK as for any library: ``opentelemetry-instrument outboxer relay …``, or a
``TracerProvider`` set up in the process that embeds the relay or the consumer.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from outboxer.brokers.base import Outcome, OutcomeKind
from outboxer.logjson import error_class
from outboxer.message import Message
from outboxer.redact import redact_text

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span, Tracer

#: The headers W3C trace context and baggage propagation write.
TRACEPARENT = "traceparent"
PROPAGATION_HEADERS = (TRACEPARENT, "tracestate", "baggage")

#: Instrumentation scope of outboxer's spans.
TRACER_NAME = "outboxer"

#: ``messaging.system`` by broker URL scheme: the semantic conventions' names where they
#: define one (rabbitmq, kafka), the broker's own name otherwise.
MESSAGING_SYSTEMS = {
    "amqp": "rabbitmq",
    "amqps": "rabbitmq",
    "kafka": "kafka",
    "redis": "redis",
    "rediss": "redis",
    "nats": "nats",
    "mqtt": "mqtt",
    "mqtts": "mqtt",
    "http": "webhook",
    "https": "webhook",
}

_OTEL_TRACE = "opentelemetry.trace"


def tracing_active() -> bool:
    """Whether this process imported OpenTelemetry's trace API (else every call is a no-op)."""
    return _OTEL_TRACE in sys.modules


def messaging_system(broker_url: str) -> str:
    """``messaging.system`` for a broker URL (``memory``, ``file``… for the others)."""
    scheme = broker_url.partition(":")[0].lower()
    return MESSAGING_SYSTEMS.get(scheme, scheme or "unknown")


#: The longest header value the propagators are given: OpenTelemetry's own cap on
#: ``baggage`` (W3C tracestate stays far below it). A longer one is dropped, not parsed:
#: OpenTelemetry would log it whole, at every publish attempt of its message.
LONGEST_PROPAGATION_VALUE = 8192


def _has_trace_header(headers: Mapping[str, str]) -> bool:
    return any(isinstance(name, str) and name.lower() == TRACEPARENT for name in headers)


def _carrier(headers: Mapping[str, str]) -> dict[str, str]:
    """``headers`` as the propagators read them: lower-case names (HTTP header style, while
    brokers may keep the case), text values of a sane length only.

    A consumer builds its message from its broker's delivery, whose header values may be
    bytes, numbers or lists: the propagators raise TypeError on those, in the consumer.
    """
    return {
        name.lower(): value
        for name, value in headers.items()
        if isinstance(name, str)
        and isinstance(value, str)
        and len(value) <= LONGEST_PROPAGATION_VALUE
    }


def inject_trace_context(headers: Mapping[str, str] | None) -> Mapping[str, str] | None:
    """``headers`` plus the current trace context, when a span is active and none is set.

    Returns ``headers`` itself (no copy) when there is nothing to add: no OpenTelemetry in
    the process, no valid current span, or a ``traceparent`` the caller chose.
    """
    trace = sys.modules.get(_OTEL_TRACE)
    if trace is None:
        return headers
    if not trace.get_current_span().get_span_context().is_valid:
        return headers
    if headers and _has_trace_header(headers):
        return headers
    from opentelemetry import propagate

    carrier = dict(headers or {})
    propagate.inject(carrier)
    return carrier


def extract_trace_context(headers: Mapping[str, str]) -> Context | None:
    """The context carried in ``headers``: None without OpenTelemetry, without a
    ``traceparent``, or with one that does not parse (then it is the caller's own data, and
    the relay neither traces the message nor rewrites the header)."""
    if _OTEL_TRACE not in sys.modules or not _has_trace_header(headers):
        return None
    from opentelemetry import propagate, trace

    context = propagate.extract(_carrier(headers))
    if not trace.get_current_span(context).get_span_context().is_valid:
        return None
    return context


@functools.cache
def _tracer() -> Tracer:
    # The API's proxy tracer follows a provider set later, so one tracer serves for good.
    from opentelemetry import trace

    from outboxer import __version__

    return trace.get_tracer(TRACER_NAME, __version__)


def _message_attributes(
    message: Message, system: str, destination_name: str, operation: str, attempt: int | None
) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        "messaging.system": system,
        "messaging.operation.type": operation,
        "messaging.destination.name": destination_name,
        "messaging.message.id": str(message.id),
        "messaging.message.body.size": len(message.payload),
        "outboxer.destination": message.destination,
        "outboxer.topic": message.topic,
    }
    if attempt is not None:
        attributes["outboxer.attempt"] = attempt
    if message.key is not None:
        attributes["outboxer.key"] = message.key
    return attributes


@dataclass
class PublishSpans:
    """The PRODUCER spans of one batch: started together, ended with the batch's outcomes."""

    #: The messages to hand to the publisher: each carries its producer span's context.
    messages: Sequence[Message]
    spans: Sequence[Span | None] = ()

    def end(self, outcomes: Sequence[Outcome | None]) -> None:
        """End each span with its message's outcome (None: not attempted, given back)."""
        if not self.spans:
            return
        from opentelemetry.trace import Status, StatusCode

        for span, outcome in zip(self.spans, outcomes, strict=True):
            if span is None:
                continue
            kind = "released" if outcome is None else outcome.kind.value
            span.set_attribute("outboxer.outcome", kind)
            if outcome is not None and outcome.kind is OutcomeKind.FAILED:
                # A driver's text may hold its URL and password: masked as in log lines.
                error = redact_text(outcome.error or "publish failed")
                span.set_attribute("error.type", error_class(error) or "PublishError")
                span.set_attribute("outboxer.retryable", outcome.retryable)
                span.set_status(Status(StatusCode.ERROR, error))
            span.end()


def start_publish_spans(
    batch: Sequence[Message],
    *,
    system: str,
    destination_name: Callable[[Message], str],
) -> PublishSpans:
    """Start a PRODUCER span per message, each in the trace its headers carry.

    A message enqueued without a trace context gets no span (a span of its own trace would
    only add noise). The returned ``messages`` carry the producer span's context instead of
    the stored one, so a consumer's span becomes its child.
    """
    if _OTEL_TRACE not in sys.modules or not any(
        _has_trace_header(message.headers) for message in batch
    ):
        return PublishSpans(batch)
    from opentelemetry import propagate, trace

    tracer = _tracer()
    outgoing: list[Message] = []
    spans: list[Span | None] = []
    for message in batch:
        parent = extract_trace_context(message.headers)
        if parent is None:
            outgoing.append(message)
            spans.append(None)
            continue
        name = destination_name(message)
        span = tracer.start_span(
            f"send {name}",
            context=parent,
            kind=trace.SpanKind.PRODUCER,
            attributes=_message_attributes(message, system, name, "send", message.attempts + 1),
        )
        carrier = {
            header: value
            for header, value in message.headers.items()
            if not (isinstance(header, str) and header.lower() in PROPAGATION_HEADERS)
        }
        propagate.inject(carrier, context=trace.set_span_in_context(span, parent))
        outgoing.append(replace(message, headers=carrier))
        spans.append(span)
    return PublishSpans(outgoing, spans)


@contextlib.contextmanager
def consumer_span(
    message: Message,
    *,
    system: str,
    destination_name: str | None = None,
    delivery_attempt: int | None = None,
) -> Iterator[Span | None]:
    """A CONSUMER span around applying ``message``, continuing the trace its headers carry.

    The span is current inside the block, so the handler's own spans are its children; an
    exception leaving the block is recorded on it. Yields None (and costs nothing) without
    OpenTelemetry in the process.
    """
    if _OTEL_TRACE not in sys.modules:
        yield None
        return
    from opentelemetry import trace

    name = destination_name or message.topic
    with _tracer().start_as_current_span(
        f"process {name}",
        context=extract_trace_context(message.headers),
        kind=trace.SpanKind.CONSUMER,
        attributes=_message_attributes(message, system, name, "process", delivery_attempt),
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        try:
            yield span
        except BaseException as exc:
            _record_failure(span, exc)
            raise


def _record_failure(span: Span, exc: BaseException) -> None:
    """What OpenTelemetry records of an exception leaving a span, its text redacted as a log
    line's is (a handler's or a driver's error may hold a URL with its password)."""
    import traceback

    from opentelemetry.trace import Status, StatusCode

    span.record_exception(
        exc,
        attributes={
            "exception.message": redact_text(str(exc)),
            "exception.stacktrace": redact_text("".join(traceback.format_exception(exc))),
        },
    )
    span.set_status(Status(StatusCode.ERROR, redact_text(f"{type(exc).__name__}: {exc}")))


__all__ = [
    "LONGEST_PROPAGATION_VALUE",
    "MESSAGING_SYSTEMS",
    "PROPAGATION_HEADERS",
    "TRACEPARENT",
    "PublishSpans",
    "consumer_span",
    "extract_trace_context",
    "inject_trace_context",
    "messaging_system",
    "start_publish_spans",
    "tracing_active",
]
