"""enqueue stores the active span's trace context with the row, on the real PostgreSQL."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import outboxer
from tests.otel import BLOCK_OPENTELEMETRY, traceparent_of


def stored_headers(url: str) -> list[dict[str, Any]]:
    import psycopg

    with psycopg.connect(url) as conn:
        rows = conn.execute("SELECT headers FROM outboxer.outbox ORDER BY seq").fetchall()
    return [row[0] for row in rows]


def test_sync_enqueue_and_enqueue_many_store_the_active_spans_traceparent(
    pg_url: str, exporter: InMemorySpanExporter
) -> None:
    import psycopg

    tracer = trace.get_tracer("test")
    with psycopg.connect(pg_url) as conn:
        with tracer.start_as_current_span("POST /orders") as request:
            outboxer.enqueue(conn, "order.placed", {"id": 1}, headers={"tenant": "a"})
            outboxer.enqueue_many(conn, [{"topic": "t", "payload": {"n": n}} for n in range(2)])
        outboxer.enqueue(conn, "outside.any.span", {"id": 2})
    rows = stored_headers(pg_url)
    expected = traceparent_of(request)
    assert [row.get("traceparent") for row in rows] == [expected, expected, expected, None]
    assert rows[0]["tenant"] == "a", "the caller's own headers stay"


async def test_async_enqueue_and_enqueue_many_store_the_active_spans_traceparent(
    pg_url: str, exporter: InMemorySpanExporter
) -> None:
    import asyncpg

    tracer = trace.get_tracer("test")
    conn = await asyncpg.connect(pg_url)
    try:
        with tracer.start_as_current_span("consume order") as handler:
            async with conn.transaction():
                await outboxer.enqueue_async(conn, "t", "one")
                await outboxer.enqueue_many_async(conn, [{"topic": "t", "payload": "two"}])
                await outboxer.enqueue_async(
                    conn,
                    "t",
                    "chosen",
                    headers={"TraceParent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"},
                )
    finally:
        await conn.close()
    rows = stored_headers(pg_url)
    assert [row.get("traceparent") for row in rows[:2]] == [traceparent_of(handler)] * 2
    assert rows[2] == {"TraceParent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}, (
        "a trace context the caller set is kept as given"
    )


_WITHOUT_OTEL = textwrap.dedent(
    """
    import sys
    import psycopg
    import outboxer

    with psycopg.connect(sys.argv[1]) as conn:
        outboxer.enqueue(conn, "t", {"n": 1}, headers={"h": "v"})
        outboxer.enqueue_many(conn, [{"topic": "t", "payload": {"n": 2}}])
    assert not [name for name in sys.modules if name.startswith("opentelemetry")]
    """
)


def test_without_opentelemetry_the_row_carries_no_trace_context(pg_url: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", BLOCK_OPENTELEMETRY + _WITHOUT_OTEL, pg_url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert stored_headers(pg_url) == [{"h": "v"}, {}]
