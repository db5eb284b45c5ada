"""The relay's bounded key fetch (``payload_relay._fetch_key``): what an abandoned fetch
leaves behind.

* The cap on abandoned fetches (MAX_ABANDONED_FETCHES) was one count for the whole
  process, while its error blames "the keyring's source": a KMS that never answers, behind
  one ring, made every other ring's fetches fail at once (another destination's healthy
  KMS), and turned a ring that holds its keys' "no such key" (permanent: abandoned at once)
  into "unavailable" (retried up to max_attempts). The cap is per ring now.
* A fetch given up on that ends later with an error was dropped without a word: with a
  KMS client slower than key_fetch_timeout to fail (boto3 waits 60 s for a connect, and
  retries), the rows said "did not answer within 30 s" for ever and the KMS's own error
  (access denied, no such key) was never seen. It is logged now, and a late key is said to
  be kept.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Iterator

import pytest

from outboxer.crypto import KeyNotFoundError, KeyRing, KeyRingUnavailableError
from outboxer.payload_relay import MAX_ABANDONED_FETCHES, _fetch_key

BOUND = 0.2
KEY = os.urandom(32)


@pytest.fixture(autouse=True)
def release() -> Iterator[threading.Event]:
    """Set at the end: the hung KMS calls return, and their threads have ended before the
    next test (whatever the cap counts, it counts no longer)."""
    event = threading.Event()
    yield event
    event.set()
    for thread in threading.enumerate():
        if thread.name == "outboxer-key-fetch":
            thread.join(5)


async def test_a_hung_kms_behind_one_ring_leaves_other_rings_fetching(
    release: threading.Event,
) -> None:
    def hung(key_id: str) -> bytes:
        release.wait()
        return KEY

    stuck = KeyRing.from_callable(hung, "k1")
    for n in range(MAX_ABANDONED_FETCHES):
        with pytest.raises(KeyRingUnavailableError, match="did not answer"):
            await _fetch_key(stuck, f"k{n}", BOUND)
    # This ring's source is the one that does not answer: it is not asked again.
    with pytest.raises(KeyRingUnavailableError, match="have not returned"):
        await _fetch_key(stuck, "k-next", BOUND)

    # Another ring (another KMS, which answers) fetches as usual.
    healthy = KeyRing.from_callable(lambda key_id: KEY, "k1")
    await _fetch_key(healthy, "k1", BOUND)
    assert healthy.has_key("k1")
    # A ring holding its keys: an unknown id is not found (permanent), not "unavailable".
    held = KeyRing({"k1": KEY})
    with pytest.raises(KeyNotFoundError):
        await _fetch_key(held, "k9", BOUND)

    release.set()  # the hung calls return: their places come back

    async def freed() -> bool:
        try:
            await _fetch_key(stuck, "k-after", BOUND)
        except KeyRingUnavailableError:
            return False
        return True

    for _ in range(50):
        if await freed():
            break
        await asyncio.sleep(0.02)
    assert stuck.has_key("k-after"), "the places of the ended fetches did not come back"
    assert stuck.has_key("k0"), "the key a late answer brought was not kept"


async def test_a_fetch_that_fails_after_the_bound_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    answer = threading.Event()
    ended = threading.Event()

    def slow_then_refused(key_id: str) -> bytes:
        try:
            answer.wait()
            raise PermissionError("AccessDeniedException: not authorized to kms:Decrypt")
        finally:
            ended.set()

    ring = KeyRing.from_callable(slow_then_refused, "k1")
    caplog.set_level(logging.INFO, logger="outboxer.payload")
    with pytest.raises(KeyRingUnavailableError, match="did not answer"):
        await _fetch_key(ring, "k1", BOUND)
    answer.set()
    assert await asyncio.to_thread(ended.wait, 5)
    for _ in range(100):  # the thread logs right after the call returned
        if any("AccessDeniedException" in r.getMessage() for r in caplog.records):
            break
        await asyncio.sleep(0.01)
    late = [r for r in caplog.records if "AccessDeniedException" in r.getMessage()]
    assert late, "the KMS's own error, after the bound, was dropped without a word"
    assert late[0].levelno == logging.WARNING
    assert "'k1'" in late[0].getMessage()


async def test_a_key_that_arrives_after_the_bound_is_kept_and_said_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    answer = threading.Event()
    ended = threading.Event()

    def slow(key_id: str) -> bytes:
        try:
            answer.wait()
            return KEY
        finally:
            ended.set()

    ring = KeyRing.from_callable(slow, "k1")
    caplog.set_level(logging.INFO, logger="outboxer.payload")
    with pytest.raises(KeyRingUnavailableError, match="did not answer"):
        await _fetch_key(ring, "k1", BOUND)
    answer.set()
    assert await asyncio.to_thread(ended.wait, 5)
    for _ in range(100):
        if ring.has_key("k1") and any("kept" in r.getMessage() for r in caplog.records):
            break
        await asyncio.sleep(0.01)
    assert ring.has_key("k1")
    assert any("'k1'" in r.getMessage() and "kept" in r.getMessage() for r in caplog.records)
