"""JetStream's duplicate window never makes a copy that was not stored count as published.

Several destinations copy one outbox message under one id, so each destination's publish
carries the same ``Nats-Msg-Id``. When one stream captures both destinations' subjects,
JetStream stores the first and answers the second as a duplicate, though it never stored
it on its own subject: before the fix that answer counted as published and the second
destination's consumers never saw the message. A relay's own retry (same subject) is still
a duplicate that counts. Against the real NATS JetStream on 127.0.0.1:4222.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import nats
import pytest
from nats.js import JetStreamContext

from outboxer.brokers.base import OutcomeKind
from outboxer.brokers.nats import NatsPublisher
from outboxer.testing import make_message
from tests.services import require

URL = "nats://127.0.0.1:4222"


@pytest.fixture
async def stream() -> AsyncIterator[tuple[JetStreamContext, str, str]]:
    """A stream capturing ``<prefix>>`` with a short duplicate window; (js, name, prefix)."""
    require("nats")
    tag = uuid.uuid4().hex[:8]
    name, prefix = f"OUTBOXER_DUP_{tag}", f"dup{tag}."
    nc = await nats.connect(URL)
    js = nc.jetstream()
    await js.add_stream(name=name, subjects=[f"{prefix}>"], duplicate_window=30)
    try:
        yield js, name, prefix
    finally:
        await js.delete_stream(name)
        await nc.close()


async def test_a_copy_for_another_destination_dropped_as_duplicate_is_not_published(
    stream: tuple[JetStreamContext, str, str],
) -> None:
    js, name, prefix = stream
    orders = NatsPublisher(f"{URL}?subject_prefix={prefix}orders.")
    audit = NatsPublisher(f"{URL}?subject_prefix={prefix}audit.")
    message = make_message("created", key="order-1", payload=b'{"id": 1}')
    try:
        await orders.connect()
        await audit.connect()
        [first] = await orders.publish_batch([message])
        [second] = await audit.publish_batch([message])
        assert first.kind is OutcomeKind.PUBLISHED, first
        # JetStream stored only the first: the second copy is not on its subject.
        assert (await js.stream_info(name)).state.messages == 1
        assert second.kind is OutcomeKind.FAILED, second
        assert second.retryable and second.attempted
        assert second.retry_after == pytest.approx(30.0)  # the stream's duplicate window
        assert f"{prefix}audit.created" in (second.error or "")
        assert audit.connected  # a refusal of one message, not an outage
    finally:
        await orders.close()
        await audit.close()


async def test_a_retry_on_the_same_subject_is_still_a_confirmed_duplicate(
    stream: tuple[JetStreamContext, str, str],
) -> None:
    js, name, prefix = stream
    publisher = NatsPublisher(f"{URL}?subject_prefix={prefix}orders.")
    message = make_message("created", key="order-1", payload=b'{"id": 1}')
    other = make_message("created", key="order-2", payload=b'{"id": 2}')
    try:
        await publisher.connect()
        assert (await publisher.publish_batch([message]))[0].published
        # The retry of a message whose PubAck was lost, in a wave with a new message.
        outcomes = await publisher.publish_batch([message, other])
        assert [o.kind for o in outcomes] == [OutcomeKind.PUBLISHED] * 2, outcomes
        assert (await js.stream_info(name)).state.messages == 2
    finally:
        await publisher.close()
