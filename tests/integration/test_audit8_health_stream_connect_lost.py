"""The stream relay's reconnect, held to the table relay's (``Relay._ensure_publisher``):

- a broker that closes each new connection at once (a proxy or a broker at its connection
  limit): the relay took the connect as done, read a batch, got it back unsent, and
  connected again after each poll_interval, never backing off, /health saying "ok". Now
  such a connect is a failed one: backed off, and /health names it;
- a broker that refuses the configuration for good (an exchange of another type): the
  relay ended with the driver's PublishError (exit 1, "outboxer: ..."); now with a
  ConfigError, as the table relay (exit 2, "configuration error").
"""

from __future__ import annotations

import asyncio
import uuid

import psycopg
import pytest

from outboxer.brokers.memory import MemoryPublisher
from outboxer.enqueue import Outbox
from outboxer.errors import ConfigError, PublishError
from outboxer.stores.pglog import PgLog
from outboxer.streamrelay import StreamRelay
from outboxer.testing import eventually


class SlammingPublisher(MemoryPublisher):
    """Each connection it makes is lost at once while ``slam`` is set."""

    slam = True
    _lost = False

    async def _connect(self) -> None:
        self._lost = self.slam

    def _transport_lost(self) -> bool:
        return self._lost


class RefusingPublisher(MemoryPublisher):
    async def _connect(self) -> None:
        raise PublishError("exchange 'x' exists with other settings", retryable=False)


async def log_source(pg_url: str) -> object:
    async with PgLog(pg_url) as log:
        await log.apply_schema()
    source = PgLog(pg_url).reader("default")
    await source.connect()
    return source


async def test_a_connection_lost_as_it_is_made_is_backed_off_and_reported(pg_url: str) -> None:
    source = await log_source(pg_url)
    with psycopg.connect(pg_url) as conn:
        Outbox(mode="log").enqueue(conn, "t", {"n": 1}, key="k")
    publisher = SlammingPublisher(f"memory://audit8-{uuid.uuid4().hex[:8]}")
    relay = StreamRelay(source, publisher, poll_interval=0.01, outage_backoff_max=5.0)  # type: ignore[arg-type]
    stop = asyncio.Event()
    task = asyncio.create_task(relay.run(stop))
    try:
        await asyncio.sleep(0.5)
        # Backed off 0.1, 0.2, 0.4 s: not a connect after every 10 ms poll.
        assert publisher.stats.connects <= 4, publisher.stats.connects
        [problem] = relay.health_problems()
        assert problem.startswith("broker default: ") and "closed the new connection" in problem
        assert relay.stats.failed == 0
        publisher.slam = False

        async def published() -> bool:
            return relay.stats.published == 1

        await eventually(published, timeout=5)
        assert relay.health_problems() == []
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await source.close()  # type: ignore[attr-defined]
    assert [m.payload for m in publisher.broker.messages] == [b'{"n":1}']


async def test_a_configuration_the_broker_refuses_ends_the_relay_with_a_config_error(
    pg_url: str,
) -> None:
    source = await log_source(pg_url)
    relay = StreamRelay(source, RefusingPublisher("memory://audit8-refusing"))  # type: ignore[arg-type]
    try:
        with pytest.raises(ConfigError, match="broker default refuses this configuration"):
            await asyncio.wait_for(relay.run(asyncio.Event()), 5)
    finally:
        await source.close()  # type: ignore[attr-defined]
