"""KafkaPublisher: a wave that ends unanswered (cancelled by a lost lease or a forced stop, or
timed out at its deadline) must not leave its messages in librdkafka's queue.

Left there, librdkafka kept sending them until message.timeout.ms, after the relay had handed
the rows on: another relay publishing the given-back rows (or the retry after backoff) and
then the key's next message saw the stale copy land after both, the key's order broken.

On librdkafka's mock cluster: a topic with no leader holds a wave's message in the producer's
queue, never sent; the topic then gets its leader back. A sentinel produced afterwards by
the same producer, to the same partition, lands behind anything that producer still held
(one idempotent producer keeps a partition's order), so reading up to the sentinel shows
whether the stale copy was still there.
"""

from __future__ import annotations

import asyncio
import ctypes
import time
from collections.abc import Iterator

import pytest

from outboxer.brokers.base import OutcomeKind
from outboxer.brokers.kafka import KafkaPublisher
from outboxer.message import Message
from outboxer.testing import Received, make_message
from tests.integration.test_broker_kafka import MockCluster, TopicConsumer
from tests.integration.test_kafka_audit_publisher import Mock

LEADER_NOT_AVAILABLE = 5


@pytest.fixture
def mock() -> Iterator[Mock]:
    cluster = MockCluster()  # a cluster per test: the topic error must not leak
    try:
        mock = Mock(cluster)
        mock.lib.rd_kafka_mock_topic_set_error.argtypes = [
            ctypes.c_void_p,
            ctypes.c_char_p,
            ctypes.c_int,
        ]
        yield mock
    finally:
        cluster.stop()


def set_leaderless(mock: Mock, topic: str, leaderless: bool) -> None:
    error = LEADER_NOT_AVAILABLE if leaderless else 0
    mock.lib.rd_kafka_mock_topic_set_error(mock.cluster, topic.encode(), error)


async def read_until(mock: Mock, topic: str, last: Message, seconds: float = 8) -> list[Received]:
    """The topic's records up to ``last`` (partition 0), read from the beginning."""
    consumer = TopicConsumer(mock.bootstrap, topic, [0])
    got: list[Received] = []
    deadline = time.monotonic() + seconds
    try:
        while str(last.id) not in [g.id for g in got]:
            assert time.monotonic() < deadline, f"{last.id} never arrived; read {got}"
            got += await consumer.receive(1, timeout=0.5)
    finally:
        await consumer.close()
    return got


async def stale_copy_test(mock: Mock, stale: KafkaPublisher, *, cancel: bool) -> None:
    topic = mock.topic()
    # Before the producer's first metadata request: a cached leader would be used.
    set_leaderless(mock, topic, True)
    first, second = (make_message(topic, {"n": n}, key="K") for n in (1, 2))
    await stale.connect()
    publish = asyncio.ensure_future(stale.publish_batch([first]))
    if cancel:
        # As the relay does when the batch's lease is lost: the publish task is cancelled.
        done, _ = await asyncio.wait([publish], timeout=0.3)
        assert not done, publish.result()  # still waiting for a leader
        publish.cancel()
        with pytest.raises(asyncio.CancelledError):
            await publish
    else:
        [outcome] = await publish
        assert outcome.kind is OutcomeKind.FAILED and outcome.retryable, outcome
    set_leaderless(mock, topic, False)
    # The next holder of the rows publishes them, and the key goes on.
    async with KafkaPublisher(f"kafka://{mock.bootstrap}") as other:
        outcomes = await other.publish_batch([first, second])
    assert [o.kind for o in outcomes] == [OutcomeKind.PUBLISHED] * 2, outcomes
    sentinel = make_message(topic, {"n": "sentinel"}, key="K")
    await stale.connect()  # as the relay does after a timeout (a connection error)
    [outcome] = await stale.publish_batch([sentinel])
    assert outcome.published, outcome
    await stale.close()
    got = await read_until(mock, topic, sentinel)
    assert [g.id for g in got] == [str(first.id), str(second.id), str(sentinel.id)], [
        g.payload for g in got
    ]


async def test_a_cancelled_waves_queued_message_is_not_delivered_later(mock: Mock) -> None:
    """Old code: the cancelled wave's message stayed queued and landed once the partition
    had a leader again: the topic read first, second, first (or first twice)."""
    await stale_copy_test(mock, KafkaPublisher(f"kafka://{mock.bootstrap}"), cancel=True)


async def test_a_timed_out_waves_queued_message_is_not_delivered_later(mock: Mock) -> None:
    """The wave's deadline passed and its message was reported failed (retried later, maybe
    by another relay) while librdkafka kept it queued, for as long as message.timeout.ms
    (here raised above publish_timeout, as a user may; by default the copy outlived the
    deadline by up to a second or two)."""
    stale = KafkaPublisher(
        f"kafka://{mock.bootstrap}", publish_timeout=1.0, config={"message.timeout.ms": 20000}
    )
    await stale_copy_test(mock, stale, cancel=False)


async def test_other_waves_keep_their_outcomes_when_a_cancelled_wave_purges(mock: Mock) -> None:
    """The purge empties the whole producer's queue (librdkafka purges nothing narrower):
    the messages another wave had queued there are produced again within their own wave,
    not reported failed, and every message reported published is in its topic, once."""
    stuck, healthy = mock.topic(), mock.topic()
    set_leaderless(mock, stuck, True)
    # linger.ms holds the other wave's messages in the queue when the purge comes.
    async with KafkaPublisher(f"kafka://{mock.bootstrap}", config={"linger.ms": 300}) as shared:
        cancelled = asyncio.ensure_future(shared.publish_batch([make_message(stuck, key="K")]))
        others = [make_message(healthy, {"n": n}, key=f"k{n}") for n in range(5)]
        other_wave = asyncio.ensure_future(shared.publish_batch(others))
        done, _ = await asyncio.wait([cancelled], timeout=0.1)
        assert not done and not other_wave.done()
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        outcomes = await other_wave
        assert [o.kind for o in outcomes] == [OutcomeKind.PUBLISHED] * 5, outcomes
        assert shared.connected  # the purge was not taken for a connection problem
    got = await read_until(mock, healthy, others[-1])
    assert sorted(g.id for g in got) == sorted(str(m.id) for m in others)
