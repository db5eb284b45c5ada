"""Review of the replay's store bounds (00f6b03) against a store that stops answering.

- A put not answered within ``put_timeout`` is a ReplayError like a read's (rolled back,
  nothing written; the HTTP API's 503, the CLI's message): it was a ClaimCheckStoreError,
  which ``admin.replay`` took for a possibly committed failure (the copies' objects kept)
  and the HTTP API for a bug (500, "internal server error").
- After a call was given up on, the copier tries no more: the objects of the copies rolled
  back are left to the sweep (logged), and the store is not closed, instead of one more
  wait (and one more hung thread) each.
- ``discard_objects`` ran ``delete_many`` on the event loop, unbounded: a store whose
  deletes hang blocked the loop for ever (``outboxer serve``: every request, the relays in
  the process). Now bounded by ``read_timeout``, in a worker thread.
- ``close`` was unbounded (the HTTP API awaited it in a thread for ever, the CLI hung).

The store is a real FileObjectStore whose calls wait on an Event once told to (a dead NFS
mount); the database a real SQLite file.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from outboxer import Outbox, admin
from outboxer.admin import MessageFilter, ReplayCopier
from outboxer.claimcheck import ClaimCheck, FileObjectStore
from outboxer.crypto import KeyRing, generate_key
from outboxer.errors import ReplayError
from outboxer.stores import create_store
from outboxer.stores.sqlite import sqlite_path
from tests.integration.test_audit17_rotatebound_hung_store import Hangs, store_threads
from tests.waiting import wait_for, within

TIMEOUT = 0.3


class HangsToo(Hangs):
    """Hangs, whose close and n-th put (when set) wait for ``answer`` as well."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.hang_close = False
        self.puts_answered: int | None = None  # None: every put is answered
        self.puts = 0

    def put(self, name: str, data: bytes) -> None:
        with self._lock:
            self.puts += 1
            hang = self.puts_answered is not None and self.puts > self.puts_answered
        if hang:
            self.answer.wait()
        super().put(name, data)

    def close(self) -> None:
        if self.hang_close:
            self.answer.wait()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[HangsToo]:
    hanging = HangsToo(tmp_path / "claims")
    yield hanging
    hanging.answer.set()
    wait_for(lambda: not store_threads(), 5, "hung store threads did not end")


def published(sqlite_url: str, store: FileObjectStore, *, encrypted_last: bool = False) -> None:
    """Two claim-checked rows, PUBLISHED; with ``encrypted_last`` an encrypted one after
    them, which a copier without keys refuses (ReplayError)."""
    conn = sqlite3.connect(sqlite_path(sqlite_url))
    try:
        outbox = Outbox(claim_check=ClaimCheck(store, threshold=10))
        for n in range(2):
            outbox.enqueue(conn, "t", {"n": n, "blob": "x" * 100}, key=f"k{n}")
        if encrypted_last:
            Outbox(encryption=KeyRing({"k1": generate_key()})).enqueue(conn, "t", {"n": 2})
        conn.execute("UPDATE outbox SET status = 'PUBLISHED'")
        conn.commit()
    finally:
        conn.close()


def test_a_put_not_answered_is_a_replay_error_and_no_further_call_is_made(
    sqlite_url: str, store: HangsToo, caplog: pytest.LogCaptureFixture
) -> None:
    published(sqlite_url, store)
    store.puts_answered = 2 + 1  # the two rows' own objects, then the first copy's
    copier = ReplayCopier(object_store=store, read_timeout=TIMEOUT, put_timeout=TIMEOUT)

    async def replay() -> object:
        async with create_store(sqlite_url) as db:
            try:
                return await admin.replay(db, MessageFilter(), everything=True, copier=copier)
            finally:
                left = await db.count_matching(MessageFilter())
                assert left == {"default": {"PUBLISHED": 2}}, "nothing written"

    began = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="outboxer.admin"):
        outcome = within(8, "the replay", lambda: asyncio.run(replay()))
        copier.close()
    took = time.monotonic() - began
    assert isinstance(outcome, ReplayError), repr(outcome)
    assert "cannot be replayed: claim-check store FileObjectStore(" in str(outcome)
    assert f"no answer within {TIMEOUT:g} s" in str(outcome)
    assert took < TIMEOUT + 3, took
    # The first copy's object: not deleted (the store is not answering), left to the sweep.
    assert store.deletes_started == 0
    [line] = [r.getMessage() for r in caplog.records if "not deleted" in r.getMessage()]
    assert "1 unused claim-check object(s) not deleted" in line and "sweep" in line
    assert store_threads() == {"outboxer-claim-check-put": 1}, "one put left hung, no more"


def test_discarding_objects_of_a_hung_store_never_blocks_the_event_loop(
    sqlite_url: str, store: HangsToo, caplog: pytest.LogCaptureFixture
) -> None:
    published(sqlite_url, store, encrypted_last=True)
    store.hang_deletes = True  # reads and puts answer: the encrypted row is refused
    copier = ReplayCopier(object_store=store, read_timeout=TIMEOUT, put_timeout=TIMEOUT)
    ticks_while_deleting = 0

    async def replay() -> object:
        nonlocal ticks_while_deleting

        async def tick() -> None:
            nonlocal ticks_while_deleting
            while True:
                await asyncio.sleep(0.01)
                if store.deletes_started:
                    ticks_while_deleting += 1

        ticker = asyncio.create_task(tick())
        try:
            async with create_store(sqlite_url) as db:
                return await admin.replay(db, MessageFilter(), everything=True, copier=copier)
        finally:
            ticker.cancel()

    with caplog.at_level(logging.WARNING, logger="outboxer.admin"):
        outcome = within(5, "the replay (its loop blocked?)", lambda: asyncio.run(replay()))
    assert isinstance(outcome, ReplayError) and "is encrypted" in str(outcome), repr(outcome)
    assert store.deletes_started == 1
    assert ticks_while_deleting > 0, "the loop ran while the delete hung"
    [line] = [r.getMessage() for r in caplog.records if "not deleted" in r.getMessage()]
    assert f"did not delete 2 object(s) within {TIMEOUT:g} s" in line, line
    assert store_threads() == {"outboxer-claim-check-delete": 1}
    # The store did not answer: closing it is not tried (one more wait, one more thread).
    store.hang_close = True
    within(3, "ReplayCopier.close", copier.close)
    assert store_threads() == {"outboxer-claim-check-delete": 1}


def test_closing_a_store_whose_close_hangs_is_bounded(store: HangsToo) -> None:
    store.hang_close = True
    copier = ReplayCopier(object_store=store, read_timeout=TIMEOUT)
    began = time.monotonic()
    within(5, "ReplayCopier.close", copier.close)
    assert time.monotonic() - began < TIMEOUT + 2
    assert store_threads() == {"outboxer-claim-check-sweep": 1}
