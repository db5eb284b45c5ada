"""``outboxer keys rotate`` against a claim-check store that stops answering reads or
deletes (a hard NFS mount gone dead), on PostgreSQL and SQLite.

Before, the rotation read a claim-checked row's object (``fetch_payload``) and deleted the
old objects after each batch's commit (``store.delete_many``) with no bound: a hung read
blocked the command for ever inside the batch's open transaction (its rows locked, on
SQLite the database's write lock), a hung delete blocked it for ever after the commit.
Now a read is given up after ``claim_check_read_timeout`` (exit 1, naming the store; the
batch rolls back, committed batches stay, a rerun goes on), and a delete after it too:
the rows stay rotated, the objects are left to the orphan sweep (logged, exit 0), and the
run leaves one thread behind, not one per batch.

The store is a real FileObjectStore whose reads or deletes wait on an Event once told to;
the command is the CLI's ``main``, run in a thread so that a hang fails the test."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from outboxer import Outbox, payload_admin
from outboxer.claimcheck import (
    HEADER_CLAIM_CHECK,
    ClaimCheck,
    FileObjectStore,
    fetch_payload,
)
from outboxer.cli import EXIT_ERROR, EXIT_OK, main
from outboxer.crypto import KeyRing, decrypt, generate_key
from outboxer.payload_admin import payload_table
from tests.integration.test_enqueue_protection import raw_rows, writer
from tests.waiting import wait_for, within

K1, K2 = generate_key(), generate_key()
TIMEOUT = 0.3
THRESHOLD = 200


class Hangs(FileObjectStore):
    """A directory store whose reads (past the first ``reads_answered``) or deletes, as
    set, wait for ``answer``: a dead NFS mount."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.answer = threading.Event()
        self.hang_deletes = False
        self.hang_puts = False
        self.reads_answered: int | None = None  # None: every read is answered
        self._lock = threading.Lock()
        self.reads = 0
        self.deletes_started = 0

    def get_at_most(self, name: str, max_size: int) -> bytes:
        with self._lock:
            self.reads += 1
            hang = self.reads_answered is not None and self.reads > self.reads_answered
        if hang:
            self.answer.wait()
        return super().get_at_most(name, max_size)

    def put(self, name: str, data: bytes) -> None:
        if self.hang_puts:
            self.answer.wait()
        super().put(name, data)

    def delete(self, name: str) -> bool:
        if self.hang_deletes:
            with self._lock:
                self.deletes_started += 1
            self.answer.wait()
        return super().delete(name)


@pytest.fixture(params=["pg_url", "sqlite_url"])
def db_url(request: pytest.FixtureRequest) -> str:
    url: str = request.getfixturevalue(request.param)
    return url


def store_threads() -> dict[str, int]:
    counts: dict[str, int] = {}
    for thread in threading.enumerate():
        if thread.name.startswith("outboxer-claim-check-"):
            counts[thread.name] = counts.get(thread.name, 0) + 1
    return counts


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Hangs]:
    hanging = Hangs(tmp_path / "claims")
    yield hanging
    hanging.answer.set()  # the hung calls end with the test
    wait_for(lambda: not store_threads(), 5, "hung store threads did not end")


def enqueue_claim_checked(url: str, store: FileObjectStore, rows: int) -> list[str]:
    """``rows`` claim-checked rows under k1; their objects' names."""
    outbox = Outbox(
        encryption=KeyRing({"k1": K1}), claim_check=ClaimCheck(store, threshold=THRESHOLD)
    )
    conn = writer(url)
    try:
        for n in range(rows):
            outbox.enqueue(conn, "big", {"n": n, "blob": "x" * 500})
        conn.commit()
    finally:
        conn.close()
    return [row.headers[HEADER_CLAIM_CHECK] for row in raw_rows(url)]


@pytest.fixture
def cli_env(db_url: str, store: Hangs, monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    # The command builds its store from the URL: the hanging one in its place.
    monkeypatch.setattr(payload_admin, "create_object_store", lambda url: store)
    monkeypatch.setenv("OUTBOXER_DB", db_url)
    monkeypatch.setenv("OUTBOXER_ENCRYPTION_KEYS", f"k1={K1},k2={K2}")
    monkeypatch.setenv("OUTBOXER_ENCRYPTION_CURRENT_KEY", "k2")
    monkeypatch.setenv("OUTBOXER_CLAIM_CHECK_STORE", store.directory.as_uri())
    monkeypatch.setenv("OUTBOXER_CLAIM_CHECK_READ_TIMEOUT", f"{TIMEOUT}s")
    return monkeypatch


def rotate(capsys: pytest.CaptureFixture[str], *flags: str) -> tuple[int, str, str, float]:
    began = time.monotonic()
    code = within(8, "outboxer keys rotate", lambda: main(["keys", "rotate", *flags]))
    elapsed = time.monotonic() - began
    out, err = capsys.readouterr()
    assert isinstance(code, int), code
    return code, out, err, elapsed


def test_a_hung_read_stops_the_rotation_within_the_read_timeout_and_a_rerun_goes_on(
    db_url: str,
    store: Hangs,
    cli_env: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    objects = enqueue_claim_checked(db_url, store, 6)
    # Batches of two: the first commits, the second puts its first row's new object and
    # then waits on its second row's read, which never comes.
    store.reads_answered = 3

    with caplog.at_level(logging.WARNING, logger="outboxer.payload_admin"):
        code, out, err, elapsed = rotate(capsys, "--rotation-batch", "2")

    assert code == EXIT_ERROR, (out, err)
    assert err.startswith("outboxer keys rotate: stopped: claim-check object "), err
    assert f"FileObjectStore({str(store.directory)!r}) did not answer within {TIMEOUT:g} s" in err
    assert "(claim_check_read_timeout)" in err
    assert "2 message(s) re-encrypted in committed batches keep the new key" in err
    assert TIMEOUT <= elapsed < TIMEOUT + 3, elapsed
    assert store_threads() == {"outboxer-claim-check-read": 1}, "one read left hung"
    # The first batch committed; the second rolled back: its rows on their old objects.
    rows = raw_rows(db_url)
    assert [row.headers["outboxer-key-id"] for row in rows] == ["k2"] * 2 + ["k1"] * 4
    assert [row.headers[HEADER_CLAIM_CHECK] for row in rows][2:] == objects[2:]
    # The rolled-back row's new object: not deleted (the store is not answering), logged.
    [orphan_line] = [r.getMessage() for r in caplog.records if "not deleted" in r.getMessage()]
    assert "1 new object(s) of the batch rolled back not deleted" in orphan_line
    assert "outboxer claim-check sweep" in orphan_line

    store.answer.set()  # the mount comes back
    store.reads_answered = None
    code, out, err, _ = rotate(capsys, "--rotation-batch", "2")
    assert (code, out.splitlines()[0]) == (EXIT_OK, "re-encrypted 4 message(s) under key k2"), err
    ring = KeyRing({"k2": K2})
    for n, row in enumerate(raw_rows(db_url)):
        assert row.headers["outboxer-key-id"] == "k2"
        assert json.loads(decrypt(fetch_payload(row, store), ring).payload)["n"] == n


def test_a_hung_delete_after_the_commit_leaves_the_rows_rotated_and_the_objects_to_the_sweep(
    db_url: str,
    store: Hangs,
    cli_env: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    rows = 30
    old_objects = enqueue_claim_checked(db_url, store, rows)
    store.hang_deletes = True

    with caplog.at_level(logging.WARNING, logger="outboxer.payload_admin"):
        code, out, err, elapsed = rotate(capsys, "--rotation-batch", "3")

    # Exit 0: every row is rotated, a rerun would find nothing to do; the objects left
    # behind are the sweep's, as after a crash between a batch's commit and its deletes.
    assert code == EXIT_OK, err
    assert out.splitlines()[0] == f"re-encrypted {rows} message(s) under key k2"
    assert f"warning: {rows} claim-check object(s) no row refers to any more" in err
    assert "`outboxer claim-check sweep` deletes them" in err
    # One delete waited for (the first batch's); the other nine batches' were not tried.
    assert elapsed < TIMEOUT + 3, elapsed
    assert store.deletes_started == 1
    assert store_threads() == {"outboxer-claim-check-delete": 1}, "one thread, not one a batch"
    lines = [r.getMessage() for r in caplog.records if "not deleted" in r.getMessage()]
    assert len(lines) == 10
    assert f"did not delete 3 object(s) within {TIMEOUT:g} s" in lines[0]
    assert all("not tried, the store did not answer earlier" in line for line in lines[1:])

    ring = KeyRing({"k2": K2})
    new_objects = []
    for n, row in enumerate(raw_rows(db_url)):
        assert row.headers["outboxer-key-id"] == "k2"
        assert json.loads(decrypt(fetch_payload(row, store), ring).payload)["n"] == n
        new_objects.append(row.headers[HEADER_CLAIM_CHECK])
    stored = {stored.name for stored in store.list_objects()}
    assert stored == set(old_objects) | set(new_objects)

    # The store answers again; the sweep deletes the orphans, and only them.
    store.hang_deletes = False
    store.answer.set()
    wait_for(lambda: not store_threads(), 5, "the hung delete did not end")
    with payload_table(db_url) as table:
        table.sweep(store, grace=0)
    assert {stored.name for stored in store.list_objects()} == set(new_objects)


def test_claim_check_put_timeout_bounds_the_rotations_puts(
    db_url: str,
    store: Hangs,
    cli_env: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    enqueue_claim_checked(db_url, store, 4)
    store.hang_puts = True
    cli_env.setenv("OUTBOXER_CLAIM_CHECK_PUT_TIMEOUT", f"{TIMEOUT}s")  # 30 s before, fixed

    code, _, err, elapsed = rotate(capsys)

    assert code == EXIT_ERROR, err
    assert err.startswith("outboxer keys rotate: stopped: claim-check store FileObjectStore("), err
    assert f"no answer within {TIMEOUT:g} s (put_timeout)" in err
    assert TIMEOUT <= elapsed < TIMEOUT + 3, elapsed
    assert store_threads() == {"outboxer-claim-check-put": 1}
    assert {row.headers["outboxer-key-id"] for row in raw_rows(db_url)} == {"k1"}
