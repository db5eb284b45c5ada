"""Stream settings that drop confirmed messages whatever ``discard`` says went unwarned.

``stream_warnings`` warned of ``max_age`` and ``max_msgs_per_subject`` only with
``discard: old``. But JetStream expires messages past ``max_age`` under any discard
policy, and ``discard: new`` refuses a publish past ``max_msgs_per_subject`` only with
``discard_new_per_subject``: a stream with ``discard: new``, ``max_msgs_per_subject: 1``
and ``max_age: 1s`` confirmed two messages of a topic and kept one, a second later none,
with no word to the relay or the consumer. Interest retention removes a message no
consumer's filter takes at once (before the group's first connect): not said either.
Now each is warned of at the consumer's connect; ``discard: new`` with
``discard_new_per_subject`` (refused, not dropped) still is not.

Streams of unique names on the shared server, deleted after.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import nats
import pytest
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy

from outboxer.receivers import create_receiver
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


async def _said_at_connect(
    js: JetStreamContext, caplog: pytest.LogCaptureFixture, **config: Any
) -> list[str]:
    tag = uuid.uuid4().hex[:8]
    stream, prefix = f"A21R_WARN_{tag}", f"a21rw{tag}."
    await js.add_stream(name=stream, subjects=[f"{prefix}>"], **config)
    receiver = create_receiver(f"{URL}?subject_prefix={prefix}", group="g", topics=["orders"])
    try:
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            await receiver.connect()
        return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    finally:
        await receiver.close()
        await js.delete_stream(stream)


async def test_max_age_and_a_subject_limit_are_said_under_discard_new(
    js: JetStreamContext, caplog: pytest.LogCaptureFixture
) -> None:
    said = await _said_at_connect(
        js, caplog, discard=DiscardPolicy.NEW, max_msgs_per_subject=1, max_age=3600.0
    )
    assert any("max_msgs_per_subject 1" in m and "lost" in m for m in said), said
    assert any("max_age 3600" in m and "lost" in m for m in said), said
    # Limits discard new refuses at (the relay retries): nothing lost, nothing said.
    said = await _said_at_connect(
        js,
        caplog,
        discard=DiscardPolicy.NEW,
        max_msgs=1000,
        max_bytes=10_000_000,
        max_msgs_per_subject=10,
        discard_new_per_subject=True,
    )
    assert not [m for m in said if "JetStream stream" in m], said


async def test_interest_retention_is_said(
    js: JetStreamContext, caplog: pytest.LogCaptureFixture
) -> None:
    said = await _said_at_connect(js, caplog, retention=RetentionPolicy.INTEREST)
    assert any("interest retention" in m for m in said), said
