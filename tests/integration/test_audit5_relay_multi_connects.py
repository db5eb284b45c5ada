"""outboxer_broker_connects_total counts the connections a relay made, not the loops that
waited for one: a relay's loops (``concurrency``) share one publisher, and those that find
it connected by another loop made no connection."""

from __future__ import annotations

import asyncio
import uuid

from outboxer.testing import eventually
from tests.relaying import relay
from tests.services import require

REDIS = "redis://127.0.0.1:6379/0"


async def test_loops_sharing_a_publisher_count_one_connect_each_time_it_connects(
    sqlite_url: str,
) -> None:
    require("redis")
    prefix = f"outboxer-test:{uuid.uuid4().hex[:8]}:"
    subject = relay(sqlite_url, f"{REDIS}?stream_prefix={prefix}", concurrency=4)
    publisher = subject.publishers["default"]

    async def connected_and_idle() -> bool:
        # Every loop has passed its connect and waits for work.
        return publisher.connected and len(subject._waiting) == 4

    task = asyncio.create_task(subject.run())
    try:
        await eventually(connected_and_idle, timeout=5)
        assert publisher.stats.connects == 1
        assert subject.destination_stats["default"].broker_reconnects == 1
        assert subject.stats.broker_reconnects == 1

        # The connection drops: the loops' next claims (SQLite polls) reconnect it, once.
        await publisher.close()
        await eventually(connected_and_idle, timeout=5)
        assert publisher.stats.connects == 2
        assert subject.destination_stats["default"].broker_reconnects == 2
    finally:
        subject.stop()
        await asyncio.wait_for(task, 10)
