"""Receiver.lag() on Kafka (librdkafka's mock cluster): the records of this member's
partitions past its position (measured by the polling thread), also while the partitions
are paused (prefetch full: their cached ends are not refreshed then); None when not
connected."""

from __future__ import annotations

import uuid

from outboxer.brokers.kafka import KafkaPublisher
from outboxer.receivers import create_receiver
from outboxer.testing import make_message
from tests.integration.test_broker_kafka import MockCluster
from tests.integration.test_kafka_audit_receiver import one_partition_topic
from tests.receiving import collect, lag_becomes


async def publish(cluster: MockCluster, topic: str, count: int) -> None:
    async with KafkaPublisher(f"kafka://{cluster.bootstrap}") as publisher:
        outcomes = await publisher.publish_batch(
            [make_message(topic, {"n": n}, key="k") for n in range(count)]
        )
    assert all(outcome.published for outcome in outcomes), outcomes


async def test_lag_is_the_members_records_past_its_position(cluster: MockCluster) -> None:
    topic = one_partition_topic(cluster, prefix="lag")
    await publish(cluster, topic, 6)
    url = f"kafka://{cluster.bootstrap}?session.timeout.ms=2000&heartbeat.interval.ms=400"
    receiver = create_receiver(url, group=f"g-{uuid.uuid4().hex[:8]}", topics=[topic], prefetch=2)
    assert await receiver.lag() is None  # not connected
    await receiver.connect()
    try:
        # The polling thread takes two (prefetch) and pauses the partition: four wait.
        assert await lag_becomes(receiver, lambda n: n == 4, "4") == 4
        await publish(cluster, topic, 2)  # while paused: the end is asked of the broker
        assert await lag_becomes(receiver, lambda n: n == 6, "6") == 6
        await receiver.ack(await collect(receiver, 2))
        assert await lag_becomes(receiver, lambda n: n == 4, "4 again") == 4
        for _ in range(3):
            await receiver.ack(await collect(receiver, 2))
        assert await lag_becomes(receiver, lambda n: n == 0, "0") == 0
    finally:
        await receiver.close()
    assert await receiver.lag() is None  # closed
