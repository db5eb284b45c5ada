"""Key ids the ring refuses (a row's hand-written ``outboxer-key-id`` header) on the
operators' bounded key fetch (``crypto.fetch_key_bounded_sync``, a replay's copier):

* A key id ending in a newline passed the ring's check (``re.match`` with ``$``, which
  also matches before a final newline): ``"k1\\n"`` was handed to the KMS and made a key id
  of the ring, and ``check_key_id`` accepted it in a key file.
* An id that is no key id (a number, a list, a long text) took a thread and one of the
  ring's places, only for the ring to refuse it in that thread: with the places held by a
  KMS that does not answer, it was refused "unavailable" instead (a replay's 503, "retry"),
  quoting the whole header, where the ring answers "not a valid key id" (for good: a 409,
  the text shortened). A rotation of 50,000 such rows started 150,000 threads (15 s, from
  0.5 s before the bounded fetch).
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Iterator

import pytest

from outboxer import crypto
from outboxer.admin import ReplayCopier
from outboxer.crypto import (
    HEADER_KEY_ID,
    MAX_ABANDONED_FETCHES,
    KeyNotFoundError,
    KeyRing,
    KeyRingUnavailableError,
    check_key_id,
    encrypt_message,
)
from outboxer.errors import ConfigError, ReplayError
from outboxer.message import Message
from tests.waiting import wait_for

BOUND = 0.1
KEY = os.urandom(32)
LOG = logging.getLogger("test.review.kmsadmin")
#: Header values no key id can be: each refused by the ring before any KMS sees it.
HOSTILE: list[object] = [5, ["k1"], {"k": "k1"}, "x" * 5000, "k1\n", "k1\x1b[2J"]
NAMES = ["number", "list", "object", "long", "newline", "escape"]


def fetch_threads() -> int:
    return sum(1 for thread in threading.enumerate() if thread.name == "outboxer-key-fetch")


class Kms:
    """Answers k2 at once; every other id waits for ``answer`` (set at the test's end)."""

    def __init__(self) -> None:
        self.answer = threading.Event()
        self.calls: list[object] = []

    def __call__(self, key_id: str) -> bytes:
        self.calls.append(key_id)
        if key_id != "k2":
            self.answer.wait(30)
        return KEY


@pytest.fixture
def kms() -> Iterator[Kms]:
    source = Kms()
    yield source
    source.answer.set()
    wait_for(lambda: fetch_threads() == 0, 5, "key fetch threads did not end")


def held_ring(kms: Kms) -> KeyRing:
    """A ring holding its current key k2, every one of its places held by a silent call."""
    ring = KeyRing.from_callable(kms, "k2")
    crypto.fetch_key_bounded_sync(ring, "k2", BOUND, waiter="the test", log=LOG)
    for n in range(MAX_ABANDONED_FETCHES):
        with pytest.raises(KeyRingUnavailableError, match="did not answer"):
            crypto.fetch_key_bounded_sync(ring, f"s{n}", BOUND, waiter="the test", log=LOG)
    with pytest.raises(KeyRingUnavailableError, match="have not returned"):
        crypto.fetch_key_bounded_sync(ring, "s-next", BOUND, waiter="the test", log=LOG)
    return ring


def test_a_key_id_ending_in_a_newline_is_no_key_id_and_never_reaches_the_kms() -> None:
    asked: list[str] = []

    def source(key_id: str) -> bytes:
        asked.append(key_id)
        return KEY

    ring = KeyRing.from_callable(source, "k2")
    with pytest.raises(KeyNotFoundError, match="is not a valid key id"):
        ring.key("k1\n")
    assert asked == []
    assert "k1\n" not in ring.key_ids
    with pytest.raises(ConfigError, match="must be 1 to 64"):
        check_key_id("k1\n")
    with pytest.raises(ConfigError, match="must be 1 to 64"):
        KeyRing({"k1\n": KEY})
    assert check_key_id("k1") == "k1"
    assert check_key_id("a" * 64) == "a" * 64
    with pytest.raises(ConfigError):
        check_key_id("a" * 65)


@pytest.mark.parametrize("key_id", HOSTILE, ids=NAMES)
def test_an_invalid_key_id_is_refused_for_good_at_once_while_the_kms_is_silent(
    kms: Kms, key_id: object
) -> None:
    ring = held_ring(kms)
    threads, asked = fetch_threads(), list(kms.calls)

    with pytest.raises(KeyNotFoundError, match="is not a valid key id") as refused:
        crypto.fetch_key_bounded_sync(ring, key_id, BOUND, waiter="the test", log=LOG)  # type: ignore[arg-type]

    assert len(str(refused.value)) < 200, str(refused.value)[:300]
    assert fetch_threads() == threads, "a thread started for an id the ring refuses"
    assert kms.calls == asked, "the KMS was asked"


@pytest.mark.parametrize("key_id", HOSTILE, ids=NAMES)
def test_a_replay_of_a_row_under_an_invalid_key_id_is_a_conflict_not_unavailable(
    kms: Kms, key_id: object
) -> None:
    ring = held_ring(kms)
    stored = encrypt_message(
        Message(id=uuid.uuid4(), topic="t", payload=b"{}", key="a"), KeyRing({"k1": KEY})
    )
    hostile = Message(
        id=stored.id,
        topic=stored.topic,
        payload=stored.payload,
        key=stored.key,
        headers={**stored.headers, HEADER_KEY_ID: key_id},  # type: ignore[dict-item]
        content_type=stored.content_type,
    )
    copier = ReplayCopier(ring, read_timeout=BOUND)

    with pytest.raises(ReplayError, match="is not a valid key id") as refused:
        copier.copy(hostile)

    assert len(str(refused.value)) < 300, str(refused.value)[:400]
    # The HTTP API's 503 ("retry") is for a KMS that failed or did not answer only.
    assert copier.keys_unavailable is None, copier.keys_unavailable
