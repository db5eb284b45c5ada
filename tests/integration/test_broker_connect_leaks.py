"""A failed connect leaves no connection behind (NATS, MQTT), against the real brokers.

A broker that takes the TCP connection but never answers the handshake (hung, or a
partition between it and a proxy/load balancer that still accepts) makes every one of
the relay's reconnect attempts fail by timeout. Each attempt must close its socket:
before the fix nats-py and aiomqtt left it open (and aiomqtt its housekeeping task
running), one more per attempt, for as long as the outage lasted.

The "hung broker" is ``TcpProxy.blackhole()`` in front of the real server; once the
proxy is restored the same publisher connects and publishes to the real broker.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

from outboxer.brokers.base import OutcomeKind, Publisher
from outboxer.brokers.mqtt import MqttPublisher
from outboxer.brokers.nats import NatsPublisher
from outboxer.errors import BrokerUnavailableError
from outboxer.testing import TcpProxy, make_message
from tests.services import require

ATTEMPTS = 3
_ESTABLISHED = "01"


def open_client_sockets(port: int) -> int:
    """Established TCP connections from this host to 127.0.0.1:``port`` (client side:
    the remote end is the port; the proxy's own accepted ends have it as local port)."""
    count = 0
    for table in (Path("/proc/net/tcp"), Path("/proc/net/tcp6")):
        if not table.exists():
            continue
        for line in table.read_text().splitlines()[1:]:
            fields = line.split()
            remote_port = int(fields[2].rsplit(":", 1)[1], 16)
            if remote_port == port and fields[3] == _ESTABLISHED:
                count += 1
    return count


def misc_loop_tasks() -> int:
    """aiomqtt housekeeping tasks still running (one per client whose socket is open)."""
    return sum(
        1
        for task in asyncio.all_tasks()
        if not task.done() and task.get_coro().__qualname__.endswith("_misc_loop")  # type: ignore[union-attr]
    )


async def fail_connects(publisher: Publisher, proxy: TcpProxy) -> int:
    """Blackhole the proxy, let ``ATTEMPTS`` connects fail; the client sockets left open."""
    await proxy.blackhole()
    for _ in range(ATTEMPTS):
        with pytest.raises(BrokerUnavailableError):
            await publisher.connect()
    await asyncio.sleep(0.3)  # a closed socket leaves ESTABLISHED at once; give the loop a turn
    return open_client_sockets(proxy.port)


async def test_nats_failed_connects_to_a_hung_server_leave_no_socket_open() -> None:
    require("nats")
    proxy = await TcpProxy("127.0.0.1", 4222).start()
    # nats-py's own connect timeout (1 s) ends each attempt, well before publish_timeout.
    publisher = NatsPublisher(f"nats://127.0.0.1:{proxy.port}?connect_timeout=1", publish_timeout=5)
    try:
        assert await fail_connects(publisher, proxy) == 0
        await proxy.restore()
        await publisher.connect()
        [outcome] = await publisher.publish_batch([make_message(f"leak.{uuid.uuid4().hex[:8]}")])
        # No stream listens there: JetStream's "no responders" proves a real round trip.
        assert outcome.kind is OutcomeKind.FAILED and outcome.retryable, outcome
        assert "no JetStream stream" in (outcome.error or "")
    finally:
        await publisher.close()
        await proxy.stop()


async def test_mqtt_failed_connects_to_a_hung_broker_leave_no_socket_or_task() -> None:
    require("mosquitto")
    proxy = await TcpProxy("127.0.0.1", 1883).start()
    # Each attempt ends by the publisher's connect timeout, while aiomqtt awaits the CONNACK.
    publisher = MqttPublisher(f"mqtt://127.0.0.1:{proxy.port}", publish_timeout=1)
    try:
        assert await fail_connects(publisher, proxy) == 0
        assert misc_loop_tasks() == 0
        await proxy.restore()
        await publisher.connect()
        [outcome] = await publisher.publish_batch(
            [make_message(f"outboxer-test/leak/{uuid.uuid4().hex[:8]}")]
        )
        assert outcome.kind is OutcomeKind.PUBLISHED, outcome
    finally:
        await publisher.close()
        await proxy.stop()
