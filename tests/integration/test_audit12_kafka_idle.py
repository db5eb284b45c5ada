"""KafkaReceiver.idle() (``exit_when_idle``) on librdkafka's mock cluster with a slow broker:
idle means every assigned partition caught up (or none assigned), never "nothing came for a
while", and never during a rebalance (from a revoke to the next assignment)."""

from __future__ import annotations

import ctypes
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from outboxer.brokers.kafka import KafkaPublisher
from outboxer.receivers import create_receiver
from outboxer.receivers.base import Receiver
from outboxer.testing import make_message
from tests.integration.test_kafka_audit_receiver import MockCluster, one_partition_topic


@pytest.fixture
def cluster() -> Iterator[MockCluster]:
    mock = MockCluster()  # one per test: the round-trip time set is the broker's
    if mock._handle is None:
        mock.stop()
        pytest.skip("this librdkafka exposes no mock cluster API")
    yield mock
    mock.stop()


def set_rtt(cluster: MockCluster, milliseconds: int) -> None:
    """Every answer of the mock broker (id 1) comes ``milliseconds`` late."""
    handle = cluster._handle
    assert handle is not None
    lib = handle.lib
    lib.rd_kafka_handle_mock_cluster.argtypes = [ctypes.c_void_p]
    lib.rd_kafka_handle_mock_cluster.restype = ctypes.c_void_p
    lib.rd_kafka_mock_broker_set_rtt.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int]
    mock = lib.rd_kafka_handle_mock_cluster(handle.handle)
    assert lib.rd_kafka_mock_broker_set_rtt(mock, 1, milliseconds) == 0


def slow_receiver(bootstrap: str, group: str, topic: str) -> Receiver:
    # A session longer than a few round trips: heartbeats answered late must not evict.
    url = f"kafka://{bootstrap}?session.timeout.ms=10000&heartbeat.interval.ms=500"
    return create_receiver(url, group=group, topics=[topic])


async def test_a_partition_not_yet_fetched_is_not_idle_behind_a_slow_broker(
    cluster: MockCluster,
) -> None:
    """Three records wait; the broker answers 1.2 s late, so after the assignment the offset
    lookups and the first fetch take seconds. idle() said True 2 s after the assignment with
    nothing received: exit_when_idle exited with the partition unread."""
    topic = one_partition_topic(cluster)
    batch = [make_message(topic, {"n": n}, key=f"k{n}") for n in range(3)]
    async with KafkaPublisher(f"kafka://{cluster.bootstrap}") as publisher:
        assert all(o.published for o in await publisher.publish_batch(batch))
    set_rtt(cluster, 1200)
    receiver = slow_receiver(cluster.bootstrap, f"g-{uuid.uuid4().hex[:8]}", topic)
    await receiver.connect()
    got: list[Any] = []
    idle_early = 0
    try:
        deadline = time.monotonic() + 40
        while len(got) < 3 and time.monotonic() < deadline:
            received = await receiver.receive(10, 0.05)
            got.extend(received)
            if not received and len(got) < 3 and receiver.idle():
                idle_early += 1
        assert len(got) == 3
        assert idle_early == 0, f"idle() said True {idle_early} times with records unread"
        await receiver.ack(got)
        while not receiver.idle() and time.monotonic() < deadline:
            await receiver.receive(10, 0.05)
        assert receiver.idle(), "caught up: idle"
    finally:
        set_rtt(cluster, 0)
        await receiver.close()


async def test_a_member_is_not_idle_while_a_rebalance_is_in_progress(
    cluster: MockCluster,
) -> None:
    """A caught-up member loses its partition to a rebalance (a second member joins) that takes
    seconds (the broker answers 1.5 s late). From the revoke to the next assignment nobody
    knows what the member will own: idle() said True 2 s after the revoke, and with
    exit_when_idle the member left mid-rebalance."""
    topic = one_partition_topic(cluster)
    group = f"g-{uuid.uuid4().hex[:8]}"
    a = slow_receiver(cluster.bootstrap, group, topic)
    events: list[str] = []
    on_revoke, on_assign = a._on_revoke, a._on_assign  # type: ignore[attr-defined]

    def revoked(consumer: Any, partitions: Any) -> None:
        events.append("revoke")
        on_revoke(consumer, partitions)

    def assigned(consumer: Any, partitions: Any) -> None:
        on_assign(consumer, partitions)
        events.append("assign")

    a._on_revoke, a._on_assign = revoked, assigned  # type: ignore[attr-defined]
    b = slow_receiver(cluster.bootstrap, group, topic)
    await a.connect()
    try:
        deadline = time.monotonic() + 40
        while not a.idle() and time.monotonic() < deadline:
            await a.receive(10, 0.05)
        assert a.idle() and events == ["assign"], events
        set_rtt(cluster, 1500)
        await b.connect()
        idle_mid_rebalance = 0
        while events[-2:] != ["revoke", "assign"] and time.monotonic() < deadline:
            received = await a.receive(10, 0.05)
            await b.receive(10, 0.01)
            if not received and events[-1] == "revoke" and a.idle():
                idle_mid_rebalance += 1
        assert events[-2:] == ["revoke", "assign"], events
        assert idle_mid_rebalance == 0, f"idle() said True {idle_mid_rebalance} times mid-rebalance"
    finally:
        set_rtt(cluster, 0)
        await b.close()
        await a.close()
