# ruff: noqa: F811 -- the fixtures imported from the first Redis file are its parameters
"""A write refusal the connect probe does not see: the relay reconnected at once, claimed,
sent and gave the same batch back, in a hot loop, no attempt counted and no back-off.

- A user whose ACL key patterns cover the streams only (``~orders*``) is refused the
  probe's ``XGROUP CREATE`` on ``outboxer:write-probe:…`` (NOPERM), so it was not probed:
  on a node a failover made a replica every XADD met ``READONLY`` and every connect
  passed. Measured: 1,119 connects and claims in 5 s. Now the probe falls back to an
  ``XADD … 0-0`` on the stream whose XADD was refused (refused before the key is looked
  up: nothing is written), and the connect fails while the node takes no writes.
- Under ``noeviction`` a Redis a little short of full takes the probe and refuses each
  XADD of a larger message (its arguments count as used memory): 85 connects and claims of
  the same 20 rows in 5 s. Now a second refused wave in a row, with nothing taken, holds
  the next connect off, longer each time (0.2 s up to 15 s), the reply named.

Private redis-servers (a primary to make the node a replica of), on free ports.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis.asyncio as aioredis

from outboxer import Outbox, Relay, create_store, load_settings
from outboxer.brokers.redis import RedisPublisher
from outboxer.errors import PublishError
from outboxer.testing import make_message
from tests.integration.test_audit21_brokercfg_redis_write_refusals import (  # noqa: F401
    node,  # fixtures: the private servers, the one under test reset after each test
    servers,
)
from tests.integration.test_http_api import connect_sync


async def _stream_user(node: aioredis.Redis) -> str:
    """A user whose keys are the ``orders*`` streams only (the probe key is not one)."""
    user = f"a21r-{uuid.uuid4().hex[:8]}"
    await node.execute_command("ACL", "SETUSER", user, "on", ">pw", "~orders*", "+@all")
    return user


async def test_a_replica_is_seen_by_a_user_not_allowed_the_probe_key(
    servers: tuple[int, int], node: aioredis.Redis
) -> None:
    user = await _stream_user(node)
    publisher = RedisPublisher(f"redis://{user}:pw@127.0.0.1:{servers[0]}", publish_timeout=5)
    try:
        await publisher.connect()
        await node.replicaof("127.0.0.1", str(servers[1]))
        outcomes = await publisher.publish_batch([make_message("orders", key="a")])
        assert not outcomes[0].attempted and not publisher.connected, outcomes
        # Before: connected at once (the probe refused NOPERM, taken as "not probed").
        with pytest.raises(PublishError, match=r"takes no writes now.*read only replica"):
            await publisher.connect()
        await node.replicaof("NO", "ONE")
        assert await publisher.connect()  # the XADD 0-0 probe wrote nothing
        assert not await node.exists("orders")
        assert (await publisher.publish_batch([make_message("orders", key="a")]))[0].published
    finally:
        await publisher.close()
        await node.execute_command("ACL", "DELUSER", user)


async def test_the_relay_backs_off_from_a_replica_it_cannot_probe(
    servers: tuple[int, int], node: aioredis.Redis, sqlite_url: str
) -> None:
    user = await _stream_user(node)
    conn = connect_sync(sqlite_url)
    for n in range(20):
        Outbox().enqueue(conn, "orders", {"n": n}, key=f"k{n % 4}")
    conn.commit()
    conn.close()
    publisher = RedisPublisher(f"redis://{user}:pw@127.0.0.1:{servers[0]}", publish_timeout=5)
    settings = load_settings({"db": sqlite_url, "poll_interval": 0.2}, environ={})
    relay = Relay(create_store(sqlite_url), {"default": publisher}, settings)
    await node.replicaof("127.0.0.1", str(servers[1]))
    task = asyncio.create_task(relay.run())
    try:
        await asyncio.sleep(2)
        # Before: several hundred (a connect, a claim of the 20 rows, a wave given back).
        assert publisher.stats.connects <= 2, publisher.stats.connects
        assert any("read only replica" in p for p in relay.health_problems())
    finally:
        relay.stop()
        await asyncio.wait_for(task, 10)
        await node.execute_command("ACL", "DELUSER", user)


async def test_a_refusal_the_probe_passes_is_held_off(
    servers: tuple[int, int], node: aioredis.Redis
) -> None:
    publisher = RedisPublisher(f"redis://127.0.0.1:{servers[0]}", publish_timeout=5)
    big = {"pad": "x" * 1_000_000}
    try:
        await publisher.connect()
        used = int((await node.info("memory"))["used_memory"])
        await node.config_set("maxmemory", str(used + 200_000))  # the probe fits, not an XADD
        outcomes = await publisher.publish_batch([make_message("orders", big, key="a")])
        assert not outcomes[0].attempted and "maxmemory" in (outcomes[0].error or ""), outcomes
        assert await publisher.connect()  # the probe passes: it does not tell
        outcomes = await publisher.publish_batch([make_message("orders", big, key="a")])
        assert not outcomes[0].attempted, outcomes
        # Before: connected again at once, every time, for as long as Redis stayed full.
        with pytest.raises(PublishError, match=r"takes no writes now.*maxmemory.*in a row"):
            await publisher.connect()
        await node.config_set("maxmemory", "0")
        await asyncio.sleep(0.3)  # the first hold: 0.2 s +- 25 %
        assert await publisher.connect()
        assert (await publisher.publish_batch([make_message("orders", big, key="a")]))[0].published
    finally:
        await publisher.close()
