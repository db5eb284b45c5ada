"""One OpenTelemetry SDK tracer provider per test process, exporting to memory.

The API lets a process set its global tracer provider once, so every test that checks spans
shares this one and clears its exporter first (``spans()`` fixture in the tests).
"""

from __future__ import annotations

import functools

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter


@functools.cache
def memory_exporter() -> InMemorySpanExporter:
    """The exporter behind the process's SDK tracer provider (set up on first call)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    if trace.get_tracer_provider() is not provider:
        raise RuntimeError(
            "another tracer provider was set first: the spans would not reach memory"
        )
    return exporter
