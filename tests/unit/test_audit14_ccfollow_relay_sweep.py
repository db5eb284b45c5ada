"""The relay's claim-check sweep, run by its cleanup, against a store whose listing hangs:

- a sweep that gives up is counted (``RelayStats.claim_check_sweep_failures``, exported as
  ``outboxer_claim_check_sweep_failures_total{database}``), logged once, and the round's
  deleted rows still count in ``cleaned`` (before: uncounted, a second warning "cleanup
  failed", and the round's ``cleaned`` lost);
- a relay stopped mid-sweep exits at once (before: ``asyncio.run`` joined the default
  executor's thread the sweep ran in, up to ``claim_check_read_timeout``), and the next
  sweep redoes what the abandoned one left.

A real relay on SQLite and the memory broker; the store is a FileObjectStore whose listing
waits on an Event: a test of the relay's handling, not of an adapter."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

import outboxer
from outboxer import Relay, Settings, load_settings, payload_admin
from outboxer.claimcheck import FileObjectStore, StoredObject
from outboxer.metrics import Metrics
from outboxer.stores.sqlite import sqlite_path
from tests.unit.test_audit14_cc_sweep_bounded import orphans

FINISHED_ROWS = 3


class ListingHangs(FileObjectStore):
    """A directory store whose listing says it began (``listing``), then waits for ``answer``."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.listing = threading.Event()
        self.answer = threading.Event()

    def list_objects(self) -> Iterator[StoredObject]:
        self.listing.set()
        self.answer.wait()
        yield from super().list_objects()


def finished_rows_past_retention(sqlite_url: str) -> None:
    conn = sqlite3.connect(sqlite_path(sqlite_url))
    with conn:
        for n in range(FINISHED_ROWS):
            outboxer.enqueue(conn, "t", {"n": n})
        conn.execute("UPDATE outbox SET status = 'PUBLISHED', updated_at = updated_at - 1000000")
    conn.close()


def relay_settings(
    sqlite_url: str, store: FileObjectStore, read_timeout: str, monkeypatch: pytest.MonkeyPatch
) -> Settings:
    monkeypatch.setattr(payload_admin, "object_store", lambda settings: store)
    return load_settings(
        {
            "db": sqlite_url,
            "broker": f"memory://ccfollow-{uuid.uuid4().hex[:8]}",
            "published_retention": "1s",
            "cleanup_interval": "1h",  # one round, at the relay's start
        },
        environ={
            "OUTBOXER_CLAIM_CHECK_STORE": store.directory.as_uri(),
            "OUTBOXER_CLAIM_CHECK_READ_TIMEOUT": read_timeout,
            "OUTBOXER_CLAIM_CHECK_SWEEP_GRACE": "0",
        },
    )


def scraped_sweep_failures(relay: Relay) -> float:
    metrics = Metrics(list(relay.publishers))
    metrics.watch_relay(relay)
    body, _ = metrics.render()
    return next(
        sample.value
        for family in text_string_to_metric_families(body.decode())
        for sample in family.samples
        if sample.name == "outboxer_claim_check_sweep_failures_total"
        and sample.labels == {"database": "default"}
    )


async def test_a_failed_sweep_is_counted_logged_once_and_the_rounds_rows_still_count(
    sqlite_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    finished_rows_past_retention(sqlite_url)
    store = ListingHangs(tmp_path / "claims")
    relay = Relay.from_settings(relay_settings(sqlite_url, store, "0.2s", monkeypatch))
    caplog.set_level(logging.WARNING, logger="outboxer")
    running = asyncio.create_task(relay.run())
    try:
        # The counter goes up after the sweep's own warning and before any the relay adds.
        for _ in range(100):
            if getattr(relay.stats, "claim_check_sweep_failures", 0):
                break
            await asyncio.sleep(0.05)
        assert getattr(relay.stats, "claim_check_sweep_failures", 0) == 1, "failure not counted"
        assert scraped_sweep_failures(relay) == 1
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1, warnings
        assert "gave up listing" in warnings[0]
        assert relay.stats.cleaned == FINISHED_ROWS, "the round's deleted rows were not counted"
        # Rows' retention goes on and the relay publishes: no reason to call it unhealthy.
        assert not [p for p in relay.health_problems() if "claim-check" in p]
    finally:
        relay.stop()
        store.answer.set()
        await asyncio.wait_for(running, 5)


def test_a_relay_stopped_mid_sweep_exits_at_once_and_the_next_sweep_redoes_it(
    sqlite_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = ListingHangs(tmp_path / "claims")
    orphans(store, 2)
    # Longer than the test may take: a relay that waits for the hung call cannot pass.
    settings = relay_settings(sqlite_url, store, "60s", monkeypatch)
    stopped_at: list[float] = []

    async def run_and_stop_mid_sweep() -> None:
        relay = Relay.from_settings(settings)
        running = asyncio.create_task(relay.run())
        assert await asyncio.to_thread(store.listing.wait, 5), "the sweep never listed"
        stopped_at.append(time.monotonic())
        relay.stop()
        await running

    try:
        # asyncio.run as the CLI does: it joins the default executor's threads at exit.
        _within(5, "the relay's exit", lambda: asyncio.run(run_and_stop_mid_sweep()))
        assert time.monotonic() - stopped_at[0] < 2
    finally:
        store.answer.set()
    # The abandoned sweep deleted some, all or none of the orphans: the next one the rest.
    payload_admin.sweep_claim_checks(settings)
    assert list(store.list_objects()) == []


def _within(seconds: float, what: str, run: Callable[[], object]) -> None:
    """``run()`` in a daemon thread given ``seconds`` to end (its exception re-raised)."""
    failure: list[BaseException] = []

    def work() -> None:
        try:
            run()
        except BaseException as exc:  # re-raised below
            failure.append(exc)

    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"{what} waited for the hung sweep"
    if failure:
        raise failure[0]
