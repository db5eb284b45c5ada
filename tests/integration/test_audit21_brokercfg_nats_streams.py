"""JetStream streams configured otherwise than outboxer assumed (streams of unique names on
the shared server, deleted after).

- ``no_ack``: the stream stores each message and never answers with a PubAck. Every wave
  waited ``publish_timeout`` and failed as a timeout, an attempt charged, the message
  published again, until all were abandoned, every one of them stored. Now a publisher
  with ``stream`` refuses it at connect, for good (the relay stops, saying why); one
  without finds it once a PubAck does not come: the wave's messages come back unsent and
  the reconnect raises the refusal.
- ``discard: old`` with limits (``max_msgs_per_subject`` counts per topic, not per key),
  or memory storage: JetStream drops or loses confirmed messages nobody applied, and says
  nothing. Now the publisher (with ``stream``) and the receiver warn at connect.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator

import nats
import pytest
from nats.js import JetStreamContext
from nats.js.api import StorageType

from outboxer.brokers.nats import NatsPublisher
from outboxer.errors import PublishError
from outboxer.receivers import create_receiver
from outboxer.testing import make_message
from tests.services import require

URL = "nats://127.0.0.1:4222"


@pytest.fixture
async def js() -> AsyncIterator[JetStreamContext]:
    require("nats")
    nc = await nats.connect(URL)
    try:
        yield nc.jetstream()
    finally:
        await nc.close()


async def test_a_no_ack_stream_is_refused_not_retried_until_abandoned(js: JetStreamContext) -> None:
    tag = uuid.uuid4().hex[:8]
    stream, prefix = f"A21_NOACK_{tag}", f"a21na{tag}."
    await js.add_stream(name=stream, subjects=[f"{prefix}>"], no_ack=True)
    try:
        named = NatsPublisher(f"{URL}?subject_prefix={prefix}&stream={stream}", publish_timeout=5)
        with pytest.raises(PublishError, match="no_ack") as refused:
            await named.connect()
        assert not refused.value.retryable
        unnamed = NatsPublisher(f"{URL}?subject_prefix={prefix}", publish_timeout=1.5)
        try:
            await unnamed.connect()
            outcomes = await unnamed.publish_batch([make_message("t", key="a")])
            assert not outcomes[0].published and not outcomes[0].attempted, outcomes
            assert "no_ack" in (outcomes[0].error or "")
            assert not unnamed.connected
            with pytest.raises(PublishError, match="no_ack") as again:
                await unnamed.connect()
            assert not again.value.retryable
        finally:
            await unnamed.close()
    finally:
        await js.delete_stream(stream)


async def test_limits_that_drop_unapplied_messages_are_said_at_connect(
    js: JetStreamContext, caplog: pytest.LogCaptureFixture
) -> None:
    tag = uuid.uuid4().hex[:8]
    stream, prefix = f"A21_LIMITS_{tag}", f"a21li{tag}."
    await js.add_stream(
        name=stream,
        subjects=[f"{prefix}>"],
        max_msgs_per_subject=1,
        storage=StorageType.MEMORY,
    )
    receiver = create_receiver(f"{URL}?subject_prefix={prefix}", group="g", topics=["orders"])
    try:
        with caplog.at_level(logging.WARNING):
            async with NatsPublisher(f"{URL}?subject_prefix={prefix}&stream={stream}"):
                pass
            published = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
            caplog.clear()
            await receiver.connect()
            consumed = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        for said in (published, consumed):
            assert any("max_msgs_per_subject 1" in m and "lost" in m for m in said), said
            assert any("memory storage" in m for m in said), said
    finally:
        await receiver.close()
        await js.delete_stream(stream)
