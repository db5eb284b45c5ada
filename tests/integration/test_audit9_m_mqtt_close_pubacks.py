"""A graceful close of the MQTT receiver: every PUBACK sent before it is taken by the broker.

paho counts the connection closed once the DISCONNECT is written; Mosquitto reads one
packet per socket per turn of its loop, so the PUBACKs may still wait unread in its socket
when the client (or its restart, same client id) connects again. The new connection takes
the session over, the old socket is dropped with what it held, and the session redelivers
the messages whose PUBACK was lost. A delaying proxy on the closing connection makes that
certain: the PUBACKs arrive after the next connection took over."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from outboxer.brokers import create_publisher
from outboxer.receivers import create_receiver
from outboxer.testing import make_message
from tests.chaos.proxy import FaultProxy
from tests.integration.test_receiver_audit_mqtt import collect
from tests.services import require


@pytest.fixture
def proxy() -> Iterator[FaultProxy]:
    require("mosquitto")
    proxy = FaultProxy(1883).start()
    yield proxy
    proxy.stop()


async def test_pubacks_written_before_a_close_are_taken_before_the_next_connection(
    proxy: FaultProxy,
) -> None:
    topic = f"audit9/{uuid.uuid4().hex[:10]}"
    group, client_id = f"g{uuid.uuid4().hex[:8]}", f"audit9-{uuid.uuid4().hex[:8]}"
    options = f"session_expiry=60&client_id={client_id}"
    slow = create_receiver(f"mqtt://127.0.0.1:{proxy.port}?{options}", group=group, topics=[topic])
    direct = create_receiver(f"mqtt://127.0.0.1:1883?{options}", group=group, topics=[topic])
    async with create_publisher("mqtt://127.0.0.1:1883") as publisher:
        await slow.connect()
        try:
            await publisher.publish_batch([make_message(topic, {"n": n}) for n in range(3)])
            received = await collect(slow, 3)
            assert [i.delivery.payload["n"] for i in received] == [0, 1, 2]
            proxy.delay(0.3)  # the PUBACKs reach the broker late
            await slow.ack(received)
        finally:
            await slow.close()
        # The same client id again at once, as a restarted consumer: the old connection's
        # PUBACKs must have been taken already.
        await direct.connect()
        try:
            await publisher.publish_batch([make_message(topic, {"n": 99})])
            seen: list[int] = []
            while 99 not in seen:
                batch = await direct.receive(10, 5.0)
                assert batch, "the marker never came"
                seen += [i.delivery.payload["n"] for i in batch]
            assert seen == [99]  # nothing redelivered before it
        finally:
            await direct.close()
