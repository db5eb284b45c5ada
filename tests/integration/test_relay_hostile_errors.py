"""Error text the database cannot store, and settles it refuses, never wedge a row: the
relay on the real PostgreSQL, MariaDB and SQLite, publishing to a real local receiver."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any

import psycopg

import outboxer
from outboxer import Relay
from outboxer.brokers.memory import memory_broker
from outboxer.relay import UNRECORDABLE_ERROR
from outboxer.testing import eventually
from tests.receiver import Delivery, Receiver
from tests.relaying import db, enqueue, relay, rows

__all__ = ["db"]  # the fixture, imported: every test taking ``db`` runs on each database


async def run_until(relay: Relay, done: Callable[[], Any], timeout: float = 20) -> None:
    task = asyncio.create_task(relay.run())
    try:
        await eventually(done, timeout=timeout)
    finally:
        relay.stop()
        await asyncio.wait_for(task, 30)


async def test_a_receiver_answering_nul_bytes_and_megabytes_never_wedges_a_row(db: str) -> None:
    """500 with NUL bytes in a 3 MB body: every attempt is recorded (PostgreSQL refused the
    NUL, and the row stayed PROCESSING, its attempts never counted, republished forever)."""

    def hostile(_: Delivery) -> tuple[int, bytes]:
        return 500, b"\x00 upstream \x00 exploded: " + b"x" * 3_000_000

    receiver = Receiver(answer=hostile).start()
    try:
        enqueue(db, ("order.placed", "k"), ("order.placed", None))
        hook = relay(db, receiver.url, max_attempts=2)

        async def all_abandoned() -> bool:
            return {r["status"] for r in await rows(db)} == {"ABANDONED"}

        await run_until(hook, all_abandoned)
    finally:
        receiver.stop()
    for row in await rows(db):
        assert row["attempts"] == 2, row
        error = str(row["last_error"])
        assert "HTTP 500" in error and "\ufffd upstream \ufffd exploded" in error, error
        assert "\x00" not in error
    assert len(receiver.received()) == 4, "two messages, two attempts each, nothing more"
    assert hook.stats.failed == 4 and hook.stats.abandoned_now == 2
    assert hook.stats.settles_refused == 0


async def test_a_settle_the_database_refuses_is_retried_generic_then_row_by_row(
    pg_url: str,
) -> None:
    """A constraint refuses one failure's error text and another row's PUBLISHED: the batch is
    recorded anyway (the error text replaced; the refused row, and the earlier row of its
    key, left in flight to be recovered in order), and the refusal shows in the log, the
    stats and health (the relay used to retry the same settle for ever, leaving the whole
    batch PROCESSING)."""
    with psycopg.connect(pg_url) as conn:
        conn.execute(
            "ALTER TABLE outboxer.outbox ADD CONSTRAINT refuse CHECK ("
            "(status <> 'PUBLISHED' OR topic <> 'stuck') AND last_error NOT LIKE '%forbidden text%')"
        )
    failing, before, stuck, fine = enqueue(
        pg_url, ("t", "a"), ("t", "b"), ("stuck", "b"), ("t", "c")
    )
    broker = memory_broker(f"refused-{uuid.uuid4().hex[:8]}")
    broker.fail = lambda m: (
        outboxer.PublishError("forbidden text from the receiver") if m.id == failing.id else None
    )
    hook = relay(pg_url, f"memory://{broker.name}", backoff_base=60, backoff_max=60)

    async def recorded() -> bool:
        by_id = {r["id"]: r for r in await rows(pg_url)}
        return by_id[failing.id]["status"] == "FAILED" and by_id[fine.id]["status"] == "PUBLISHED"

    task = asyncio.create_task(hook.run())
    try:
        await eventually(recorded)
        problems = hook.health_problems()
    finally:
        hook.stop()
        await asyncio.wait_for(task, 30)
    by_id = {r["id"]: r for r in await rows(pg_url)}
    assert (by_id[failing.id]["attempts"], by_id[failing.id]["last_error"]) == (
        1,
        UNRECORDABLE_ERROR,
    )
    assert by_id[stuck.id]["status"] == "PROCESSING", "refused even alone: left to its lease"
    assert by_id[before.id]["status"] == "PROCESSING", "never PENDING before a row in flight"
    assert hook.stats.settles_refused == 2 and hook.stats.unrecorded == 2
    assert hook.stats.published == 1 and hook.stats.failed == 1
    assert any("refused to record outcomes" in problem for problem in problems), problems


async def test_a_password_quoted_in_an_error_is_not_stored_in_last_error(db: str) -> None:
    """A receiver (or a driver) may quote a URL with its password in its error text: the
    row's last_error is shown by /messages, the dashboard and `outboxer messages`, so it is
    stored masked, as log lines are."""

    def leaky(_: Delivery) -> tuple[int, bytes]:
        return 500, b"cannot reach postgresql://app:leaked-pw-7731@db.internal:5432/orders"

    receiver = Receiver(answer=leaky).start()
    try:
        enqueue(db, ("order.placed", "k"))
        hook = relay(db, receiver.url, max_attempts=1)

        async def abandoned() -> bool:
            return {r["status"] for r in await rows(db)} == {"ABANDONED"}

        await run_until(hook, abandoned)
    finally:
        receiver.stop()
    [row] = await rows(db)
    error = str(row["last_error"])
    assert "postgresql://app:***@db.internal:5432/orders" in error, error
    assert "leaked-pw-7731" not in error
