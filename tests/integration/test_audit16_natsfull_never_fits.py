"""NATS JetStream, a stream that discards new messages at its ``max_bytes``: a message
larger than the whole stream is refused for good (ABANDONED at once), while one refused
because the stream is merely full stays retryable (consumers may make room).

JetStream answers both with the same error (503, err_code 10077, "maximum bytes
exceeded"), so every such message was retried until its attempts ran out, holding its key
behind each backoff, although no progress could ever make it fit."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import nats
import pytest
from nats.js.api import DiscardPolicy, StreamConfig

from outboxer.brokers import create_publisher
from outboxer.testing import make_message
from tests.services import require


@pytest.fixture
async def small_stream() -> AsyncIterator[str]:
    require("nats")
    name = f"full{uuid.uuid4().hex[:8]}"
    nc = await nats.connect("nats://127.0.0.1:4222")
    js = nc.jetstream()
    await js.add_stream(
        StreamConfig(name=name, subjects=[f"{name}.>"], max_bytes=1000, discard=DiscardPolicy.NEW)
    )
    try:
        yield name
    finally:
        await js.delete_stream(name)
        await nc.close()


@pytest.mark.parametrize("named", [True, False], ids=["stream-named", "found-by-subject"])
async def test_a_message_larger_than_the_whole_stream_is_refused_for_good(
    small_stream: str, named: bool
) -> None:
    url = f"nats://127.0.0.1:4222?subject_prefix={small_stream}."
    if named:
        url += f"&stream={small_stream}"
    async with create_publisher(url) as publisher:
        [huge] = await publisher.publish_batch([make_message("t", {"x": "y" * 2000})])
        assert not huge.published
        assert not huge.retryable, huge.error
        assert "can never fit" in str(huge.error) and "max_bytes is 1000" in str(huge.error)
        # Filled up, the stream refuses a small message too: that one may fit later.
        outcomes = await publisher.publish_batch(
            [make_message("t", {"x": "y" * 200}) for _ in range(6)]
        )
        refused = [outcome for outcome in outcomes if not outcome.published]
        assert refused, "the stream never filled up"
        assert all(outcome.retryable for outcome in refused), refused
