"""``outboxer dead-letters purge`` against a claim-check store that stops answering both the
holds' release and its close (a dead NFS mount): the command waits one
``claim_check_read_timeout`` and leaves one thread. Before (e8bb723), the close was tried
after the release was given up on: a second wait and a second hung thread, two of the
process's four sweep slots."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from outboxer import payload_admin
from outboxer.claimcheck import FileObjectStore
from outboxer.cli import main
from tests.integration.test_audit12_ccretain_dead_letter_hold import dead_lettered
from tests.integration.test_audit17_rotatebound_hung_store import store_threads
from tests.waiting import wait_for

TIMEOUT = 0.3


class HangsOnHolds(FileObjectStore):
    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.answer = threading.Event()

    def delete_hold(self, name: str, holder: str) -> None:
        self.answer.wait()
        super().delete_hold(name, holder)

    def close(self) -> None:
        self.answer.wait()


async def test_a_purge_whose_store_hangs_waits_one_timeout_and_leaves_one_thread(
    pg_url: str, sqlite_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = tmp_path / "claims"
    await dead_lettered(pg_url, sqlite_url, directory.as_uri())
    hung = HangsOnHolds(directory)
    monkeypatch.setattr(payload_admin, "create_object_store", lambda url: hung)
    monkeypatch.setenv("OUTBOXER_CLAIM_CHECK_READ_TIMEOUT", f"{TIMEOUT}s")
    args = ["dead-letters", "purge", "--all", "--db", sqlite_url, "--group", "g"]
    try:
        began = time.monotonic()
        code = await asyncio.wait_for(
            asyncio.to_thread(main, [*args, "--claim-check-store", directory.as_uri()]), 8
        )
        took = time.monotonic() - began
        threads = store_threads()
    finally:
        hung.answer.set()
        wait_for(lambda: not store_threads(), 5, "hung store threads did not end")
    assert code == 0
    assert threads == {"outboxer-claim-check-call": 1}, threads
    # The one thread left is what shows one wait (a second wait left a second thread);
    # the time only shows the command returned without the store: a loaded box's CLI
    # run took 1.7 s besides the wait, too close to a second wait's 0.3 s to tell apart.
    assert took < 2 * TIMEOUT + 3, took
