"""The claim-check sweep bounds each call to the object store: a store that hangs (its
listing, ``held`` or deletes never answer) ends the sweep with ClaimCheckSweepTimeoutError,
a logged warning and a counted failure, never a hang, so neither ``outboxer claim-check
sweep`` nor the relay's cleanup (which runs it, and awaits it at shutdown) sticks; the next
sweep tries again. Before, the sweep waited on the store for ever.

The store below blocks on an Event: a unit test of the bounding logic, not of an adapter."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from outboxer import Settings, load_settings, payload_admin
from outboxer.claimcheck import (
    ClaimCheckSweepTimeoutError,
    FileObjectStore,
    ObjectName,
    StoredObject,
    object_name,
    sweep_failures,
    sweep_orphans,
    sweep_orphans_async,
)
from outboxer.message import uuid7
from tests.waiting import within

TIMEOUT = 0.2


class HangingStore(FileObjectStore):
    """A directory store whose calls named in ``hang`` wait until ``answer`` is set."""

    def __init__(self, directory: Path, hang: set[str]) -> None:
        super().__init__(directory)
        self.hang = hang
        self.answer = threading.Event()

    def _maybe_hang(self, call: str) -> None:
        if call in self.hang:
            self.answer.wait()

    def list_objects(self) -> Iterator[StoredObject]:
        self._maybe_hang("list")
        yield from super().list_objects()

    def held(self) -> set[str]:
        self._maybe_hang("held")
        return super().held()

    def delete_many(self, names: Sequence[str]) -> None:
        self._maybe_hang("delete")
        super().delete_many(names)


def orphans(store: FileObjectStore, count: int) -> None:
    old = 1_000_000_000.0
    for _ in range(count):
        path = store.directory / object_name(uuid7(), "default")
        path.write_bytes(b"o")
        os.utime(path, (old, old))


def nothing_referenced(names: Sequence[ObjectName]) -> list[str]:
    return []


@pytest.mark.parametrize("hang", ["list", "held", "delete"])
def test_a_hung_store_ends_the_sweep_with_a_warning_and_a_counted_failure(
    tmp_path: Path, hang: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = HangingStore(tmp_path / "claims", {hang})
    orphans(store, 3)
    failures = sweep_failures()
    outcome: list[BaseException | int] = []

    def sweep() -> None:
        try:
            outcome.append(sweep_orphans(store, nothing_referenced, grace=0, call_timeout=TIMEOUT))
        except BaseException as exc:  # the test reads it
            outcome.append(exc)

    sweeper = threading.Thread(target=sweep, daemon=True)
    began = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="outboxer.claimcheck"):
        sweeper.start()
        sweeper.join(5)
    try:
        assert not sweeper.is_alive(), "the sweep hung with the store"
        assert time.monotonic() - began < TIMEOUT + 2
        assert isinstance(outcome[0], ClaimCheckSweepTimeoutError)
        assert sweep_failures() == failures + 1
        assert "the next sweep tries again" in caplog.text
    finally:
        store.answer.set()
    # The store answers again: the next sweep does the work (the late delete may have
    # done part of it).
    store.hang = set()
    sweep_orphans(store, nothing_referenced, grace=0, call_timeout=TIMEOUT)
    assert list(store.list_objects()) == []


def test_the_async_sweep_is_bounded_too(tmp_path: Path) -> None:
    store = HangingStore(tmp_path / "claims", {"list"})
    orphans(store, 2)

    async def referenced(names: Sequence[ObjectName]) -> list[str]:
        return []

    async def sweep() -> float:
        began = time.monotonic()
        with pytest.raises(ClaimCheckSweepTimeoutError):
            await asyncio.wait_for(
                sweep_orphans_async(store, referenced, grace=0, call_timeout=TIMEOUT), 5
            )
        return time.monotonic() - began

    try:
        assert asyncio.run(sweep()) < TIMEOUT + 2
    finally:
        store.answer.set()


def test_the_relay_cleanup_and_the_cli_sweep_pass_the_read_timeout(
    sqlite_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``payload_admin.sweep_claim_checks`` (the CLI's, and the relay cleanup's through a
    thread) gives up after ``claim_check_read_timeout``."""
    store = HangingStore(tmp_path / "claims", {"list"})
    orphans(store, 1)
    monkeypatch.setattr(payload_admin, "object_store", lambda settings: store)
    settings = hung_store_settings(sqlite_url, store, {"OUTBOXER_CLAIM_CHECK_SWEEP_GRACE": "0"})
    try:
        outcome = within(5, "the sweep", lambda: payload_admin.sweep_claim_checks(settings))
        assert isinstance(outcome, ClaimCheckSweepTimeoutError)
    finally:
        store.answer.set()


def test_the_relay_cleanup_ends_despite_a_hung_store(
    sqlite_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from outboxer import Relay
    from outboxer.relay import cleanup

    store = HangingStore(tmp_path / "claims", {"list"})
    monkeypatch.setattr(payload_admin, "object_store", lambda settings: store)
    settings = hung_store_settings(sqlite_url, store)

    async def clean() -> int:
        relay = Relay.from_settings(settings)
        await relay.store.connect()
        try:
            return await cleanup(relay.store, settings)
        finally:
            await relay.store.close()

    # asyncio.run joins its executor's threads: a sweep hung in one kept it from returning.
    try:
        outcome = within(5, "the relay's cleanup", lambda: asyncio.run(clean()))
        assert isinstance(outcome, ClaimCheckSweepTimeoutError)
    finally:
        store.answer.set()


def hung_store_settings(
    sqlite_url: str, store: FileObjectStore, extra: dict[str, str] | None = None
) -> Settings:
    """A relay's settings on ``store``, its calls given up after TIMEOUT."""
    return load_settings(
        {"db": sqlite_url, "broker": "memory://audit14cc"},
        environ={
            "OUTBOXER_CLAIM_CHECK_STORE": store.directory.as_uri(),
            "OUTBOXER_CLAIM_CHECK_READ_TIMEOUT": f"{TIMEOUT}s",
            **(extra or {}),
        },
    )
