"""The sweep's ``store.close()`` is bounded by ``claim_check_read_timeout`` like its other
store calls: a store whose close hangs (S3's pool on a dead connection, an application's
wrapper) no longer hangs ``outboxer claim-check sweep`` nor the relay's cleanup round; the
close is left in a daemon thread with a logged warning. Before, the sweep finished its work
and then waited on the close for ever.

The store below is a real FileObjectStore whose close waits on an Event: a test of the
sweep's handling, not of an adapter."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from outboxer import Relay, load_settings, payload_admin
from outboxer.claimcheck import FileObjectStore, object_name
from outboxer.cli import EXIT_OK, main
from outboxer.message import uuid7
from outboxer.relay import cleanup
from tests.waiting import wait_for, within

TIMEOUT = 0.2


class CloseHangs(FileObjectStore):
    """A directory store whose close waits for ``answer``."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.answer = threading.Event()
        self.closing = threading.Event()

    def close(self) -> None:
        self.closing.set()
        self.answer.wait()


def sweep_threads() -> int:
    return sum(t.name == "outboxer-claim-check-sweep" for t in threading.enumerate())


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[CloseHangs]:
    hanging = CloseHangs(tmp_path / "claims")
    old = 1_000_000_000.0
    for _ in range(2):  # orphans: the sweep has work to do before the close
        path = hanging.directory / object_name(uuid7(), "default")
        path.write_bytes(b"o")
        os.utime(path, (old, old))
    monkeypatch.setattr(payload_admin, "object_store", lambda settings: hanging)
    threads = sweep_threads()
    yield hanging
    hanging.answer.set()  # the hung close ends, and gives its sweep slot back
    wait_for(lambda: sweep_threads() <= threads, 5, "the hung close's thread did not end")


def settings_env(sqlite_url: str, store: FileObjectStore) -> dict[str, str]:
    return {
        "OUTBOXER_DB": sqlite_url,
        "OUTBOXER_CLAIM_CHECK_STORE": store.directory.as_uri(),
        "OUTBOXER_CLAIM_CHECK_READ_TIMEOUT": f"{TIMEOUT}s",
        "OUTBOXER_CLAIM_CHECK_SWEEP_GRACE": "0",
    }


def test_the_cli_sweep_ends_despite_a_hung_close(
    sqlite_url: str,
    store: CloseHangs,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    for name, value in settings_env(sqlite_url, store).items():
        monkeypatch.setenv(name, value)
    began = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="outboxer.claimcheck"):
        code = within(5, "outboxer claim-check sweep", lambda: main(["claim-check", "sweep"]))
    out, err = capsys.readouterr()
    assert (code, out) == (EXIT_OK, "deleted 2 orphaned claim-check object(s)\n"), err
    assert time.monotonic() - began < TIMEOUT + 2
    assert store.closing.is_set()
    assert f"did not close within {TIMEOUT:g} s" in caplog.text
    assert list(store.list_objects()) == []


def test_the_relay_cleanup_round_ends_despite_a_hung_close(
    sqlite_url: str, store: CloseHangs
) -> None:
    settings = load_settings(
        {"db": sqlite_url, "broker": "memory://audit16close"},
        environ=settings_env(sqlite_url, store),
    )

    async def clean() -> int:
        relay = Relay.from_settings(settings)
        await relay.store.connect()
        try:
            return await cleanup(relay.store, settings)
        finally:
            await relay.store.close()

    # asyncio.run as the relay's process does.
    assert within(5, "the relay's cleanup", lambda: asyncio.run(clean())) == 0
    assert store.closing.is_set()
    assert list(store.list_objects()) == []


def test_close_store_raises_what_the_close_raised(tmp_path: Path) -> None:
    from outboxer.claimcheck import close_store  # new: the tests above run on older code too

    class CloseFails(FileObjectStore):
        def close(self) -> None:
            raise OSError("pool already closed")

    with pytest.raises(OSError, match="pool already closed"):
        close_store(CloseFails(tmp_path / "claims"), timeout=TIMEOUT)
    assert close_store(FileObjectStore(tmp_path / "claims"), timeout=TIMEOUT) is True
