"""KafkaReceiver.idle() (``exit_when_idle``) with ``partition.assignment.strategy=
cooperative-sticky``, on librdkafka's mock cluster: a partition handed from one member to
another is owned by neither for a whole rebalance round (the member giving it up gets
``revoke [p]`` then ``assign []``; the other gets it only in the next round), and neither
member may be idle meanwhile."""

from __future__ import annotations

import time
import uuid
from typing import Any

from outboxer.brokers.kafka import KafkaPublisher
from outboxer.receivers import create_receiver
from outboxer.receivers.base import Incoming, Receiver
from outboxer.testing import make_message
from tests.integration.test_broker_kafka import MockCluster
from tests.integration.test_kafka_audit_receiver import one_partition_topic


def two_partition_topic(cluster: MockCluster) -> str:
    return one_partition_topic(cluster, partitions=2, prefix="coop")


def cooperative_receiver(bootstrap: str, group: str, topic: str) -> Receiver:
    # The mock cluster's rebalance rounds last about the session timeout: short ones.
    url = (
        f"kafka://{bootstrap}?session.timeout.ms=2000&heartbeat.interval.ms=200"
        "&partition.assignment.strategy=cooperative-sticky"
    )
    return create_receiver(url, group=group, topics=[topic])


def partition_of(incoming: Incoming) -> int:
    (_topic, partition), _offset, _epoch = incoming.token
    return int(partition)


async def test_no_member_is_idle_while_a_partition_is_handed_over(cluster: MockCluster) -> None:
    """Member A owns both partitions and has read (not yet applied) their 20 records; B joins.
    A gives up a partition (revoke, then an empty incremental assign) and B gets it a round
    later: in between, A (its other partition caught up) and B (nothing assigned yet) both
    said idle() for ~1 s, and with exit_when_idle both left, the partition's records unread."""
    topic = two_partition_topic(cluster)
    batch = [make_message(topic, {"n": n}, key=f"k{n}") for n in range(20)]
    async with KafkaPublisher(f"kafka://{cluster.bootstrap}") as publisher:
        assert all(o.published for o in await publisher.publish_batch(batch))
    group = f"g-{uuid.uuid4().hex[:8]}"
    a = cooperative_receiver(cluster.bootstrap, group, topic)
    b = cooperative_receiver(cluster.bootstrap, group, topic)
    revoked: list[int] = []
    on_revoke = a._on_revoke  # type: ignore[attr-defined]

    def revoke(consumer: Any, partitions: Any) -> None:
        revoked.extend(tp.partition for tp in partitions)
        on_revoke(consumer, partitions)

    a._on_revoke = revoke  # type: ignore[attr-defined]
    await a.connect()
    try:
        deadline = time.monotonic() + 40
        read_by_a: list[Incoming] = []
        while not a.idle() and time.monotonic() < deadline:
            read_by_a.extend(await a.receive(50, 0.05))
        assert a.idle() and len(read_by_a) == 20
        per_partition = {p: [i for i in read_by_a if partition_of(i) == p] for p in (0, 1)}
        assert per_partition[0] and per_partition[1], "records on both partitions"
        await b.connect()
        read_by_b: list[Incoming] = []
        both_idle_unread = 0
        a_busy = False
        while time.monotonic() < deadline:
            await a.receive(50, 0.02)  # unacked: a revoked partition's records are B's
            got = await b.receive(50, 0.02)
            read_by_b.extend(got)
            await b.ack(got)
            handed = bool(revoked) and len(read_by_b) >= len(per_partition[revoked[0]])
            a_idle, b_idle = a.idle(), b.idle()
            a_busy = a_busy or (bool(revoked) and not a_idle)
            if a_idle and b_idle and not handed:
                both_idle_unread += 1
            if handed and a_idle and b_idle:
                break
        assert revoked, "B's join took a partition from A"
        assert both_idle_unread == 0, (
            f"A and B both idle {both_idle_unread} times with partition {revoked[0]} unread"
        )
        assert a_busy, "A was not idle during the handover"
        assert len(read_by_b) == len(per_partition[revoked[0]])
        assert {partition_of(i) for i in read_by_b} == {revoked[0]}
        assert a.idle() and b.idle(), "the handover done, both members go idle"
    finally:
        await b.close()
        await a.close()
