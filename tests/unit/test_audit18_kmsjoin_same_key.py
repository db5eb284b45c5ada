"""Fetches of one key that begin at the same moment share one KMS call: with a KMS that
answers, none of them fails (beyond the cap of running calls they failed at once, each a
failed attempt of its message for nothing); a fetch given up on is not joined."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest

from outboxer.crypto import (
    MAX_ABANDONED_FETCHES,
    KeyRing,
    KeyRingUnavailableError,
    fetch_key_bounded,
)

LOG = logging.getLogger("test.kmsjoin")
KEY = bytes(range(32))


def ring_with(calls: list[str], answer: threading.Event | None, delay: float = 0.0) -> KeyRing:
    """A KMS whose first call waits for ``answer`` (None: does not wait)."""

    def source(key_id: str) -> bytes:
        calls.append(key_id)
        if answer is not None and len(calls) == 1:
            answer.wait(10)
        time.sleep(delay)
        return KEY

    return KeyRing.from_callable(source, "k1")


async def test_simultaneous_fetches_of_one_key_share_one_call_and_all_succeed() -> None:
    calls: list[str] = []
    ring = ring_with(calls, None, delay=0.2)
    lanes = 3 * MAX_ABANDONED_FETCHES
    results = await asyncio.gather(
        *(fetch_key_bounded(ring, "k1", 5.0, waiter="the test", log=LOG) for _ in range(lanes)),
        return_exceptions=True,
    )
    assert [r for r in results if r is not None] == []  # before: 8 of 12 failed at once
    assert calls == ["k1"]
    assert ring.has_key("k1")


async def test_a_fetch_given_up_on_is_not_joined_and_a_later_one_asks_again() -> None:
    calls: list[str] = []
    answer = threading.Event()
    ring = ring_with(calls, answer)
    try:
        with pytest.raises(KeyRingUnavailableError, match="did not answer"):
            await fetch_key_bounded(ring, "k1", 0.1, waiter="the test", log=LOG)
        # The first call still hangs: a new fetch asks the KMS again rather than wait on it.
        await fetch_key_bounded(ring, "k1", 5.0, waiter="the test", log=LOG)
        assert calls == ["k1", "k1"]
        assert ring.has_key("k1")
    finally:
        answer.set()


async def test_a_joined_fetch_that_fails_fails_each_waiter_with_its_error() -> None:
    def source(key_id: str) -> bytes:
        time.sleep(0.1)
        raise KeyRingUnavailableError("the KMS said no")

    ring = KeyRing.from_callable(source, "k1")
    results = await asyncio.gather(
        *(fetch_key_bounded(ring, "k1", 5.0, waiter="the test", log=LOG) for _ in range(6)),
        return_exceptions=True,
    )
    assert all(isinstance(r, KeyRingUnavailableError) and "said no" in str(r) for r in results)
