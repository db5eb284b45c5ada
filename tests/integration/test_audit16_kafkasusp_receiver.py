"""KafkaReceiver ``suspect_window`` on librdkafka's mock cluster: the first N messages of a
partition under each assignment of it come marked ``redelivered`` (suspects), the later ones
not; a new assignment (a reconnect, a rebalance) starts the window again; 0 (the default)
marks none. Kafka carries no redelivered flag, so without it a message that kills the
consumer came first again after every restart, for ever."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import pytest
from confluent_kafka import Consumer, TopicPartition

from outboxer.brokers.kafka import KafkaPublisher
from outboxer.errors import ConfigError
from outboxer.receivers import create_receiver
from outboxer.receivers.base import Incoming, Receiver
from outboxer.testing import make_message
from tests.integration.test_broker_kafka import quiet
from tests.integration.test_kafka_audit_receiver import MockCluster, one_partition_topic


def receiver(cluster: MockCluster, group: str, topic: str, query: str = "") -> Receiver:
    url = f"kafka://{cluster.bootstrap}?session.timeout.ms=2000&heartbeat.interval.ms=200{query}"
    return create_receiver(url, group=group, topics=[topic])


async def publish(cluster: MockCluster, topic: str, numbers: range) -> None:
    async with KafkaPublisher(f"kafka://{cluster.bootstrap}") as publisher:
        outcomes = await publisher.publish_batch(
            [make_message(topic, {"n": n}, key=f"k{n}") for n in numbers]
        )
    assert all(outcome.published for outcome in outcomes), outcomes


async def until(
    member: Receiver, done: Callable[[list[Incoming]], bool], timeout: float = 8.0
) -> list[Incoming]:
    got: list[Incoming] = []
    deadline = time.monotonic() + timeout
    while not done(got) and time.monotonic() < deadline:
        got += await member.receive(100, 0.1)
    assert done(got), f"only {len(got)} received"
    return got


def partition_of(incoming: Incoming) -> int:
    (_topic, partition), _offset, _epoch = incoming.token
    return int(partition)


def flags(got: list[Incoming]) -> list[tuple[int, bool]]:
    return [(incoming.delivery.payload["n"], incoming.redelivered) for incoming in got]


def committed_all(cluster: MockCluster, group: str, topic: str, partitions: int) -> list[int]:
    consumer = Consumer(
        {"bootstrap.servers": cluster.bootstrap, "group.id": group, "logger": quiet}
    )
    try:
        wanted = [TopicPartition(topic, p) for p in range(partitions)]
        return [int(tp.offset) for tp in consumer.committed(wanted, timeout=5)]
    finally:
        consumer.close()


def until_committed(cluster: MockCluster, group: str, topic: str, offsets: list[int]) -> None:
    deadline = time.monotonic() + 8
    while committed_all(cluster, group, topic, len(offsets)) != offsets:
        assert time.monotonic() < deadline, "the acks were never committed"
        time.sleep(0.05)


async def test_the_first_messages_of_each_assignment_are_suspects(cluster: MockCluster) -> None:
    topic = one_partition_topic(cluster, prefix="susp")
    group = f"g-{uuid.uuid4().hex[:8]}"
    await publish(cluster, topic, range(6))
    member = receiver(cluster, group, topic, "&suspect_window=3")
    await member.connect()
    try:
        got = await until(member, lambda got: len(got) == 6)
        assert flags(got) == [(0, True), (1, True), (2, True), (3, False), (4, False), (5, False)]
        await member.ack(got[:4])  # offsets 0-3 done: the group reads on from 4
        until_committed(cluster, group, topic, [4])
    finally:
        await member.close()
    await publish(cluster, topic, range(6, 8))
    # A new assignment (here a restart): 4 and 5, received and never acked, then 6, are
    # suspects (the last process may have died of one), 7 is not.
    await member.connect()
    try:
        got = await until(member, lambda got: len(got) == 4)
        assert flags(got) == [(4, True), (5, True), (6, True), (7, False)]
    finally:
        await member.close()


async def test_a_rebalance_starts_the_window_again(cluster: MockCluster) -> None:
    """A second member joining: the eager (default) assignor revokes every partition and
    assigns them again, so the first member's window starts again on the one it keeps."""
    topic = one_partition_topic(cluster, partitions=2, prefix="susp")
    group = f"g-{uuid.uuid4().hex[:8]}"
    a = receiver(cluster, group, topic, "&suspect_window=1")
    b = receiver(cluster, group, topic, "&suspect_window=1")
    await a.connect()
    try:
        await publish(cluster, topic, range(20))
        got = await until(a, lambda got: len(got) == 20)
        # One suspect per partition: its first message.
        assert sum(incoming.redelivered for incoming in got) == 2
        await a.ack(got)
        # Committed before B joins: read again after the rebalance, they would fill the window.
        ends = [sum(partition_of(i) == p for i in got) for p in (0, 1)]
        until_committed(cluster, group, topic, ends)
        await b.connect()
        try:
            deadline = time.monotonic() + 15
            while not (a.idle() and b.idle() and len(b._partitions) == 1):  # type: ignore[attr-defined]
                assert time.monotonic() < deadline, "no rebalance"
                await a.receive(100, 0.05)
                await b.receive(100, 0.05)
            await publish(cluster, topic, range(20, 60))
            after_a = await until(a, lambda got: sum(not i.redelivered for i in got) > 0)
            after_b = await until(b, lambda got: sum(not i.redelivered for i in got) > 0)
            # Each member's first message of its partition since the rebalance is a suspect
            # (A's too, on the partition it kept: assigned again), the next ones are not.
            assert [i.redelivered for i in after_a[:2]] == [True, False]
            assert [i.redelivered for i in after_b[:2]] == [True, False]
            assert {partition_of(i) for i in after_a} != {partition_of(i) for i in after_b}
        finally:
            await b.close()
    finally:
        await a.close()


async def test_off_by_default(cluster: MockCluster) -> None:
    topic = one_partition_topic(cluster, prefix="susp")
    await publish(cluster, topic, range(3))
    member = receiver(cluster, f"g-{uuid.uuid4().hex[:8]}", topic)
    assert member.suspect_window == 0  # type: ignore[attr-defined]
    await member.connect()
    try:
        got = await until(member, lambda got: len(got) == 3)
        assert flags(got) == [(0, False), (1, False), (2, False)]
    finally:
        await member.close()


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("-1", "suspect_window must be between 0 and"),
        ("three", "suspect_window must be a whole number"),
        ("1.5", "suspect_window must be a whole number"),
    ],
)
def test_a_bad_window_is_refused_at_construction(value: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        create_receiver(f"kafka://h:9092?suspect_window={value}", group="g", topics=["t"])
    with pytest.raises(ConfigError, match=says):
        create_receiver("kafka://h:9092", group="g", topics=["t"], suspect_window=value)


def test_the_window_comes_from_the_url_or_a_keyword() -> None:
    from_url = create_receiver("kafka://h:9092?suspect_window=7", group="g", topics=["t"])
    assert from_url.suspect_window == 7  # type: ignore[attr-defined]
    assert "suspect_window" not in from_url.config  # type: ignore[attr-defined]
    keyword = create_receiver("kafka://h:9092", group="g", topics=["t"], suspect_window=5)
    assert keyword.suspect_window == 5  # type: ignore[attr-defined]
