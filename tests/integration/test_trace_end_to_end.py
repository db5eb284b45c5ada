"""One trace from the request that enqueued (PostgreSQL), through the relay's publish
(RabbitMQ), to the consumer that applies the message; the relay's histograms and its log
fields too."""

from __future__ import annotations

import json
import logging
import sqlite3
import uuid
from typing import Any

import psycopg
import pytest
from opentelemetry import trace
from opentelemetry.trace import SpanKind

import outboxer
from outboxer import Relay, load_settings
from outboxer.brokers.memory import memory_broker
from outboxer.logjson import JsonFormatter
from outboxer.message import Message
from outboxer.stores.sqlite import sqlite_path
from outboxer.tracing import consumer_span
from tests.rabbit import RabbitConsumer


async def test_one_trace_from_the_request_to_the_consumer(
    pg_url: str, rabbit_consumer: RabbitConsumer, exporter: Any
) -> None:
    tracer = trace.get_tracer("test")
    with tracer.start_as_current_span("POST /orders") as request, psycopg.connect(pg_url) as conn:
        sent = outboxer.enqueue(conn, "order.placed", {"order": 7}, key="customer-7")
    relay = Relay.from_settings(
        load_settings({"db": pg_url, "broker": rabbit_consumer.broker_url}, environ={})
    )
    stats = await relay.drain()
    assert stats.published == 1
    [delivered] = await rabbit_consumer.wait_for(1)
    received = Message(
        id=uuid.UUID(delivered.message_id),
        topic=delivered.routing_key,
        payload=delivered.body,
        headers={name: str(value) for name, value in delivered.headers.items()},
    )
    with consumer_span(received, system="rabbitmq"):
        pass

    spans = {span.name: span for span in exporter.get_finished_spans()}
    producer, consumer = spans["send order.placed"], spans["process order.placed"]
    trace_id = request.get_span_context().trace_id
    assert {span.context.trace_id for span in (producer, consumer)} == {trace_id}
    assert (
        producer.parent is not None
        and producer.parent.span_id == request.get_span_context().span_id
    )
    assert consumer.parent is not None and consumer.parent.span_id == producer.context.span_id
    assert (producer.kind, consumer.kind) == (SpanKind.PRODUCER, SpanKind.CONSUMER)
    assert producer.attributes["messaging.system"] == "rabbitmq"
    assert producer.attributes["messaging.message.id"] == str(sent.id)
    assert producer.attributes["outboxer.attempt"] == 1
    assert producer.attributes["outboxer.outcome"] == "published"

    assert relay.metrics is not None
    registry = relay.metrics.registry
    labels = {"database": "default", "destination": "default"}
    assert registry.get_sample_value("outboxer_publish_latency_seconds_count", labels) == 1
    assert registry.get_sample_value("outboxer_claim_duration_seconds_count", labels) >= 1
    assert registry.get_sample_value("outboxer_settle_duration_seconds_count", labels) == 1
    assert registry.get_sample_value("outboxer_messages_in_flight", labels) == 0


async def test_failure_log_lines_carry_the_message_fields(
    sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    broker = memory_broker(f"log-{uuid.uuid4().hex[:8]}")
    broker.fail = lambda message: ConnectionResetError("peer went away")
    conn = sqlite3.connect(sqlite_path(sqlite_url))
    with conn:
        sent = outboxer.enqueue(conn, "order.placed", {"n": 1})
    conn.close()
    relay = Relay.from_settings(
        load_settings(
            {"db": sqlite_url, "broker": f"memory://{broker.name}", "max_attempts": 1},
            environ={},
        )
    )
    with caplog.at_level(logging.WARNING, logger="outboxer.relay"):
        await relay.drain()
    [record] = [r for r in caplog.records if "abandoned after" in r.getMessage()]
    line = json.loads(JsonFormatter().format(record))
    assert line["message_id"] == str(sent.id)
    assert (line["destination"], line["topic"], line["attempt"]) == ("default", "order.placed", 1)
    assert line["error_class"] == "ConnectionResetError"
    assert line["relay_id"] == relay.relay_id
