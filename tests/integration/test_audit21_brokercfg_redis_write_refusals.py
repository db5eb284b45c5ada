"""Redis servers configured otherwise than outboxer assumed: private redis-servers (started
here, on free ports, module-scoped) whose settings the tests change.

- A failover that makes the node the relay is connected to a replica: every XADD met
  ``READONLY`` on the same connection, for ever, each one charged an attempt (ten by
  default: every message abandoned within minutes). Now the wave's messages come back
  unsent, the publisher reconnects, and the connect fails (an outage, backed off) while
  the node takes no writes.
- ``maxmemory`` with ``noeviction``, Redis full: XADD met ``OOM``, charged the same. Now
  the same as a replica. The consumer could not reconnect at all (XGROUP CREATE is refused
  out of memory even for a group that exists) while XREADGROUP and XACK still work: now
  it does.
- ``maxmemory`` with an ``allkeys-*`` policy evicts whole streams, groups included, with
  no word: now the publisher warns at connect, and the receiver's warning for a group
  gone says how many keys Redis evicted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as aioredis
from redis import exceptions as rexc

from outboxer.brokers.redis import RedisPublisher
from outboxer.errors import BrokerUnavailableError, ConfigError, PublishError
from outboxer.receivers import create_receiver
from outboxer.receivers.base import Incoming
from outboxer.testing import make_message
from tests.services import free_port


def _start(directory: str) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    server = subprocess.Popen(
        [
            *("redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""),
            *("--appendonly", "no", "--dir", directory),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return server, port
        except OSError:
            assert time.monotonic() < deadline and server.poll() is None, "no redis-server"
            time.sleep(0.05)


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[int, int]]:
    """Two private servers: the one under test, and a primary to make it a replica of."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    with tempfile.TemporaryDirectory() as first, tempfile.TemporaryDirectory() as second:
        started = [_start(first)]
        try:
            started.append(_start(second))
            yield started[0][1], started[1][1]
        finally:
            for server, _ in started:
                server.terminate()
                server.wait(10)


@pytest.fixture
async def node(servers: tuple[int, int]) -> AsyncIterator[aioredis.Redis]:
    """The server under test, as a writable primary with no memory limit, emptied after."""
    client = aioredis.Redis(port=servers[0])
    try:
        yield client
    finally:
        await client.replicaof("NO", "ONE")
        await client.config_set("maxmemory", "0")
        await client.config_set("maxmemory-policy", "noeviction")
        await client.flushall()
        await client.aclose()


async def test_a_node_demoted_to_replica_charges_no_attempt_and_is_left(
    servers: tuple[int, int], node: aioredis.Redis
) -> None:
    publisher = RedisPublisher(f"redis://127.0.0.1:{servers[0]}", publish_timeout=5)
    async with publisher:
        assert (await publisher.publish_batch([make_message("orders", key="a")]))[0].published
        await node.replicaof("127.0.0.1", str(servers[1]))  # a failover: now a replica
        outcomes = await publisher.publish_batch(
            [make_message("orders", key="a"), make_message("orders", key="b")]
        )
        assert [o.published for o in outcomes] == [False, False]
        assert all(not o.attempted and o.retryable for o in outcomes), outcomes
        assert "read only replica" in (outcomes[0].error or "")
        # Not the same connection again: the relay reconnects, and while the node is a
        # replica the connect fails (an outage, backed off; no message claimed for it).
        assert not publisher.connected
        with pytest.raises(PublishError, match=r"takes no writes now.*read only replica") as info:
            await publisher.connect()
        assert info.value.retryable
        await node.replicaof("NO", "ONE")
        assert await publisher.connect()
        assert (await publisher.publish_batch([make_message("orders", key="a")]))[0].published


async def test_out_of_memory_charges_no_attempt_and_the_consumer_still_reads(
    servers: tuple[int, int], node: aioredis.Redis
) -> None:
    url = f"redis://127.0.0.1:{servers[0]}"
    stream, group = f"oom-{uuid.uuid4().hex[:8]}", "g"
    receiver = create_receiver(url, group=group, topics=[stream], name="c1")
    publisher = RedisPublisher(url, publish_timeout=5)
    try:
        async with publisher:
            sent = [make_message(stream, {"n": n}, key="k") for n in range(3)]
            assert all(o.published for o in await publisher.publish_batch(sent))
            await receiver.connect()  # creates the group
            await receiver.close()
            await node.config_set("maxmemory", "1")  # full, whatever the stream holds
            outcomes = await publisher.publish_batch([make_message(stream, key="k")])
            assert not outcomes[0].published and not outcomes[0].attempted, outcomes
            assert "maxmemory" in (outcomes[0].error or "")
            assert not publisher.connected
            with pytest.raises(PublishError, match=r"takes no writes now.*maxmemory"):
                await publisher.connect()
        # The consumer restarts while Redis is full: its group exists, it reads and acks.
        await receiver.connect()
        got: list[Incoming] = []
        deadline = asyncio.get_running_loop().time() + 5
        while len(got) < 3 and asyncio.get_running_loop().time() < deadline:
            got += await receiver.receive(10, 0.2)
        assert [i.delivery.id for i in got] == [m.id for m in sent]
        await receiver.ack(got)
        assert receiver.stats.failed_acks == 0
        assert (await node.xpending(stream, group))["pending"] == 0
    finally:
        await receiver.close()


async def test_an_evicting_policy_is_said_at_connect_and_when_a_group_is_gone(
    servers: tuple[int, int], node: aioredis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    url = f"redis://127.0.0.1:{servers[0]}"
    stream = f"evict-{uuid.uuid4().hex[:8]}"
    await node.config_set("maxmemory-policy", "allkeys-lru")
    await node.config_set("maxmemory", "100mb")
    receiver = create_receiver(url, group="g", topics=[stream], name="c1")
    try:
        with caplog.at_level(logging.WARNING):
            async with RedisPublisher(url, publish_timeout=5) as publisher:
                said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
                assert any("allkeys-lru" in m and "evict" in m for m in said), said
                lost = make_message(stream, {"n": 0}, key="k")
                assert (await publisher.publish_batch([lost]))[0].published
                await receiver.connect()
                await node.config_set("maxmemory", "1")  # Redis evicts every key it holds
                with contextlib.suppress(rexc.OutOfMemoryError):  # all gone, still full
                    await node.set("trigger", "x")  # (a write makes it evict)
                await node.config_set("maxmemory", "0")
                assert not await node.exists(stream)
                later = make_message(stream, {"n": 1}, key="k")
                assert (await publisher.publish_batch([later]))[0].published
            with pytest.raises(BrokerUnavailableError, match="NOGROUP"):
                await receiver.receive(10, 0.2)
            caplog.clear()
            await receiver.connect()
        said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(said) == 1 and "evicted" in said[0] and "allkeys-lru" in said[0], said
        got = await receiver.receive(10, 0.5)
        assert [i.delivery.id for i in got] == [later.id]
    finally:
        await receiver.close()


async def test_an_acl_without_a_consumer_command_is_refused_at_connect(
    servers: tuple[int, int], node: aioredis.Redis
) -> None:
    """Before: connected, then every receive failed NOPERM on XAUTOCLAIM as a lost
    connection, reconnected and failed again, for ever, the entry never applied."""
    user = f"a21-{uuid.uuid4().hex[:8]}"
    await node.execute_command(
        "ACL", "SETUSER", user, "on", ">pw", "~*", "&*", "+@all", "-xautoclaim"
    )
    url = f"redis://{user}:pw@127.0.0.1:{servers[0]}"
    receiver = create_receiver(url, group="g", topics=["acl"], name="c1")
    try:
        async with RedisPublisher(url, publish_timeout=5) as publisher:
            assert (await publisher.publish_batch([make_message("acl", key="a")]))[0].published
        with pytest.raises(ConfigError, match="may not run XAUTOCLAIM on 'acl'"):
            await receiver.connect()
        assert not receiver.connected
    finally:
        await receiver.close()
        await node.execute_command("ACL", "DELUSER", user)
