"""What outboxer's tracing hooks cost per call, with and without OpenTelemetry in use.

    .venv/bin/python bench/tracing_overhead.py [--number N]

Measures, in this order (OpenTelemetry is imported only after the first section):

1. no OpenTelemetry imported: ``inject_trace_context`` (what ``enqueue`` calls) and
   ``start_publish_spans`` on a batch of 500 (what the relay calls per batch), against a
   plain function call that returns its argument;
2. the API imported, no SDK, no span: the same calls;
3. the SDK with a span active (a batch span processor, an exporter that drops spans): what tracing costs
   when it is used.

Prints nanoseconds per call (best of 5 repeats). No services needed.
"""

from __future__ import annotations

import argparse
import sys
import timeit
import uuid
from collections.abc import Callable

from outboxer.brokers.base import PUBLISHED
from outboxer.message import Message
from outboxer.tracing import inject_trace_context, start_publish_spans

BATCH = 500


def best_ns(call: Callable[[], object], number: int) -> float:
    return min(timeit.repeat(call, number=number, repeat=5)) / number * 1e9


def identity(headers: dict[str, str]) -> dict[str, str]:
    return headers


def batch(headers: dict[str, str]) -> list[Message]:
    return [
        Message(id=uuid.uuid4(), topic="t", payload=b"{}", headers=dict(headers), seq=n)
        for n in range(BATCH)
    ]


def measure(section: str, number: int, headers: dict[str, str]) -> None:
    messages = batch(headers)
    plain = best_ns(lambda: identity(headers), number)
    inject = best_ns(lambda: inject_trace_context(headers), number)

    def publish() -> None:
        spans = start_publish_spans(messages, system="memory", destination_name=lambda m: m.topic)
        spans.end([PUBLISHED] * len(messages))

    per_batch = best_ns(publish, max(number // 1000, 10))
    print(f"{section}")
    print(f"  plain function call              {plain:10.0f} ns")
    print(f"  inject_trace_context             {inject:10.0f} ns")
    print(f"  start_publish_spans+end, {BATCH} msgs {per_batch / 1000:10.1f} µs per batch")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--number", type=int, default=200_000, help="calls per repeat")
    number = parser.parse_args().number

    assert "opentelemetry.trace" not in sys.modules
    measure("1. no OpenTelemetry imported", number, {"a": "b"})

    from opentelemetry import trace

    measure("2. OpenTelemetry API imported, no SDK, no span", number, {"a": "b"})

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    class Drop(SpanExporter):
        def export(self, spans: object) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Drop()))
    trace.set_tracer_provider(provider)
    with trace.get_tracer("bench").start_as_current_span("request"):
        carried = dict(inject_trace_context({"a": "b"}) or {})
        measure("3. SDK, a span active (every message traced)", number // 10, carried)


if __name__ == "__main__":
    main()
