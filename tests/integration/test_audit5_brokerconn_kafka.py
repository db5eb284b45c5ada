"""Kafka: every broker gone while the publisher idles. librdkafka reports it at once
(_ALL_BROKERS_DOWN) and reconnects by itself, but ``connected`` stayed True: the relay
claimed rows, each waited message.timeout.ms (publish_timeout, 30 s by default) and failed
as attempted, and /health said "ok" meanwhile. Now the publisher is not connected, a batch
goes back untried at once, and ``connect()`` asks the cluster afresh."""

from __future__ import annotations

import time

import pytest

from outboxer.brokers.base import OutcomeKind, Publisher
from outboxer.brokers.kafka import KafkaPublisher
from outboxer.errors import BrokerUnavailableError
from outboxer.testing import eventually, make_message
from tests.integration.test_broker_kafka import MockCluster


async def gone(publisher: Publisher) -> bool:
    return not publisher.connected


async def test_all_brokers_down_while_idle_is_seen_and_the_batch_goes_back_untried() -> None:
    cluster = MockCluster()
    publisher = KafkaPublisher(
        f"kafka://{cluster.bootstrap}?connect_timeout=1", config={"message.timeout.ms": 1500}
    )
    try:
        await publisher.connect()
        [first] = await publisher.publish_batch([make_message("idle", key="k")])
        assert first.published, first
        cluster.stop()
        await eventually(lambda: gone(publisher), timeout=2)
        started = time.monotonic()
        outcomes = await publisher.publish_batch(
            [make_message("idle", key="k"), make_message("idle", key="k")]
        )
        assert [(o.kind, o.attempted) for o in outcomes] == [(OutcomeKind.FAILED, False)] * 2
        assert time.monotonic() - started < 0.5, "not held for message.timeout.ms"
        with pytest.raises(BrokerUnavailableError):  # a fresh metadata request
            await publisher.connect()
        assert not publisher.connected
    finally:
        await publisher.close()
        cluster.stop()
