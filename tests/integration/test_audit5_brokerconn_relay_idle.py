"""A relay whose broker drops while it idles: ``/health`` says so within a bounded time (it
said "ok" for as long as nothing was due), the relay backs off and reconnects before it
claims again, and the messages committed meanwhile are published once the broker is back,
with no attempt used up, once each, in key order.

The broker is dropped through a FaultProxy (the Dropper of test_audit5_brokerconn_idle_drop.py).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from typing import Any

import pytest
import redis.asyncio as aioredis

from outboxer import create_store, load_settings
from outboxer.http import HttpApi, Request
from outboxer.testing import eventually
from tests.integration.test_audit5_brokerconn_idle_drop import Dropper
from tests.rabbit import RabbitConsumer
from tests.relaying import enqueue, relay, rows
from tests.services import require

#: How long /health may say "ok" after the drop: the relay's next look (poll_interval 0.05 s)
#: and a refused connect.
BOUND = 2.0


async def rabbitmq_sink(
    stack: AsyncExitStack,
) -> tuple[Dropper, str, Callable[[], Awaitable[list[str]]]]:
    require("rabbitmq")
    consumer = await RabbitConsumer().start()
    stack.push_async_callback(consumer.stop)
    dropper = Dropper(5672)
    stack.callback(dropper.proxy.stop)
    url = consumer.broker_url.replace(":5672/", f":{dropper.proxy.port}/")

    async def received() -> list[str]:
        return [d.message_id for d in consumer.received]

    return dropper, url, received


async def redis_sink(
    stack: AsyncExitStack,
) -> tuple[Dropper, str, Callable[[], Awaitable[list[str]]]]:
    require("redis")
    prefix = f"audit5-relay-{uuid.uuid4().hex[:8]}-"
    client = aioredis.Redis.from_url("redis://127.0.0.1:6379/0")

    async def cleanup() -> None:
        await client.delete(f"{prefix}t")
        await client.aclose()

    stack.push_async_callback(cleanup)
    dropper = Dropper(6379)
    stack.callback(dropper.proxy.stop)
    url = f"redis://127.0.0.1:{dropper.proxy.port}/0?stream_prefix={prefix}"

    async def received() -> list[str]:
        entries = await client.xrange(f"{prefix}t")
        return [fields[b"id"].decode() for _, fields in entries]

    return dropper, url, received


SINKS = {"rabbitmq": rabbitmq_sink, "redis": redis_sink}


@pytest.fixture(params=list(SINKS))
async def sink(
    request: pytest.FixtureRequest,
) -> AsyncIterator[tuple[Dropper, str, Callable[[], Awaitable[list[str]]]]]:
    async with AsyncExitStack() as stack:
        yield await SINKS[request.param](stack)


async def health(api: HttpApi) -> tuple[int, dict[str, Any]]:
    response = await api.handle(Request("GET", "/health"))
    return response.status, json.loads(response.body)


async def test_an_idle_relay_reports_the_drop_and_reconnects_before_claiming(
    pg_url: str, sink: tuple[Dropper, str, Callable[[], Awaitable[list[str]]]]
) -> None:
    dropper, broker_url, received = sink
    worker = relay(pg_url, broker_url, backoff_base=0.05, backoff_max=0.1)
    api = HttpApi(create_store(pg_url), load_settings({"db": pg_url}, environ={}), worker)
    task = asyncio.create_task(worker.run())
    try:

        async def status_is(code: int) -> bool:
            return (await health(api))[0] == code

        await eventually(lambda: status_is(200), timeout=5)
        dropper.drop()
        loop = asyncio.get_running_loop()
        dropped_at = loop.time()
        await eventually(lambda: status_is(503), timeout=BOUND)
        _, body = await health(api)
        assert "broker default" in body["relay"], body
        assert loop.time() - dropped_at < BOUND
        # Committed while the broker is down: not claimed, so not failed.
        sent = enqueue(pg_url, ("t", "k"), ("t", "k"), ("t", "j"), ("t", "k"))
        await asyncio.sleep(0.3)  # a few of the relay's looks, each finding the broker down
        assert {(r["status"], r["attempts"]) for r in await rows(pg_url)} == {("PENDING", 0)}
        dropper.restore()

        async def all_out() -> bool:
            return {r["status"] for r in await rows(pg_url)} == {"PUBLISHED"}

        await eventually(all_out, timeout=5)
        await eventually(lambda: status_is(200), timeout=2)
    finally:
        worker.stop()
        await asyncio.wait_for(task, 10)
        await api.close()
    assert [r["attempts"] for r in await rows(pg_url)] == [0, 0, 0, 0]
    ids = await received()
    assert sorted(ids) == sorted(str(m.id) for m in sent), "each once"
    keyed = [str(m.id) for m in sent if m.key == "k"]
    assert [i for i in ids if i in keyed] == keyed, "key k in order"


async def test_health_reports_the_drop_while_the_reconnect_hangs(
    pg_url: str, sink: tuple[Dropper, str, Callable[[], Awaitable[list[str]]]]
) -> None:
    """The connection is reset and the broker then takes new connections but never answers
    (a partition, a hung broker): the reconnect waits for its connect timeout (seconds),
    and /health said "ok" all that time, as no outage was recorded before it failed."""
    dropper, broker_url, received = sink
    worker = relay(pg_url, broker_url, publish_timeout=20)
    api = HttpApi(create_store(pg_url), load_settings({"db": pg_url}, environ={}), worker)
    task = asyncio.create_task(worker.run())
    try:

        async def status_is(code: int) -> bool:
            return (await health(api))[0] == code

        await eventually(lambda: status_is(200), timeout=5)
        dropper.proxy.stall()
        dropper.proxy.cut()
        await eventually(lambda: status_is(503), timeout=BOUND)
        _, body = await health(api)
        assert "broker default: not connected" in body["relay"], body
        [sent] = enqueue(pg_url, ("t", "k"))
        dropper.proxy.resume()  # the hung connect goes on, and the relay publishes

        async def published() -> bool:
            return [r["status"] for r in await rows(pg_url)] == ["PUBLISHED"]

        await eventually(published, timeout=5)
        await eventually(lambda: status_is(200), timeout=2)
    finally:
        dropper.proxy.resume()
        worker.stop()
        await asyncio.wait_for(task, 10)
        await api.close()
    assert [r["attempts"] for r in await rows(pg_url)] == [0]
    assert await received() == [str(sent.id)]
