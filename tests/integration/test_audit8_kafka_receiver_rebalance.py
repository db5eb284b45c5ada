"""KafkaReceiver across a rebalance: two members of one group on librdkafka's mock cluster."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Iterator

import pytest

from outboxer.brokers.kafka import KafkaPublisher
from outboxer.receivers.base import Incoming, Receiver
from outboxer.testing import make_message
from tests.integration.test_kafka_audit_receiver import (
    MockCluster,
    committed_all,
    make_receiver,
    one_partition_topic,
    topic_of,
)


@pytest.fixture(scope="module")
def cluster() -> Iterator[MockCluster]:
    mock = MockCluster()
    if mock._handle is None:
        mock.stop()
        pytest.skip("this librdkafka exposes no mock cluster API")
    one_partition_topic(mock)  # sets the ctypes signatures topic_of uses
    yield mock
    mock.stop()


def partition(incoming: Incoming) -> int:
    where, _offset, _epoch = incoming.token
    return int(where[1])


async def until(
    receiver: Receiver, done: Callable[[list[Incoming]], bool], timeout: float = 20.0
) -> list[Incoming]:
    """What ``receiver`` hands over until ``done(received so far)`` holds."""
    got: list[Incoming] = []
    deadline = time.monotonic() + timeout
    while not done(got) and time.monotonic() < deadline:
        got += await receiver.receive(100, 0.2)
    return got


async def test_messages_of_a_revoked_partition_waiting_for_the_runner_are_not_handed_over(
    cluster: MockCluster,
) -> None:
    """A's polling thread had fetched both partitions' messages, waiting for the runner, when
    B joined and took one partition. A still handed them all to its runner: A applied the
    partition B now owned, racing B's copies (each member's transactions waiting on the
    other's inbox rows), and the partition A kept came twice, its stale copies first."""
    topic = topic_of(cluster, 2)
    batch = [make_message(topic, {"n": n}, key=f"k{n}") for n in range(40)]
    async with KafkaPublisher(f"kafka://{cluster.bootstrap}") as publisher:
        assert all(o.published for o in await publisher.publish_batch(batch))
    group = f"g-{uuid.uuid4().hex[:8]}"
    a = make_receiver(cluster.bootstrap, group, topic)
    b = make_receiver(cluster.bootstrap, group, topic)
    await a.connect()
    try:
        deadline = time.monotonic() + 10
        while a._waiting < len(batch) and time.monotonic() < deadline:  # type: ignore[attr-defined]
            await asyncio.sleep(0.02)  # fetched by A's thread, not yet taken by its runner
        assert a._waiting == len(batch)  # type: ignore[attr-defined]
        await b.connect()
        try:
            from_b = await until(b, bool)  # B has its partition: A's revoke ran before
            [b_part] = {partition(i) for i in from_b}
            from_a: list[Incoming] = []
            everything = {m.id for m in batch}
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                from_a += await a.receive(100, 0.1)
                from_b += await b.receive(100, 0.1)
                if {i.delivery.id for i in from_a + from_b} == everything:
                    break
            assert b_part not in {partition(i) for i in from_a}, "B's partition handed to A"
            assert len({i.delivery.id for i in from_a}) == len(from_a), "handed over twice"
            assert {i.delivery.id for i in from_a + from_b} == everything
            await a.ack(from_a)
            await b.ack(from_b)
            assert a.stats.stale_acks == b.stats.stale_acks == 0
            # Both members still in: a member leaving starts a rebalance, during which the
            # mock coordinator refuses every commit.
            expected = [sum(partition(i) == p for i in from_a + from_b) for p in (0, 1)]
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                done = await asyncio.to_thread(committed_all, cluster.bootstrap, group, topic, 2)
                if done == expected:
                    break
            assert done == expected, "every message applied, by one member or the other"
        finally:
            await b.close()
    finally:
        await a.close()
