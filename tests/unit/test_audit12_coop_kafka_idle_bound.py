"""KafkaReceiver.idle() around rebalances, driven through its callbacks (no broker): with
cooperative-sticky a revoke waits until the group committed the end of the partitions it gave
up (the handover), however many rounds pass, but never for ever; a lost assignment and the
eager protocol end the rebalance at the next assignment. The handover's look at the broker
(committed offsets, partition ends) is given a stand-in consumer here; the mock cluster test
in tests/integration/test_audit12_coop_kafka_idle.py drives the real one."""

from __future__ import annotations

import time

from confluent_kafka import KafkaError, KafkaException, TopicPartition

from outboxer.receivers.kafka import KafkaReceiver

COOPERATIVE = "partition.assignment.strategy=cooperative-sticky"


def receiver(query: str) -> KafkaReceiver:
    return KafkaReceiver(f"kafka://127.0.0.1:1?{query}", group="g", topics=["t"])


def caught_up(r: KafkaReceiver) -> None:
    """What it owns reached its end (idle() also wants that)."""
    for partition in r._partitions.values():
        partition.eof = partition.last + 1


class Broker:
    """What _check_handover asks a consumer: committed offsets and partition ends."""

    def __init__(self, committed: dict[int, int], ends: dict[int, tuple[int, int]]) -> None:
        self.committed_offsets = committed
        self.ends = ends
        self.down = False

    def committed(self, partitions: list[TopicPartition], timeout: float) -> list[TopicPartition]:
        if self.down:
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT))
        return [
            TopicPartition(tp.topic, tp.partition, self.committed_offsets.get(tp.partition, -1001))
            for tp in partitions
        ]

    def get_watermark_offsets(
        self, partition: TopicPartition, timeout: float, cached: bool
    ) -> tuple[int, int]:
        assert not cached, "a cached end may be stale"
        return self.ends[partition.partition]


def handed_over_partition_0(
    query: str = f"{COOPERATIVE}&session.timeout.ms=60000",
) -> KafkaReceiver:
    r = receiver(query)
    r._on_assign(None, [TopicPartition("t", 0), TopicPartition("t", 1)])
    caught_up(r)
    assert r.idle()
    r._on_revoke(None, [TopicPartition("t", 0)])
    assert not r.idle()
    r._on_assign(None, [])  # this round: nothing gained
    caught_up(r)
    return r


def test_a_cooperative_revoke_waits_until_the_group_committed_the_partitions_end() -> None:
    r = handed_over_partition_0()
    broker = Broker(committed={0: 4}, ends={0: (0, 10)})
    r._check_handover(broker)
    assert not r.idle(), "partition 0 has 6 records nobody applied"
    r._on_assign(None, [])  # another round, partition 0 not handed yet (seen under load)
    r._on_assign(None, [])
    assert not r.idle(), "rounds are not counted: the records are still unread"
    broker.committed_offsets[0] = 10  # its new owner applied them
    r._check_handover(broker)
    assert r.idle()


def test_without_a_committed_offset_the_offset_reset_says_where_a_new_owner_begins() -> None:
    r = handed_over_partition_0()
    r._check_handover(Broker(committed={}, ends={0: (3, 10)}))
    assert not r.idle(), "earliest: its new owner reads offsets 3 to 9"
    r._check_handover(Broker(committed={}, ends={0: (10, 10)}))
    assert r.idle(), "an empty partition: nothing to hand over"
    latest = handed_over_partition_0(f"{COOPERATIVE}&session.timeout.ms=60000&offset_reset=latest")
    latest._check_handover(Broker(committed={}, ends={0: (3, 10)}))
    assert latest.idle(), "latest: a new owner begins at the end"


def test_a_broker_that_does_not_answer_keeps_the_handover_waited_for() -> None:
    r = handed_over_partition_0()
    broker = Broker(committed={0: 10}, ends={0: (0, 10)})
    broker.down = True
    r._check_handover(broker)
    assert not r.idle()
    broker.down = False
    r._check_handover(broker)
    assert r.idle()


def test_a_partition_given_back_to_its_member_ends_its_handover() -> None:
    r = handed_over_partition_0()
    r._on_assign(None, [TopicPartition("t", 0)])
    caught_up(r)
    assert r.idle(), "partition 0 is this member's again: its own end counts"


def test_a_cooperative_handover_is_waited_for_a_few_session_timeouts_at_most() -> None:
    r = receiver(f"{COOPERATIVE}&session.timeout.ms=100")
    r._on_assign(None, [TopicPartition("t", 0), TopicPartition("t", 1)])
    r._on_revoke(None, [TopicPartition("t", 0)])
    r._on_assign(None, [])
    caught_up(r)
    started = time.monotonic()
    assert not r.idle()
    while not r.idle() and time.monotonic() < started + 5:
        time.sleep(0.02)
    assert r.idle(), "no second round came: idle after 3 session timeouts"
    assert time.monotonic() - started >= 0.25


def test_a_lost_assignment_ends_at_the_next_assignment() -> None:
    r = receiver(f"{COOPERATIVE}&session.timeout.ms=60000")
    r._on_assign(None, [TopicPartition("t", 0)])
    r._on_lost(None, [TopicPartition("t", 0)])
    assert not r.idle()
    r._on_assign(None, [])
    assert r.idle()


def test_the_eager_protocol_ends_a_rebalance_at_its_assignment() -> None:
    r = receiver("session.timeout.ms=60000")
    r._on_assign(None, [TopicPartition("t", 0), TopicPartition("t", 1)])
    r._on_revoke(None, [TopicPartition("t", 0), TopicPartition("t", 1)])
    assert not r.idle()
    r._on_assign(None, [TopicPartition("t", 1)])
    caught_up(r)
    assert r.idle()
