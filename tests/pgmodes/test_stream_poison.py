"""The stream relay against messages it cannot publish, on the real PostgreSQL modes:
an unreadable WAL outbox message, and messages the publisher never sent."""

from __future__ import annotations

import asyncio
import json

import psycopg
import pytest

from outboxer.brokers.base import NotSent
from outboxer.enqueue import Outbox
from outboxer.message import Message
from outboxer.retry import Backoff
from outboxer.stores import pgwal
from outboxer.stores.pglog import PgLog
from outboxer.stores.pgwal import PgWal
from outboxer.streamtesting import (
    PG_BIN,
    StreamHarness,
    numbers,
    running_stream_relay,
    stream_book,
    wait_until,
)
from tests.pgmodes.test_log_mode import LogHarness
from tests.pgmodes.test_wal_mode import WalHarness

VISIBLE = 15.0
FAST = Backoff(0.01, 2.0, 0.05, 0.0)


async def _wal_harness(logical_url: str) -> WalHarness:
    prefix = logical_url.rsplit("/", 1)[1]
    result = WalHarness(logical_url, Outbox(mode="wal", destinations=("default",)), prefix)
    async with result.wal() as wal:
        assert isinstance(wal, PgWal)
        assert await wal.create_slot("default")
    return result


@pytest.fixture
async def wal_harness(logical_url: str) -> WalHarness:
    return await _wal_harness(logical_url)


@pytest.fixture(params=["log", "wal"])
def mode_url(request: pytest.FixtureRequest) -> tuple[str, str]:
    """A mode and a fresh database for it (the WAL outbox needs the private server)."""
    mode = str(request.param)
    return mode, str(request.getfixturevalue("pg_url" if mode == "log" else "logical_url"))


@pytest.fixture
async def harness(mode_url: tuple[str, str]) -> StreamHarness:
    mode, url = mode_url
    if mode == "wal":
        return await _wal_harness(url)
    async with PgLog(url) as log:
        await log.apply_schema()
    return LogHarness(url, Outbox(mode="log"))


def _number(message: Message) -> int:
    return int(json.loads(message.payload)["n"])


def _emit_raw(url: str, content: bytes) -> None:
    """A transactional message with the outbox's prefix that no outboxer writer made."""
    with psycopg.connect(url) as conn:
        conn.execute(
            "SELECT pg_logical_emit_message(true, 'outboxer:outboxer.outbox', %s)", (content,)
        )


def _enqueue(harness: StreamHarness, n: int, key: str | None = "k") -> None:
    with psycopg.connect(harness.url) as conn:
        harness.outbox.enqueue(conn, "orders", {"n": n}, key=key)


async def test_unreadable_wal_message_is_dead_lettered_not_fatal(wal_harness: WalHarness) -> None:
    """A message with the outbox's prefix but no readable envelope used to raise out of the
    read: the relay died, and died again at every restart, while the slot kept the WAL.
    It is a dead letter (its whole content kept), and the stream goes on in order."""
    _enqueue(wal_harness, 1)
    _emit_raw(wal_harness.url, b"not json\npayload")
    _emit_raw(wal_harness.url, b'{"destinations":["default"],"key":"k"}\n{}')  # no id, topic
    _emit_raw(wal_harness.url, b"[1, 2]\n{}")
    _emit_raw(wal_harness.url, b'{"destinations":["other"]}\n{}')  # not this destination's
    _enqueue(wal_harness, 2)
    async with running_stream_relay(wal_harness, "default", max_attempts=3, backoff=FAST) as (
        broker,
        relay,
    ):
        assert await wait_until(lambda: numbers(broker.messages) == [1, 2], VISIBLE)
        assert relay.health_problems() == []
    assert relay.stats.dead_lettered == 3 and relay.stats.failed == 0
    letters, failures = await stream_book(wal_harness, "default")
    assert failures == {}
    assert [letter.message.payload for letter in letters] == [
        b"not json\npayload",
        b'{"destinations":["default"],"key":"k"}\n{}',
        b"[1, 2]\n{}",
    ]
    assert all("no readable envelope" in letter.error for letter in letters)
    assert letters[1].message.key == "k"
    async with wal_harness.wal() as wal:
        assert isinstance(wal, PgWal)
        [slot] = await wal.slots()
        # The slot went past them: it does not keep the WAL from the first one on.
        assert slot["behind"] < 64 * 1024


async def test_message_never_sent_is_not_charged_an_attempt(harness: StreamHarness) -> None:
    """A broker connection that breaks before a message's turn gives it back unsent
    (``Outcome.attempted`` False). The stream relay charged it an attempt all the same, so
    a flapping broker dead-lettered a message it never got and published its key's later
    messages ahead of it. It is retried without an attempt counted, in order."""
    for n in (1, 2, 3):
        _enqueue(harness, n)
    unsent: list[int] = []

    def fail(message: Message) -> BaseException | None:
        if _number(message) == 1 and len(unsent) < 4:
            unsent.append(1)
            return NotSent(ConnectionResetError("connection reset before its turn"))
        return None

    async with running_stream_relay(
        harness, "default", fail=fail, max_attempts=2, backoff=FAST
    ) as (broker, relay):
        assert await wait_until(lambda: numbers(broker.messages)[-1:] == [3], VISIBLE)
    assert len(unsent) == 4
    assert numbers(broker.messages) == [1, 2, 3]
    assert relay.stats.failed == 0 and relay.stats.dead_lettered == 0
    letters, failures = await stream_book(harness, "default")
    assert letters == [] and failures == {}


async def test_slot_held_by_another_session_is_waited_out(
    wal_harness: WalHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session that holds the slot longer than a moment (``pg_recvlogical``, a status
    peek of a long backlog) made the slot call raise the driver's 55006, which stopped the
    relay. It is an outage: the relay backs off, says so on /health, and goes on once
    the slot is free."""
    monkeypatch.setattr(pgwal, "SLOT_BUSY_SECONDS", 0.2)
    _enqueue(wal_harness, 1)
    slot = wal_harness.wal().slot_name("default")
    holder = await asyncio.create_subprocess_exec(
        str(PG_BIN / "pg_recvlogical"),
        "-d",
        wal_harness.url,
        "-S",
        slot,
        "--start",
        "-f",
        "/dev/null",
        "-o",
        "proto_version=1",
        "-o",
        f"publication_names={pgwal.PUBLICATION}",
    )
    try:
        with psycopg.connect(wal_harness.url) as conn:
            assert await wait_until(
                lambda: (
                    conn.execute(
                        "SELECT active FROM pg_replication_slots WHERE slot_name = %s", (slot,)
                    ).fetchone()
                    == (True,)
                ),
                VISIBLE,
            )
        async with running_stream_relay(wal_harness, "default", backoff=FAST) as (broker, relay):
            assert await wait_until(lambda: relay.stats.outages >= 2, VISIBLE)
            assert any("in use" in problem for problem in relay.health_problems())
            holder.terminate()
            await holder.wait()
            assert await wait_until(lambda: numbers(broker.messages) == [1], VISIBLE)
    finally:
        if holder.returncode is None:
            holder.terminate()
            await holder.wait()


async def test_log_row_whose_headers_do_not_read_is_dead_lettered_not_fatal(
    pg_url: str,
) -> None:
    """A log row written by hand with headers that are not a JSON object of strings made
    the read raise: the relay stopped at that row after every restart. It is a dead letter
    at its turn, and the stream goes on in order."""
    async with PgLog(pg_url) as log:
        await log.apply_schema()
    harness = LogHarness(pg_url, Outbox(mode="log"))
    _enqueue(harness, 1)
    _enqueue(harness, 2)
    with psycopg.connect(pg_url) as conn:
        conn.execute(
            "UPDATE outboxer.outbox_log SET headers = '[1, 2]' WHERE payload = %s",
            (b'{"n":2}',),
        )
    _enqueue(harness, 3)
    async with running_stream_relay(harness, "default", max_attempts=3, backoff=FAST) as (
        broker,
        relay,
    ):
        assert await wait_until(lambda: numbers(broker.messages) == [1, 3], VISIBLE)
        assert relay.health_problems() == []
    assert relay.stats.dead_lettered == 1
    letters, _ = await stream_book(harness, "default")
    [letter] = letters
    assert "unreadable row" in letter.error and letter.message.payload == b'{"n":2}'
