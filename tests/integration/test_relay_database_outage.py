"""A database outage never ends the relay: it logs, backs off and resumes by itself."""

from __future__ import annotations

import asyncio
import uuid

import psycopg

import outboxer
from outboxer import Relay, load_settings
from outboxer.brokers.memory import memory_broker
from outboxer.testing import TcpProxy, eventually


async def test_relay_survives_a_database_outage(pg_url: str) -> None:
    proxy = await TcpProxy("127.0.0.1", 5432).start()
    database = pg_url.rsplit("/", 1)[1]
    via_proxy = f"postgresql://postgres@127.0.0.1:{proxy.port}/{database}"
    broker = memory_broker(f"db-outage-{uuid.uuid4().hex[:8]}")
    relay = Relay.from_settings(
        load_settings(
            {"db": via_proxy, "broker": f"memory://{broker.name}", "poll_interval": 0.1}, environ={}
        )
    )
    task = asyncio.create_task(relay.run())
    try:
        with psycopg.connect(pg_url) as conn:
            outboxer.enqueue(conn, "t", {"before": True})

        async def delivered(count: int) -> bool:
            return len(broker.messages) >= count

        await eventually(lambda: delivered(1))
        await proxy.cut()  # the relay loses every database connection
        with psycopg.connect(pg_url) as conn:
            during = outboxer.enqueue(conn, "t", {"during": True})
        await eventually(lambda: _true(relay.stats.store_errors > 0), timeout=20)
        assert not task.done(), "the relay is still running"
        await proxy.restore()
        await eventually(lambda: delivered(2), timeout=30)
        assert broker.messages[-1].id == during.id
    finally:
        relay.stop()
        await asyncio.wait_for(task, 30)
        await proxy.stop()
    with psycopg.connect(pg_url) as conn:
        assert conn.execute(
            "SELECT count(*) FROM outboxer.outbox WHERE status = 'PUBLISHED'"
        ).fetchone() == (2,)


async def _true(value: bool) -> bool:
    return value
