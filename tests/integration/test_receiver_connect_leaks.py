"""A failed connect of the NATS receiver leaves no socket behind, against the real server
behind a proxy that takes TCP connections and never answers (see
test_broker_connect_leaks.py for the publishers)."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from outboxer.errors import BrokerUnavailableError
from outboxer.receivers import create_receiver
from outboxer.testing import TcpProxy
from tests.integration.test_broker_connect_leaks import (
    ATTEMPTS,
    misc_loop_tasks,
    open_client_sockets,
)
from tests.services import require


async def test_nats_receiver_failed_connects_to_a_hung_server_leave_no_socket_open() -> None:
    require("nats")
    proxy = await TcpProxy("127.0.0.1", 4222).start()
    topic = f"leak-{uuid.uuid4().hex[:8]}"
    receiver = create_receiver(
        f"nats://127.0.0.1:{proxy.port}?connect_timeout=1", group="g", topics=[topic]
    )
    try:
        await proxy.blackhole()
        for _ in range(ATTEMPTS):
            with pytest.raises(BrokerUnavailableError):
                await receiver.connect()
        await asyncio.sleep(0.3)  # a closed socket leaves ESTABLISHED at once
        assert open_client_sockets(proxy.port) == 0
    finally:
        await receiver.close()
        await proxy.stop()


async def test_mqtt_receiver_failed_connects_to_a_hung_broker_leave_no_socket_or_task() -> None:
    require("mosquitto")
    proxy = await TcpProxy("127.0.0.1", 1883).start()
    topic = f"leak-{uuid.uuid4().hex[:8]}"
    receiver = create_receiver(
        f"mqtt://127.0.0.1:{proxy.port}", group="g", topics=[topic], connect_timeout=1
    )
    try:
        await proxy.blackhole()
        for _ in range(ATTEMPTS):
            with pytest.raises(BrokerUnavailableError):
                await receiver.connect()
        await asyncio.sleep(0.3)
        assert open_client_sockets(proxy.port) == 0
        assert misc_loop_tasks() == 0
    finally:
        await receiver.close()
        await proxy.stop()
