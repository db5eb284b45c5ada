"""The stream relay (log mode) whose broker connection is cut while it idles: its /health,
/status and outboxer_stream_relay_healthy said "ok" until the reconnect failed, which
takes the connect timeout where the broker takes the TCP connection but never answers.
They now say ``broker default: not connected`` at once, as the table relay does; the relay
reconnects before its next read, and what was committed meanwhile is published once, with
no attempt counted against it.

The broker is the shared RabbitMQ (or Redis) behind a FaultProxy of this test's own.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from typing import Any

import psycopg
import pytest

from outboxer.brokers import create_publisher
from outboxer.enqueue import Outbox
from outboxer.http import Request
from outboxer.stores.pglog import PgLog
from outboxer.stream_api import StreamApi, stream_metrics
from outboxer.streamrelay import StreamRelay
from outboxer.testing import eventually
from tests.integration.test_audit5_brokerconn_idle_drop import Dropper
from tests.integration.test_audit5_brokerconn_relay_idle import SINKS

#: How long /health may say "ok" after the cut: a look at the publisher, no I/O.
BOUND = 1.0

Sink = tuple[Dropper, str, Callable[[], Awaitable[list[str]]]]


@pytest.fixture(params=list(SINKS))
async def sink(request: pytest.FixtureRequest) -> AsyncIterator[Sink]:
    async with AsyncExitStack() as stack:
        yield await SINKS[request.param](stack)


async def call(api: StreamApi, path: str) -> tuple[int, Any]:
    response = await api.handle(Request("GET", path))
    body = response.body.decode()
    return response.status, json.loads(body) if path != "/metrics" else body


async def test_a_cut_while_idle_shows_at_once_and_is_reconnected_before_the_read(
    pg_url: str, sink: Sink
) -> None:
    dropper, broker_url, received = sink
    async with PgLog(pg_url) as log:
        await log.apply_schema()
    source = PgLog(pg_url).reader("default")
    # A connect that hangs until publish_timeout: the window /health said "ok" in.
    publisher = create_publisher(broker_url, publish_timeout=20)
    relay = StreamRelay(
        source, publisher, poll_interval=0.02, outage_backoff_max=0.1, probe_interval=0.05
    )
    api = StreamApi(relay, stream_metrics(relay))
    stop = asyncio.Event()
    await source.connect()
    task = asyncio.create_task(relay.run(stop))
    try:

        async def health_is(code: int) -> bool:
            return (await call(api, "/health"))[0] == code

        await eventually(lambda: health_is(200), timeout=5)
        dropper.proxy.stall()  # new connections are taken but never answered…
        dropper.proxy.cut()  # …and the open one is reset
        loop = asyncio.get_running_loop()
        cut_at = loop.time()
        await eventually(lambda: health_is(503), timeout=BOUND)
        assert loop.time() - cut_at < BOUND
        _, body = await call(api, "/health")
        assert body["reasons"] == ["broker default: not connected"], body
        _, status = await call(api, "/status")
        assert status["healthy"] is False
        assert status["problems"] == ["broker default: not connected"]
        _, metrics = await call(api, "/metrics")
        assert 'outboxer_stream_relay_healthy{destination="default",mode="log"} 0.0' in metrics

        with psycopg.connect(pg_url) as conn:
            sent = [Outbox(mode="log").enqueue(conn, "t", {"n": n}, key="k") for n in range(3)]
        await asyncio.sleep(0.1)  # several polls while the connect hangs: nothing read
        assert relay.stats.failed == 0 and relay.stats.published == 0
        dropper.proxy.resume()  # the hung connect goes on, and the relay publishes

        async def all_out() -> bool:
            return relay.stats.published == 3

        await eventually(all_out, timeout=10)
        await eventually(lambda: health_is(200), timeout=2)
    finally:
        dropper.proxy.resume()
        stop.set()
        await asyncio.wait_for(task, 10)
        await publisher.close()
        await source.close()
    assert relay.stats.failed == 0 and relay.failing == 0
    assert await received() == [str(m.id) for m in sent], "each once, in order"
