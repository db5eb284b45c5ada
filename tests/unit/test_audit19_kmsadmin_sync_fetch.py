"""The synchronous sibling of the relay's bounded key fetch (``crypto.fetch_key_bounded_sync``),
for the operator's commands that run in a thread of their own (a replay's copier, a key
rotation): a KMS that never answers costs the caller one bound, not for ever; the cap of
running calls per ring and the sharing of one key's call are the relay's and the
consumer's (one count, one call, whoever waits); a static ring is looked up without a
thread. Before, these commands called ``ring.key(...)`` on the caller's thread, unbounded.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Iterator

import pytest

from outboxer import crypto
from outboxer.crypto import (
    MAX_ABANDONED_FETCHES,
    KeyNotFoundError,
    KeyRing,
    KeyRingUnavailableError,
    fetch_key_bounded,
)
from tests.waiting import wait_for, within

BOUND = 0.3
KEY = os.urandom(32)
LOG = logging.getLogger("test.kmsadmin")


class SilentKms:
    """A key source whose calls wait for ``answer`` (set at the test's end), then return the
    key; ``silent`` names the ids that wait (None: all of them)."""

    def __init__(self, silent: set[str] | None = None) -> None:
        self.answer = threading.Event()
        self.silent = silent
        self.calls: list[str] = []
        self._lock = threading.Lock()

    def __call__(self, key_id: str) -> bytes:
        with self._lock:
            self.calls.append(key_id)
        if self.silent is None or key_id in self.silent:
            self.answer.wait(30)
        return KEY

    def ring(self, current: str = "k2") -> KeyRing:
        return KeyRing.from_callable(self, current)


def fetch_threads() -> int:
    return sum(1 for thread in threading.enumerate() if thread.name == "outboxer-key-fetch")


@pytest.fixture
def kms() -> Iterator[SilentKms]:
    source = SilentKms()
    yield source
    source.answer.set()
    wait_for(lambda: fetch_threads() == 0, 5, "key fetch threads did not end")


def fetch(ring: KeyRing, key_id: str, timeout: float | None = BOUND) -> object:
    """``fetch_key_bounded_sync`` in a thread given a few seconds (the old code had none)."""
    return within(
        5,
        "the key fetch",
        lambda: crypto.fetch_key_bounded_sync(ring, key_id, timeout, waiter="the test", log=LOG),
    )


def test_a_silent_kms_fails_the_fetch_within_its_bound_and_its_late_key_is_kept(
    kms: SilentKms, caplog: pytest.LogCaptureFixture
) -> None:
    ring = kms.ring()
    began = time.monotonic()
    outcome = fetch(ring, "k1")
    took = time.monotonic() - began
    assert isinstance(outcome, KeyRingUnavailableError), outcome
    assert str(outcome) == f"key 'k1': the keyring's source did not answer within {BOUND:g} s"
    assert BOUND <= took < BOUND + 1, took
    assert fetch_threads() == 1, "the call is left to its daemon thread"
    with caplog.at_level(logging.INFO, logger=LOG.name):
        kms.answer.set()
        wait_for(lambda: fetch_threads() == 0, 5, "the late call did not end")
    assert ring.has_key("k1"), "what the call fetched late is kept"
    assert "key 'k1': the keyring's source answered after" in caplog.text
    assert "the test waited 0.3 s" in caplog.text


def test_the_cap_of_running_calls_is_the_rings_whoever_waits(kms: SilentKms) -> None:
    ring = kms.ring()
    for n in range(MAX_ABANDONED_FETCHES - 1):
        assert isinstance(fetch(ring, f"s{n}"), KeyRingUnavailableError)
    # The relay's and the consumer's (async) fetches count in the same places.
    with pytest.raises(KeyRingUnavailableError, match="did not answer"):
        asyncio.run(fetch_key_bounded(ring, "a0", BOUND, waiter="the relay", log=LOG))
    asked = len(kms.calls)
    began = time.monotonic()
    outcome = fetch(ring, "s-next")
    assert isinstance(outcome, KeyRingUnavailableError), outcome
    assert f"{MAX_ABANDONED_FETCHES} earlier fetches" in str(outcome)
    assert time.monotonic() - began < BOUND, "refused at once, no wait"
    assert len(kms.calls) == asked, "the KMS is not asked once the ring's places are held"


def test_a_sync_caller_joins_the_call_another_caller_waits_for(kms: SilentKms) -> None:
    ring = kms.ring()
    result: list[object] = []

    def first() -> None:
        try:
            crypto.fetch_key_bounded_sync(ring, "k1", 5.0, waiter="the test", log=LOG)
            result.append(None)
        except BaseException as exc:  # the test reads it
            result.append(exc)

    waiting = threading.Thread(target=first, daemon=True)
    waiting.start()
    wait_for(lambda: kms.calls == ["k1"], 5, "the first call did not reach the KMS")
    # Its own bound, on the first caller's call: no second call of the KMS.
    joined = fetch(ring, "k1")
    assert isinstance(joined, KeyRingUnavailableError), joined
    assert "did not answer within 0.3 s" in str(joined)
    assert kms.calls == ["k1"], "one call for both"
    kms.answer.set()
    waiting.join(5)
    assert result == [None], "the first caller, still waiting, gets its key"


def test_a_static_ring_is_looked_up_without_a_thread_and_without_a_bound() -> None:
    ring = KeyRing({"k1": KEY})
    started = threading.Thread.start
    spawned: list[str] = []

    def counted(thread: threading.Thread) -> None:
        spawned.append(thread.name)
        started(thread)

    threading.Thread.start = counted  # type: ignore[method-assign]
    try:
        crypto.fetch_key_bounded_sync(ring, "k1", BOUND, waiter="the test", log=LOG)
        with pytest.raises(KeyNotFoundError, match="no key 'k9'"):
            crypto.fetch_key_bounded_sync(ring, "k9", BOUND, waiter="the test", log=LOG)
    finally:
        threading.Thread.start = started  # type: ignore[method-assign]
    assert spawned == []


def test_no_bound_calls_the_source_on_the_callers_thread() -> None:
    callers: list[str] = []

    def source(key_id: str) -> bytes:
        callers.append(threading.current_thread().name)
        return KEY

    ring = KeyRing.from_callable(source, "k1")
    crypto.fetch_key_bounded_sync(ring, "k1", None, waiter="the test", log=LOG)
    assert callers == [threading.current_thread().name]
    assert ring.has_key("k1")
