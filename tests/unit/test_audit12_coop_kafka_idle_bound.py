"""KafkaReceiver.idle() around rebalances, driven through its callbacks (no broker): with
cooperative-sticky a revoke waits for the next round's assignment (the handover) but never
for ever; a lost assignment and the eager protocol end the rebalance at the next assignment."""

from __future__ import annotations

import time

from confluent_kafka import TopicPartition

from outboxer.receivers.kafka import KafkaReceiver

COOPERATIVE = "partition.assignment.strategy=cooperative-sticky"


def receiver(query: str) -> KafkaReceiver:
    return KafkaReceiver(f"kafka://127.0.0.1:1?{query}", group="g", topics=["t"])


def caught_up(r: KafkaReceiver) -> None:
    """What it owns reached its end (idle() also wants that)."""
    for partition in r._partitions.values():
        partition.eof = partition.last + 1


def test_a_cooperative_revoke_waits_for_the_next_round() -> None:
    r = receiver(f"{COOPERATIVE}&session.timeout.ms=60000")
    r._on_assign(None, [TopicPartition("t", 0), TopicPartition("t", 1)])
    caught_up(r)
    assert r.idle()
    r._on_revoke(None, [TopicPartition("t", 0)])
    assert not r.idle()
    r._on_assign(None, [])  # this round: nothing gained
    caught_up(r)
    assert not r.idle(), "partition 0 has no owner until the next round"
    r._on_assign(None, [])  # the next round: partition 0 is its new owner's
    assert r.idle()


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
