"""A JetStream stream deleted under a running relay that has ``create_stream``: the real
NATS on 127.0.0.1:4222, the stream deleted by another client between two batches."""

from __future__ import annotations

import contextlib
import uuid

import nats
import nats.js.errors
import pytest

from outboxer.brokers import create_publisher
from outboxer.brokers.base import OutcomeKind
from outboxer.testing import make_message
from tests.services import require

URL = "nats://127.0.0.1:4222"


async def delete_stream(name: str) -> None:
    nc = await nats.connect(URL)
    try:
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await nc.jetstream().delete_stream(name)
    finally:
        await nc.close()


async def stream_messages(name: str) -> int | None:
    """How many messages the stream holds; None if it does not exist."""
    nc = await nats.connect(URL)
    try:
        info = await nc.jetstream().stream_info(name)
    except nats.js.errors.NotFoundError:
        return None
    finally:
        await nc.close()
    return info.state.messages


@pytest.fixture(autouse=True)
def _nats() -> None:
    require("nats")


async def test_a_stream_deleted_while_running_is_created_again() -> None:
    name = f"OUTBOXER_GONE_{uuid.uuid4().hex[:8]}"
    prefix = f"g{uuid.uuid4().hex[:8]}."
    url = f"{URL}?subject_prefix={prefix}&stream={name}&create_stream=true"
    try:
        async with create_publisher(url) as publisher:
            assert (await publisher.publish_batch([make_message("orders")]))[0].published
            await delete_stream(name)
            # The publish that finds no stream fails, retryably, and has it created again…
            [lost] = await publisher.publish_batch([make_message("orders")])
            assert lost.kind is OutcomeKind.FAILED and lost.retryable, lost
            assert "no JetStream stream" in (lost.error or "")
            # …so the retry is stored, on the same connection (before: failed until its
            # attempts ran out, as the stream was only created at connect).
            outcomes = await publisher.publish_batch([make_message("orders") for _ in range(3)])
            assert [o.kind for o in outcomes] == [OutcomeKind.PUBLISHED] * 3, outcomes
            assert publisher.stats.connects == 1
        assert await stream_messages(name) == 3
    finally:
        await delete_stream(name)


async def test_without_create_stream_a_missing_stream_is_not_created() -> None:
    name = f"OUTBOXER_NONE_{uuid.uuid4().hex[:8]}"
    prefix = f"h{uuid.uuid4().hex[:8]}."
    try:
        async with create_publisher(f"{URL}?subject_prefix={prefix}&stream={name}") as publisher:
            for _ in range(2):
                [outcome] = await publisher.publish_batch([make_message("orders")])
                assert outcome.kind is OutcomeKind.FAILED and outcome.retryable, outcome
        assert await stream_messages(name) is None
    finally:
        await delete_stream(name)
