"""A relay stopped while a destination's broker connect hangs (a broker that accepts the TCP
connection and never answers; a name the resolver holds) exits at once, and still finishes
the batches it holds.

Before, the loops sharing that publisher waited for the connect under way
(``publish_timeout``), then each started a connect attempt of its own after the stop, one
after another (``_ensure_publisher`` did not look at ``stopping`` before connecting): the
relay ended only when ``shutdown_timeout`` (20 s) forced it, cutting short the other
destinations' batches in flight as well.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from outboxer import Relay, create_store, load_settings
from outboxer.brokers.memory import MemoryPublisher, memory_broker
from outboxer.brokers.redis import RedisPublisher
from outboxer.testing import eventually
from tests.integration.test_audit20_dnshung_store import enqueue, rows
from tests.s3 import silent_listener

#: Each connect to the silent broker gives up after this long: four loops one after another
#: took 4 x 8 s, so the relay waited for shutdown_timeout (20 s).
PUBLISH_TIMEOUT = 8.0


async def test_a_relay_stopped_while_a_broker_connect_hangs_exits_and_keeps_its_batches(
    sqlite_url: str,
) -> None:
    enqueue(sqlite_url, "slow", 5)
    slow = MemoryPublisher(f"memory://audit20-review-dns-{uuid.uuid4().hex[:8]}")
    slow.broker.latency = 1.0  # its batch is in flight when the relay stops
    settings = load_settings(
        {"db": sqlite_url, "poll_interval": 0.05, "concurrency": 4}, environ={}
    )
    with silent_listener() as address:
        hung = RedisPublisher(f"redis://{address}/0", publish_timeout=PUBLISH_TIMEOUT)
        relay = Relay(create_store(sqlite_url), {"hung": hung, "slow": slow}, settings)
        task = asyncio.create_task(relay.run())
        try:

            async def in_flight() -> bool:
                return rows(sqlite_url, "slow", "PROCESSING") == 5

            await eventually(in_flight, timeout=5)
            await asyncio.sleep(0.2)  # the hung destination's first connect is under way
            relay.stop()
            began = time.monotonic()
            try:
                await asyncio.wait_for(asyncio.shield(task), 4)
            except TimeoutError:
                pytest.fail(
                    f"the relay had not returned {time.monotonic() - began:.1f} s after "
                    f"stop(); {hung.stats.connects} connect(s) of the silent broker done"
                )
            took = time.monotonic() - began
        finally:
            if not task.done():
                relay.force_stop()
                await asyncio.wait_for(task, 30)
    assert took < 3, f"the relay returned {took:.1f} s after stop()"
    # The batch in flight at the stop was published and settled, not given back.
    assert rows(sqlite_url, "slow", "PUBLISHED") == 5
    assert len(memory_broker(slow.broker.name).messages) == 5
