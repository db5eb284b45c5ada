"""A message longer than the Redis server's ``proto-max-bulk-len``: a private redis-server
(started here, on a free port, with the limit at its 1 MiB minimum).

Redis answers an argument over the limit with a protocol error and closes the connection.
Before, the whole wave failed as a lost connection (retryable, attempted), the relay
reconnected, and the next batch failed the same: the message and its wave-mates used up
their attempts together. Now the message alone fails, for good, before anything is sent.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator

import pytest

from outboxer.brokers.base import OutcomeKind
from outboxer.brokers.redis import RedisPublisher
from outboxer.testing import make_message
from tests.chaos.servers import free_port

MIB = 1024 * 1024


@pytest.fixture
def small_redis() -> Iterator[int]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    port = free_port()
    server = subprocess.Popen(
        [
            *("redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""),
            *("--appendonly", "no", "--proto-max-bulk-len", "1mb"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and server.poll() is None, "no redis-server"
                time.sleep(0.05)
        yield port
    finally:
        server.terminate()
        server.wait(10)


async def test_a_message_over_proto_max_bulk_len_fails_alone_for_good(small_redis: int) -> None:
    publisher = RedisPublisher(f"redis://127.0.0.1:{small_redis}", publish_timeout=10)
    async with publisher:
        batch = [
            make_message("big", b"x" * (2 * MIB), key="a"),
            make_message("big", {"n": 2}, key="a"),  # after it in its key: skipped
            *(make_message("ok", {"n": n}, key=f"k{n}") for n in range(5)),
        ]
        outcomes = await publisher.publish_batch(batch)
        assert outcomes[0].kind is OutcomeKind.FAILED and not outcomes[0].retryable
        assert "proto-max-bulk-len" in (outcomes[0].error or "")
        assert outcomes[1].kind is OutcomeKind.SKIPPED
        assert [o.kind for o in outcomes[2:]] == [OutcomeKind.PUBLISHED] * 5, outcomes
        # The connection stayed up: no reconnect for a message at fault.
        assert publisher.connected and publisher.stats.connects == 1
        # At the limit exactly, Redis takes it.
        [fits] = await publisher.publish_batch([make_message("big", b"y" * MIB)])
        assert fits.published, fits
    assert publisher.bulk_limit == MIB  # read from the server at connect


async def test_a_refused_config_get_assumes_redis_default(small_redis: int) -> None:
    from outboxer.brokers.redis import DEFAULT_BULK_LIMIT  # new with the fix

    admin = RedisPublisher(f"redis://127.0.0.1:{small_redis}")
    async with admin:
        assert admin._client is not None
        await admin._client.execute_command(
            "ACL", "SETUSER", "pub", "on", ">pw", "~*", "+@all", "-config"
        )
    publisher = RedisPublisher(f"redis://pub:pw@127.0.0.1:{small_redis}")
    async with publisher:
        assert publisher.bulk_limit == DEFAULT_BULK_LIMIT
        [outcome] = await publisher.publish_batch([make_message("ok")])
        assert outcome.published, outcome
