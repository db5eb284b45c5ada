"""A claim-check store that hangs costs a bounded number of put threads: every bounded put
runs in a daemon thread (nothing interrupts a hung put), and before the cap 500 timed-out
puts left 500 threads blocked. Past ``max_unanswered_puts`` a put fails at once with
ClaimCheckStoreError (EBUSY), writing nothing; the threads that return free their slots.

The store below blocks on an Event: a unit test of the bounding logic, not of an adapter."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from outboxer import Outbox
from outboxer.claimcheck import ClaimCheck, ClaimCheckStoreError, FileObjectStore
from outboxer.message import Message

PUT_TIMEOUT = 0.02


class GatedStore(FileObjectStore):
    """A directory store whose puts hang until ``answer`` is set (a dead NFS mount)."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.answer = threading.Event()
        self.puts_started = 0
        self._lock = threading.Lock()

    def put(self, name: str, data: bytes) -> None:
        with self._lock:
            self.puts_started += 1
        self.answer.wait()
        super().put(name, data)

    def names(self) -> list[str]:
        return [stored.name for stored in self.list_objects()]


def big(n: int = 0) -> Message:
    return Message(id=uuid.uuid4(), topic="t", payload=b"x" * 64 + str(n).encode())


def put_threads() -> int:
    return sum(t.name == "outboxer-claim-check-put" for t in threading.enumerate())


@pytest.fixture
def store(tmp_path: Path) -> Iterator[GatedStore]:
    gated = GatedStore(tmp_path / "claims")
    yield gated
    gated.answer.set()  # the hung threads end with the test


def errnos(calls: int, offload: Callable[[Message], Message]) -> dict[int | None, int]:
    seen: dict[int | None, int] = {}
    for n in range(calls):
        with pytest.raises(ClaimCheckStoreError) as failed:
            offload(big(n))
        seen[failed.value.errno] = seen.get(failed.value.errno, 0) + 1
    return seen


def test_a_hung_store_holds_at_most_the_default_cap_of_put_threads(store: GatedStore) -> None:
    check = ClaimCheck(store, threshold=0, put_timeout=PUT_TIMEOUT)
    before = put_threads()
    seen = errnos(100, check.offload)
    # Old code: 100 threads, one per timed-out put, all still blocked.
    assert put_threads() - before <= 64
    assert store.puts_started <= 64
    assert seen[errno.EBUSY] == 100 - seen[errno.ETIMEDOUT]


def test_a_put_past_the_cap_fails_at_once_and_writes_no_row(
    store: GatedStore, sqlite_url: str
) -> None:
    check = ClaimCheck(store, threshold=0, put_timeout=PUT_TIMEOUT, max_unanswered_puts=3)
    assert errnos(3, check.offload) == {errno.ETIMEDOUT: 3}
    outbox = Outbox(claim_check=check)
    with contextlib.closing(sqlite3.connect(sqlite_url.removeprefix("sqlite:///"))) as conn:
        began = time.monotonic()
        with pytest.raises(ClaimCheckStoreError) as busy:
            outbox.enqueue(conn, "t", {"blob": "x" * 100})
        waited = time.monotonic() - began
        conn.rollback()
        rows = conn.execute("SELECT COUNT(*) FROM outbox").fetchone()[0]
    assert busy.value.errno == errno.EBUSY
    assert "3 puts to the object store are still unanswered" in str(busy.value)
    assert waited < PUT_TIMEOUT, "failed at once, without waiting for the store"
    assert rows == 0
    assert store.puts_started == 3, "the busy put never reached the store"


def test_puts_that_return_late_free_their_slots_and_leave_no_object(store: GatedStore) -> None:
    check = ClaimCheck(store, threshold=0, put_timeout=PUT_TIMEOUT, max_unanswered_puts=2)
    errnos(2, check.offload)
    hung = [t for t in threading.enumerate() if t.name == "outboxer-claim-check-put"]
    store.answer.set()
    for thread in hung:
        thread.join(5)
    assert store.names() == [], "the late objects were deleted"
    reference = check.offload(big())
    assert store.names() == [reference.headers["outboxer-claim-check"]]


def test_async_puts_share_the_cap_and_fail_at_once(store: GatedStore) -> None:
    check = ClaimCheck(store, threshold=0, put_timeout=PUT_TIMEOUT, max_unanswered_puts=2)

    async def offload_all() -> list[int | None]:
        seen: list[int | None] = []
        for n in range(6):
            try:
                await check.offload_async(big(n))
            except ClaimCheckStoreError as exc:
                seen.append(exc.errno)
        return seen

    assert asyncio.run(offload_all()) == [errno.ETIMEDOUT] * 2 + [errno.EBUSY] * 4
    assert store.puts_started == 2


def test_a_large_async_batch_on_a_healthy_store_stays_under_the_cap(tmp_path: Path) -> None:
    check = ClaimCheck(FileObjectStore(tmp_path / "claims"), threshold=0, max_unanswered_puts=16)
    messages = [big(n) for n in range(80)]
    done = asyncio.run(check.offload_all_async(messages))
    assert len(done) == 80
    assert len(list(check.store.list_objects())) == 80


def test_max_unanswered_puts_must_be_a_whole_number_of_at_least_one(tmp_path: Path) -> None:
    from outboxer.errors import ConfigError

    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="max_unanswered_puts"):
            ClaimCheck(FileObjectStore(tmp_path), max_unanswered_puts=bad)  # type: ignore[arg-type]
