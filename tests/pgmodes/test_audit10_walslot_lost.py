"""A WAL outbox slot the server invalidated (max_slot_wal_keep_size, wal_status 'lost').

Its unread messages are gone: the stream relay must say so at once and loudly (an ERROR
naming the slot and what to do, /health not ok) and stop with a non-zero exit, rather
than crash with the driver's bare "can no longer get changes from replication slot".

These tests run their own private server (max_slot_wal_keep_size would invalidate the
slots of other tests on the session's one).
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import uuid

import psycopg
import pytest

from outboxer.brokers.memory import MemoryPublisher, memory_broker
from outboxer.config import load_stream_settings
from outboxer.enqueue import Outbox
from outboxer.stores.pgwal import PgWal
from outboxer.stream_cli import stream_status
from outboxer.streamrelay import StreamRelay
from outboxer.streamtesting import wait_until


@pytest.fixture
def wal(small_slot_wal: PgWal) -> PgWal:
    return small_slot_wal


async def _create_slot(wal: PgWal) -> str:
    async with PgWal(wal.url, slot_prefix=wal.slot_prefix) as admin:
        assert isinstance(admin, PgWal)
        assert await admin.create_slot("default")
    return wal.slot_name("default")


def _enqueue(url: str, count: int) -> None:
    outbox = Outbox(mode="wal")
    with psycopg.connect(url) as conn:
        for n in range(count):
            outbox.enqueue(conn, "orders", {"n": n})
        conn.commit()


def _invalidate(url: str, slot: str) -> None:
    """Write WAL past max_slot_wal_keep_size and checkpoint: the server removes the WAL the
    slot needed and marks it 'lost'."""
    with psycopg.connect(url, autocommit=True) as conn:
        for _ in range(3):
            conn.execute("SELECT pg_logical_emit_message(true, 'filler', repeat('x', 4096))")
            conn.execute("SELECT pg_switch_wal()")
        conn.execute("CHECKPOINT")
        status = conn.execute(
            "SELECT wal_status FROM pg_replication_slots WHERE slot_name = %s", (slot,)
        ).fetchone()
    assert status == ("lost",), f"the slot was not invalidated: {status}"


def _says_what_happened_and_what_to_do(text: str, slot: str) -> None:
    assert slot in text
    assert "invalidated" in text and "lost" in text
    assert "max_slot_wal_keep_size" in text
    assert "--create-slot" in text and "pg_drop_replication_slot" in text


async def test_running_relay_stops_loudly_when_its_slot_is_invalidated(
    wal: PgWal, caplog: pytest.LogCaptureFixture
) -> None:
    slot = await _create_slot(wal)
    _enqueue(wal.url, 3)
    broker = memory_broker(f"walslot-{uuid.uuid4().hex[:8]}")
    source = wal.reader("default")
    await source.connect()
    relay = StreamRelay(
        source,
        MemoryPublisher(f"memory://{broker.name}"),
        poll_interval=0.01,
        outage_backoff_max=0.05,
    )
    stop = asyncio.Event()
    task = asyncio.create_task(relay.run(stop))
    try:
        assert await wait_until(lambda: len(broker.messages) >= 3, 10)
        with caplog.at_level(logging.ERROR, logger="outboxer"):
            await asyncio.to_thread(_invalidate, wal.url, slot)
            # Stops by itself: not an outage retried for ever.
            done, _ = await asyncio.wait({task}, timeout=10)
            assert task in done, "the relay kept running on an invalidated slot"
    finally:
        stop.set()
        await asyncio.wait({task}, timeout=10)
        await source.close()
    error = task.exception()
    assert error is not None
    assert type(error).__name__ == "SlotInvalidatedError"
    _says_what_happened_and_what_to_do(str(error), slot)
    problems = relay.health_problems()
    assert any(problem.startswith("slot:") and slot in problem for problem in problems), problems
    logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any(slot in line and "max_slot_wal_keep_size" in line for line in logged), logged


def test_stream_relay_on_an_invalidated_slot_exits_1_naming_it(wal: PgWal) -> None:
    slot = asyncio.run(_create_slot(wal))
    _enqueue(wal.url, 2)
    _invalidate(wal.url, slot)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "outboxer.streamrelay",
            "--mode",
            "wal",
            "--database",
            wal.url,
            "--slot-prefix",
            wal.slot_prefix,
            "--broker",
            "memory://walslot",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    _says_what_happened_and_what_to_do(result.stderr, slot)


async def test_slots_and_status_show_wal_status_and_safe_wal_size(wal: PgWal) -> None:
    slot = await _create_slot(wal)
    async with PgWal(wal.url, slot_prefix=wal.slot_prefix) as admin:
        assert isinstance(admin, PgWal)
        [before] = await admin.slots()
    assert before["wal_status"] in ("reserved", "extended")
    # Bytes of WAL that may still be written before the server invalidates the slot.
    assert isinstance(before["safe_wal_size"], int) and before["safe_wal_size"] > 0

    _invalidate(wal.url, slot)
    async with PgWal(wal.url, slot_prefix=wal.slot_prefix) as admin:
        assert isinstance(admin, PgWal)
        [after] = await admin.slots()
    assert after["wal_status"] == "lost"
    # The status still lists the slot (it cannot be peeked any more) and says it is lost.
    settings, own = load_stream_settings(
        {"db": wal.url}, {"mode": "wal", "slot_prefix": wal.slot_prefix}, environ={}
    )
    report = await stream_status(settings, own)
    [stream] = report["streams"]
    assert (stream["slot"], stream["wal_status"]) == (slot, "lost")
