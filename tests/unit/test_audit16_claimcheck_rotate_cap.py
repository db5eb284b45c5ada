"""``outboxer keys rotate`` against an object store whose puts hang: the rotation ends with
a clear error after one ``put_timeout``, leaving at most one hung put thread, and every put
of a run goes through one ClaimCheck, so its ``max_unanswered_puts`` bounds them all.

Before, the rotation made a ClaimCheck per claim-checked row (its own cap, and the default
30 s put timeout whatever the caller's), recorded each timed-out put as that row's failure
and went on to the next row: one daemon thread left hung per row, without bound, and the
command ran for 30 s per row.

The store below is a real FileObjectStore whose puts wait on an Event (a dead NFS mount):
a test of the rotation's handling, not of an adapter."""

from __future__ import annotations

import errno
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from outboxer import Outbox, payload_admin
from outboxer.claimcheck import (
    HEADER_CLAIM_CHECK,
    ClaimCheck,
    ClaimCheckStoreError,
    FileObjectStore,
)
from outboxer.cli import EXIT_ERROR, main
from outboxer.crypto import KeyRing, generate_key
from outboxer.payload_admin import payload_table
from tests.integration.test_enqueue_protection import raw_rows, writer
from tests.waiting import wait_for, within

K1, K2 = generate_key(), generate_key()
ROWS = 6
PUT_TIMEOUT = 0.2
THRESHOLD = 200


class PutHangs(FileObjectStore):
    """A directory store whose puts wait for ``answer``; reads and deletes work."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.answer = threading.Event()
        self._lock = threading.Lock()
        self.puts_started = 0

    def put(self, name: str, data: bytes) -> None:
        with self._lock:
            self.puts_started += 1
        self.answer.wait()
        super().put(name, data)


def put_threads() -> int:
    return sum(t.name == "outboxer-claim-check-put" for t in threading.enumerate())


@pytest.fixture
def claim_checked_rows(sqlite_url: str, tmp_path: Path) -> list[str]:
    """ROWS claim-checked rows under key k1 (their objects in tmp_path/claims)."""
    store = FileObjectStore(tmp_path / "claims")
    outbox = Outbox(
        encryption=KeyRing({"k1": K1}), claim_check=ClaimCheck(store, threshold=THRESHOLD)
    )
    conn = writer(sqlite_url)
    try:
        for n in range(ROWS):
            outbox.enqueue(conn, "big", {"n": n, "blob": "x" * 500})
        conn.commit()
    finally:
        conn.close()
    return [row.headers[HEADER_CLAIM_CHECK] for row in raw_rows(sqlite_url)]


@pytest.fixture
def hanging(tmp_path: Path) -> Iterator[PutHangs]:
    store = PutHangs(tmp_path / "claims")
    threads = put_threads()
    yield store
    store.answer.set()  # the hung puts end (their late objects deleted) with the test
    wait_for(lambda: put_threads() <= threads, 5, "hung put threads did not end")


def test_a_hung_store_stops_the_rotation_after_one_put_and_the_run_shares_one_cap(
    sqlite_url: str, claim_checked_rows: list[str], hanging: PutHangs
) -> None:
    ring = KeyRing({"k1": K1, "k2": K2})
    claim_check = ClaimCheck(
        hanging, threshold=THRESHOLD, put_timeout=PUT_TIMEOUT, max_unanswered_puts=1
    )
    threads = put_threads()

    def rotate() -> object:
        with payload_table(sqlite_url) as table:
            return table.rotate(ring, batch=2, claim_check=claim_check)

    began = time.monotonic()
    stopped = within(5, "the rotation", rotate)
    assert isinstance(stopped, ClaimCheckStoreError), stopped
    assert stopped.errno == errno.ETIMEDOUT
    assert "put_timeout" in str(stopped)
    assert time.monotonic() - began < PUT_TIMEOUT + 2
    # One row's put, one thread left hung: not one per row.
    assert (hanging.puts_started, put_threads() - threads) == (1, 1)
    # Nothing committed: every row still under k1, still on its object.
    rows = raw_rows(sqlite_url)
    assert {row.headers["outboxer-key-id"] for row in rows} == {"k1"}
    assert [row.headers[HEADER_CLAIM_CHECK] for row in rows] == claim_checked_rows

    # A second run on the same ClaimCheck: its cap (1) is taken by the hung put, so the
    # first row's put fails at once, with no thread started.
    began = time.monotonic()
    busy = within(5, "the second rotation", rotate)
    assert isinstance(busy, ClaimCheckStoreError), busy
    assert busy.errno == errno.EBUSY
    assert time.monotonic() - began < 1
    assert (hanging.puts_started, put_threads() - threads) == (1, 1)


def test_the_cli_rotation_exits_with_an_error_naming_the_store(
    sqlite_url: str,
    claim_checked_rows: list[str],
    hanging: PutHangs,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The command's own ClaimCheck, with a put timeout a test can wait for.
    monkeypatch.setattr(
        payload_admin,
        "claim_check",
        lambda settings: ClaimCheck(hanging, threshold=THRESHOLD, put_timeout=PUT_TIMEOUT),
    )
    monkeypatch.setenv("OUTBOXER_DB", sqlite_url)
    monkeypatch.setenv("OUTBOXER_ENCRYPTION_KEYS", f"k1={K1},k2={K2}")
    monkeypatch.setenv("OUTBOXER_ENCRYPTION_CURRENT_KEY", "k2")
    monkeypatch.setenv("OUTBOXER_CLAIM_CHECK_STORE", hanging.directory.as_uri())
    threads = put_threads()

    code = within(5, "outboxer keys rotate", lambda: main(["keys", "rotate"]))
    _, err = capsys.readouterr()
    assert code == EXIT_ERROR, err
    assert err.startswith("outboxer keys rotate: stopped: claim-check store FileObjectStore("), err
    assert f"no answer within {PUT_TIMEOUT:g} s (put_timeout)" in err
    assert "0 message(s) re-encrypted in committed batches" in err
    assert "run it again once the claim-check store answers" in err
    assert (hanging.puts_started, put_threads() - threads) == (1, 1)
    assert {row.headers["outboxer-key-id"] for row in raw_rows(sqlite_url)} == {"k1"}
