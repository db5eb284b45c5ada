"""Driving a Receiver from a test: take an exact number of messages, wait for its lag."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from outboxer.receivers.base import Incoming, Receiver


async def collect(receiver: Receiver, count: int) -> list[Incoming]:
    """Exactly ``count`` messages, received within 8 s."""
    got: list[Incoming] = []
    deadline = time.monotonic() + 8
    while len(got) < count and time.monotonic() < deadline:
        got += await receiver.receive(count - len(got), 0.2)
    assert len(got) == count
    return got


async def lag_becomes(receiver: Receiver, want: Callable[[int | None], bool], what: str) -> int:
    """The receiver's ``lag()`` once ``want`` accepts it, asked for up to 8 s."""
    deadline = time.monotonic() + 8
    seen: int | None = None
    while time.monotonic() < deadline:
        seen = await receiver.lag()
        if want(seen):
            assert seen is not None
            return seen
        await asyncio.sleep(0.05)
    raise AssertionError(f"lag never {what}: last {seen}")
