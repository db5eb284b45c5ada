"""``crypto.fetch_key_bounded``: the per-ring cap on KMS calls left running holds when the
callers wait at once.

The cap was checked when a fetch began and counted only when it was given up on: every
fetch that began while fewer than MAX_ABANDONED_FETCHES were given up passed the check, so
the consumer's lanes (up to ``concurrency``, 256) meeting one new key at once against a
KMS that never answers each left a thread behind, past the cap (new keys each, since
fetches of one key at once now share one call).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator

import pytest

from outboxer.crypto import (
    MAX_ABANDONED_FETCHES,
    KeyRing,
    KeyRingUnavailableError,
    fetch_key_bounded,
)

LOG = logging.getLogger("test")
CALLERS = 3 * MAX_ABANDONED_FETCHES


@pytest.fixture
def hang() -> Iterator[threading.Event]:
    event = threading.Event()
    yield event
    event.set()
    deadline = time.monotonic() + 5
    for thread in threading.enumerate():
        if thread.name == "outboxer-key-fetch":
            thread.join(max(0.0, deadline - time.monotonic()))


def test_callers_at_once_leave_no_more_calls_running_than_the_cap(
    hang: threading.Event,
) -> None:
    calls: list[str] = []
    lock = threading.Lock()

    def silent_kms(key_id: str) -> bytes:
        with lock:
            calls.append(key_id)
        hang.wait(10)
        return bytes(32)

    ring = KeyRing.from_callable(silent_kms, current="k1")

    async def main() -> list[BaseException | None]:
        return await asyncio.gather(
            # Other keys each: fetches of one key at once share one call (crypto._joinable).
            *(
                fetch_key_bounded(ring, f"k{n}", 0.3, waiter="test", log=LOG)
                for n in range(CALLERS)
            ),
            return_exceptions=True,
        )

    outcomes = asyncio.run(main())
    assert all(isinstance(o, KeyRingUnavailableError) for o in outcomes), outcomes
    with lock:
        started = len(calls)
    assert started <= MAX_ABANDONED_FETCHES, f"{started} KMS calls left running"
    # The ring is not asked again while they hang.
    with pytest.raises(KeyRingUnavailableError, match="have not returned"):
        asyncio.run(fetch_key_bounded(ring, "k1", 0.3, waiter="test", log=LOG))


def test_a_fetch_that_fails_at_once_gives_its_place_back() -> None:
    def refusing_kms(key_id: str) -> bytes:
        raise PermissionError("access denied")

    ring = KeyRing.from_callable(refusing_kms, current="k1")

    async def main() -> None:
        for _ in range(3 * MAX_ABANDONED_FETCHES):
            with pytest.raises(KeyRingUnavailableError) as raised:
                await fetch_key_bounded(ring, "k1", 5, waiter="test", log=LOG)
            assert "have not returned" not in str(raised.value)

    asyncio.run(main())
