"""NatsPublisher: a topic without a route that is no NATS subject to publish to (a wildcard
token, an empty token) fails that message for good, before it is sent; the wave goes on."""

from __future__ import annotations

import uuid

import nats
import pytest

from outboxer.brokers.base import OutcomeKind
from outboxer.brokers.nats import NatsPublisher
from outboxer.testing import make_message
from tests.services import require

URL = "nats://127.0.0.1:4222"


@pytest.mark.parametrize("topic", ["orders.*", "orders.>", ">", "orders..eu", "orders."])
async def test_a_topic_that_is_no_publish_subject_fails_for_good_alone(topic: str) -> None:
    require("nats")
    tag = uuid.uuid4().hex[:8]
    stream, prefix = f"OUTBOXER_A13_{tag}", f"a13{tag}."
    nc = await nats.connect(URL)
    js = nc.jetstream()
    await js.add_stream(name=stream, subjects=[f"{prefix}>"])
    try:
        async with NatsPublisher(URL, subject_prefix=prefix, stream=stream) as publisher:
            bad, good = await publisher.publish_batch([make_message(topic), make_message("ok")])
        assert (bad.kind, bad.retryable) == (OutcomeKind.FAILED, False), bad
        assert "cannot publish to" in str(bad.error), bad.error
        assert good.published, good
        # Nothing stored on a literal wildcard subject: only the good message is in the stream.
        info = await js.stream_info(stream)
        assert info.state.messages == 1
        assert (await js.get_msg(stream, 1)).subject == f"{prefix}ok"
    finally:
        await js.delete_stream(stream)
        await nc.close()
