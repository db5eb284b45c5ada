"""What every broker must do with hostile headers: deliver what enqueue accepted unchanged."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from outboxer.message import Message, validate_envelope
from outboxer.testing import make_message


async def assert_delivered_unchanged(
    publisher: Any, receiver: Any, messages: Sequence[Message]
) -> None:
    """Publish ``messages`` in one wave through ``publisher``, receive them through the
    connected ``receiver`` (acking), and check every one arrived with its headers and key
    exactly as sent."""
    async with publisher:
        outcomes = await publisher.publish_batch(list(messages))
    failed = [
        (m.headers, m.key, o.error)
        for m, o in zip(messages, outcomes, strict=True)
        if not o.published
    ]
    assert failed == []
    got = {}
    deadline = time.monotonic() + 10
    while len(got) < len(messages) and time.monotonic() < deadline:
        incomings = await receiver.receive(50, 0.5)
        for incoming in incomings:
            got[incoming.delivery.id] = incoming.delivery
        await receiver.ack(incomings)
    for message in messages:
        delivery = got.get(message.id)
        assert delivery is not None, f"not delivered: {message.headers} {message.key!r}"
        assert (dict(delivery.headers), delivery.key) == (dict(message.headers), message.key)


def accepted_messages(
    topic: str, cases: Sequence[tuple[dict[str, str], str | None]]
) -> list[Message]:
    """One message on ``topic`` per (headers, key) case, each checked as enqueue checks it."""
    messages = []
    for headers, key in cases:
        validate_envelope(topic, key, headers)  # enqueue accepts each of them
        messages.append(make_message(topic, {"n": len(messages)}, key=key, headers=headers))
    return messages
