"""A RabbitMQ connection the broker blocked (``connection.blocked``: a memory or disk alarm):
each wave came back unsent at 80% of publish_timeout while /health said "ok", on the table
relay and on the stream relay alike. Both now say ``broker default: blocked by the broker
(resource alarm)`` until ``connection.unblocked``.

No alarm is raised on the shared RabbitMQ (others use it): the frames are handed to the
connection's aiormq handlers of ``connection.blocked`` / ``connection.unblocked``, the ones
its frame reader calls for them, on a real connection.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiormq import spec

from outboxer import create_store, load_settings
from outboxer.brokers.base import Publisher
from outboxer.http import HttpApi, Request
from outboxer.stores.pglog import PgLog
from outboxer.stream_api import StreamApi, stream_metrics
from outboxer.streamrelay import StreamRelay
from outboxer.testing import eventually
from tests.relaying import relay
from tests.services import require

BROKER = "amqp://guest:guest@127.0.0.1:5672/?exchange=outboxer-audit8-blocked"
BLOCKED = "broker default: blocked by the broker (resource alarm)"


def aiormq_connection(publisher: Publisher) -> Any:
    return publisher._connection.transport.connection  # type: ignore[attr-defined]


async def block(publisher: Publisher) -> None:
    frame = spec.Connection.Blocked(reason="low on memory")
    await aiormq_connection(publisher)._Connection__handle_connection_blocked(frame)


async def unblock(publisher: Publisher) -> None:
    frame = spec.Connection.Unblocked()
    await aiormq_connection(publisher)._Connection__handle_connection_unblocked(frame)


@pytest.fixture
def rabbitmq() -> None:
    require("rabbitmq")


async def test_the_table_relay_reports_a_blocked_connection(pg_url: str, rabbitmq: None) -> None:
    worker = relay(pg_url, BROKER)
    api = HttpApi(create_store(pg_url), load_settings({"db": pg_url}, environ={}), worker)
    task = asyncio.create_task(worker.run())

    async def health() -> tuple[int, dict[str, Any]]:
        response = await api.handle(Request("GET", "/health"))
        return response.status, json.loads(response.body)

    async def healthy() -> bool:
        return (await health())[0] == 200

    try:
        await eventually(healthy, timeout=5)
        publisher = worker.publishers["default"]
        await block(publisher)
        code, body = await health()
        assert (code, body.get("reasons")) == (503, [BLOCKED]), body
        assert publisher.connected and publisher.problem() == BLOCKED.split(": ", 1)[1]
        await unblock(publisher)
        assert publisher.problem() is None
        assert await health() == (200, {"status": "ok", "database": "ok", "relay": "ok"})
    finally:
        worker.stop()
        await asyncio.wait_for(task, 10)
        await api.close()


@pytest.fixture
async def stream_relay(pg_url: str, rabbitmq: None) -> AsyncIterator[StreamRelay]:
    from outboxer.brokers import create_publisher

    async with PgLog(pg_url) as log:
        await log.apply_schema()
    source = PgLog(pg_url).reader("default")
    publisher = create_publisher(BROKER)
    stream = StreamRelay(source, publisher, poll_interval=0.02)
    stop = asyncio.Event()
    await source.connect()
    task = asyncio.create_task(stream.run(stop))
    try:
        yield stream
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await publisher.close()
        await source.close()


async def test_the_stream_relay_reports_a_blocked_connection(stream_relay: StreamRelay) -> None:
    api = StreamApi(stream_relay, stream_metrics(stream_relay))

    async def call(path: str) -> tuple[int, str]:
        response = await api.handle(Request("GET", path))
        return response.status, response.body.decode()

    async def healthy() -> bool:
        return (await call("/health"))[0] == 200

    await eventually(healthy, timeout=5)
    await block(stream_relay.publisher)
    code, body = await call("/health")
    assert (code, json.loads(body)["reasons"]) == (503, [BLOCKED])
    assert json.loads((await call("/status"))[1])["problems"] == [BLOCKED]
    _, metrics = await call("/metrics")
    assert 'outboxer_stream_relay_healthy{destination="default",mode="log"} 0.0' in metrics
    await unblock(stream_relay.publisher)
    code, body = await call("/health")
    assert (code, json.loads(body)) == (
        200,
        {"status": "ok", "mode": "log", "destination": "default"},
    )
