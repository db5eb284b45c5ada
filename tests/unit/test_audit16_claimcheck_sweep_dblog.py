"""The relay's claim-check sweep logs through the relay's log: with several databases in one
process, its warning that the store did not answer names the database whose cleanup ran it
(``database NAME:``, and the ``database`` field of ``--log-format json``). Before, the
warning came from the ``outboxer.claimcheck`` logger with no database in it.

A real relay on SQLite and the memory broker; the store is a FileObjectStore whose listing
waits on an Event: a test of the relay's logging, not of an adapter."""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from outboxer import Relay, load_settings, payload_admin
from outboxer.claimcheck import FileObjectStore, ObjectName, StoredObject

DATABASE = "orders"


class ListingHangs(FileObjectStore):
    """A directory store whose listing waits for ``answer``."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.answer = threading.Event()

    def list_objects(self) -> Iterator[StoredObject]:
        self.answer.wait()
        yield from super().list_objects()


async def test_the_relays_sweep_warning_names_its_database(
    sqlite_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = ListingHangs(tmp_path / "claims")
    monkeypatch.setattr(payload_admin, "object_store", lambda settings: store)
    settings = load_settings(
        {
            "db": sqlite_url,
            "database": DATABASE,
            "broker": f"memory://audit16-{uuid.uuid4().hex[:8]}",
            "cleanup_interval": "1h",  # one round, at the relay's start
        },
        environ={
            "OUTBOXER_CLAIM_CHECK_STORE": store.directory.as_uri(),
            "OUTBOXER_CLAIM_CHECK_READ_TIMEOUT": "0.2s",
        },
    )
    relay = Relay.from_settings(settings)
    caplog.set_level(logging.WARNING, logger="outboxer")
    running = asyncio.create_task(relay.run())
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5
        while not relay.stats.claim_check_sweep_failures:
            assert loop.time() < deadline, "the sweep's failure was never counted"
            await asyncio.sleep(0.02)
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
        warning = warnings[0].getMessage()
        assert warning.startswith(f"database {DATABASE}: claim-check sweep of "), warning
        assert "gave up listing" in warning
        assert getattr(warnings[0], "database", None) == DATABASE
    finally:
        relay.stop()
        store.answer.set()
        await asyncio.wait_for(running, 5)


def test_sweep_orphans_logs_to_the_log_it_is_given(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from outboxer.claimcheck import ClaimCheckSweepTimeoutError, sweep_orphans
    from outboxer.relay import DatabaseLog

    store = ListingHangs(tmp_path / "claims")

    def referenced(names: Sequence[ObjectName]) -> list[str]:
        return []

    log = DatabaseLog(logging.getLogger("outboxer.relay"), "billing")
    try:
        with (
            caplog.at_level(logging.WARNING, logger="outboxer"),
            pytest.raises(ClaimCheckSweepTimeoutError),
        ):
            sweep_orphans(store, referenced, grace=0, call_timeout=0.2, log=log)
    finally:
        store.answer.set()
    assert [r.getMessage()[:26] for r in caplog.records] == ["database billing: claim-ch"]
