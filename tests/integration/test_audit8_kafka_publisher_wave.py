"""KafkaPublisher: one message's partition out of reach must not decide its batch-mates'
outcomes (librdkafka's mock cluster, a topic made leaderless through its C API)."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator

import pytest

from outboxer.brokers.base import OutcomeKind
from outboxer.brokers.kafka import KafkaPublisher
from outboxer.testing import make_message
from tests.integration.test_broker_kafka import MockCluster, TopicConsumer
from tests.integration.test_kafka_audit_publisher import Mock

LEADER_NOT_AVAILABLE = 5


@pytest.fixture
def mock() -> Iterator[Mock]:
    cluster = MockCluster()  # a cluster per test: the topic error must not leak
    try:
        yield Mock(cluster)
    finally:
        cluster.stop()


async def test_confirmed_messages_stay_published_when_a_batch_mate_times_out(mock: Mock) -> None:
    """Half a wave goes to a topic with no leader, whose messages wait for librdkafka's
    message.timeout.ms (= publish_timeout, checked about once a second). The relay's wave
    timeout struck first and failed the whole wave: the messages the broker had confirmed
    were reported failed too, published again on every retry for as long as the other topic
    stayed unreachable, and dead-lettered once their attempts ran out."""
    reachable, leaderless = mock.topic(), mock.topic()
    mock.lib.rd_kafka_mock_topic_set_error.argtypes = [
        ctypes.c_void_p,
        ctypes.c_char_p,
        ctypes.c_int,
    ]
    # Before the producer's first metadata request: a cached leader would be used.
    mock.lib.rd_kafka_mock_topic_set_error(mock.cluster, leaderless.encode(), LEADER_NOT_AVAILABLE)
    batch = [
        make_message(reachable if n % 2 else leaderless, {"n": n}, key=f"k{n}") for n in range(6)
    ]
    async with KafkaPublisher(f"kafka://{mock.bootstrap}", publish_timeout=0.5) as publisher:
        outcomes = await publisher.publish_batch(batch)
    consumer = TopicConsumer(mock.bootstrap, reachable, [0])
    landed = await consumer.receive(3, timeout=5)
    await consumer.close()
    assert sorted(g.id for g in landed) == sorted(str(m.id) for m in batch[1::2])
    assert [o.kind for o in outcomes[1::2]] == [OutcomeKind.PUBLISHED] * 3, outcomes
    for outcome in outcomes[::2]:
        assert outcome.kind is OutcomeKind.FAILED and outcome.retryable, outcome
        assert "did not confirm" in (outcome.error or ""), outcome
