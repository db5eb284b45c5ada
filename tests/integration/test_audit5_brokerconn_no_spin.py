"""A publisher that says its connection is gone as soon as it connected (a broker that
closes each new connection): the relay backs off between connects as for a refused one,
rather than reconnect in a tight loop (``while not publisher.connected: connect()``)."""

from __future__ import annotations

import asyncio
import uuid

from outboxer import Relay, create_store, load_settings
from outboxer.brokers.memory import MemoryPublisher
from outboxer.testing import eventually


class ClosedAtOnce(MemoryPublisher):
    async def _connect(self) -> None:
        await asyncio.sleep(0)  # a real connect does I/O: other tasks run meanwhile
        await super()._connect()

    def _transport_lost(self) -> bool:
        return True


async def test_a_connection_lost_at_once_is_backed_off(sqlite_url: str) -> None:
    publisher = ClosedAtOnce(f"memory://spin-{uuid.uuid4().hex[:8]}")
    settings = load_settings(
        {"db": sqlite_url, "poll_interval": 0.05, "backoff_base": 0.05, "backoff_max": 0.1},
        environ={},
    )
    relay = Relay(create_store(sqlite_url), {"default": publisher}, settings)
    task = asyncio.create_task(relay.run())
    try:

        async def reported() -> bool:
            return any("closed the new connection" in p for p in relay.health_problems())

        await eventually(reported, timeout=2)
        before = publisher.stats.connects
        await asyncio.sleep(0.3)  # the span over which connects are counted
        assert publisher.stats.connects - before <= 8, publisher.stats.connects - before
    finally:
        relay.stop()
        await asyncio.wait_for(task, 5)
