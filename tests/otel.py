"""One OpenTelemetry SDK tracer provider per test process, exporting to memory.

The API lets a process set its global tracer provider once, so every test that checks spans
shares this one and clears its exporter first (``spans()`` fixture in the tests).
"""

from __future__ import annotations

import functools
import textwrap

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
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


def traceparent_of(span: trace.Span | ReadableSpan) -> str:
    """The W3C ``traceparent`` header naming ``span``."""
    ctx = span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"


#: Python source that makes the process behave as if OpenTelemetry were not installed.
BLOCK_OPENTELEMETRY = textwrap.dedent(
    """
    import sys

    class Blocker:
        def find_spec(self, name, path=None, target=None):
            if name == "opentelemetry" or name.startswith("opentelemetry."):
                raise ImportError(f"blocked {name}")

    sys.meta_path.insert(0, Blocker())
    """
)
