"""A topic name MQTT cannot take (a control character, a non-character, a wildcard) fails its
message alone and for good, before anything is sent. Mosquitto closed the connection on such
a PUBLISH: every message of the wave failed as "connection lost", retryable, so the relay
retried the poison message for ever and stalled its batch mates at every attempt."""

from __future__ import annotations

import asyncio
import time
import uuid

import aiomqtt
import pytest

from outboxer.brokers.base import OutcomeKind
from outboxer.brokers.mqtt import MqttPublisher
from outboxer.errors import ConfigError
from outboxer.message import validate_envelope
from outboxer.testing import make_message
from tests.services import require

HOST, PORT = "127.0.0.1", 1883

BAD_TOPICS = ["bad\ttab", "bad\r\nline", "bad\x85c1", "bad\ufffe", "bad\U0010ffff", "bad\x7f"]


@pytest.mark.parametrize("bad", BAD_TOPICS)
async def test_a_bad_topic_fails_alone_and_the_wave_is_published(bad: str) -> None:
    require("mosquitto")
    prefix = f"audit12-leftover/{uuid.uuid4().hex[:8]}/"
    validate_envelope(bad, None, {})  # enqueue accepts it
    received: list[str] = []
    async with aiomqtt.Client(
        HOST, PORT, protocol=aiomqtt.ProtocolVersion.V5, identifier=f"c-{uuid.uuid4().hex[:8]}"
    ) as consumer:
        await consumer.subscribe(prefix + "#", qos=1)

        async def collect() -> None:
            async for delivery in consumer.messages:
                received.append(str(delivery.topic))

        task = asyncio.create_task(collect())
        good = [make_message(f"good{n}", {"n": n}) for n in range(5)]
        poison = make_message(bad, {"n": "bad"})
        batch = [*good[:2], poison, *good[2:]]
        try:
            async with MqttPublisher(
                f"mqtt://{HOST}:{PORT}", topic_prefix=prefix, publish_timeout=5
            ) as publisher:
                outcomes = await publisher.publish_batch(batch)
                kinds = [outcome.kind for outcome in outcomes]
                assert (
                    kinds
                    == [OutcomeKind.PUBLISHED] * 2
                    + [OutcomeKind.FAILED]
                    + [OutcomeKind.PUBLISHED] * 3
                ), [outcome.error for outcome in outcomes]
                failed = outcomes[2]
                assert failed.retryable is False and failed.attempted
                assert "control characters or non-characters" in (failed.error or "")
                # The connection is still up: the next batch goes out on it.
                assert publisher.connected and publisher.stats.connects == 1
                again = await publisher.publish_batch([make_message("after", {"n": 9})])
                assert again[0].published and publisher.stats.connects == 1
            expected = {prefix + f"good{n}" for n in range(5)} | {prefix + "after"}
            deadline = time.monotonic() + 5
            while set(received) != expected and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert set(received) == expected
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def test_topic_rules() -> None:
    from outboxer.brokers.mqtt import topic_problem

    assert topic_problem("a//b/") is None  # empty levels are fine
    assert topic_problem("/") is None
    assert topic_problem("zürich/✓") is None
    assert "wildcard" in (topic_problem("a/+/b") or "")
    assert "wildcard" in (topic_problem("a/#") or "")
    assert "empty" in (topic_problem("") or "")
    assert "65535" in (topic_problem("é" * 32_768) or "")
    assert topic_problem("a" * 65_535) is None
    for bad in BAD_TOPICS:
        assert topic_problem(bad) is not None, bad


def test_bad_prefix_or_route_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="topic_prefix"):
        MqttPublisher("mqtt://127.0.0.1:1883?topic_prefix=app%09/")
    with pytest.raises(ConfigError, match="route for topic 'orders'"):
        MqttPublisher("mqtt://127.0.0.1:1883", routes={"orders": "orders/+"})
    MqttPublisher("mqtt://127.0.0.1:1883", topic_prefix="a//", routes={"orders": "o//x"})
