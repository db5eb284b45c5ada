"""A broker that drops the connection while its publisher is idle (no publish under way).

``Publisher.connected`` used to change only once a publish failed: after an idle drop the
relay claimed rows on the dead connection, RabbitMQ and Redis failed them as attempted
(an attempt used up, the row held back for its retry back-off) and ``/health`` said
"ok" for as long as nothing was due. Now each adapter that can tell without I/O says
so at once, ``connect()`` opens a new connection in place of the dead one, and a batch
published meanwhile goes back untried (NotSent).

The broker is "dropped" through a FaultProxy: its connections are cut and new ones are
refused (the proxy forwards to a closed port) until it forwards to the broker again.
"""

from __future__ import annotations

import socket
import uuid
from collections.abc import Iterator

import pytest

from outboxer.brokers import create_publisher
from outboxer.brokers.base import OutcomeKind, Publisher
from outboxer.testing import eventually, make_message
from tests.chaos.proxy import FaultProxy
from tests.services import require

#: service name, its port, the publisher URL through the proxy (``{port}``).
BROKERS = {
    "rabbitmq": (5672, "amqp://guest:guest@127.0.0.1:{port}/?exchange=audit5-conn-{tag}"),
    "redis": (6379, "redis://127.0.0.1:{port}/0?stream_prefix=audit5-conn-{tag}-"),
    "nats": (4222, "nats://127.0.0.1:{port}"),
    "mosquitto": (1883, "mqtt://127.0.0.1:{port}?topic_prefix=audit5-conn-{tag}/"),
}


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Dropper:
    """A FaultProxy in front of a shared broker that can drop it and bring it back."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.proxy = FaultProxy(port).start()

    def drop(self) -> None:
        self.proxy.target_port = closed_port()  # new connections are refused…
        self.proxy.cut()  # …and the open ones reset

    def restore(self) -> None:
        self.proxy.target_port = self.port


@pytest.fixture(params=list(BROKERS))
def broker(request: pytest.FixtureRequest) -> Iterator[tuple[Dropper, str]]:
    name: str = request.param
    require(name)
    port, url = BROKERS[name]
    dropper = Dropper(port)
    yield dropper, url.format(port=dropper.proxy.port, tag=uuid.uuid4().hex[:8])
    dropper.proxy.stop()


async def gone(publisher: Publisher) -> bool:
    return not publisher.connected


async def test_an_idle_drop_is_seen_and_the_next_batch_goes_back_untried(
    broker: tuple[Dropper, str],
) -> None:
    dropper, url = broker
    publisher = create_publisher(url, publish_timeout=2)
    try:
        assert await publisher.connect()
        assert not await publisher.connect(), "connected: connect() leaves it alone"
        dropper.drop()
        await eventually(lambda: gone(publisher), timeout=2)
        batch = [make_message("t", key="k"), make_message("t", key="k"), make_message("u")]
        outcomes = await publisher.publish_batch(batch)
        assert [(o.kind, o.attempted) for o in outcomes] == [(OutcomeKind.FAILED, False)] * 3, (
            outcomes
        )
        dropper.restore()
        assert await publisher.connect(), "the dead connection is replaced"
        assert publisher.connected and publisher.stats.connects == 2
        assert not await publisher.connect(), "and then left alone: no reconnect loop"
    finally:
        await publisher.close()
