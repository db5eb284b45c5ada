"""A relay of many destinations with traffic on one: the quiet ones do not claim at every
NOTIFY nor at every tick of the chase (one shared read-only question per wake instead), and
a row for a quiet destination is still published at once, listening or chasing."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest

import outboxer
from outboxer import Relay, load_settings
from outboxer.brokers.memory import MemoryBroker, memory_broker
from outboxer.stores.postgres import PostgresStore
from outboxer.testing import eventually

DESTINATIONS = 20
BUSY = "d0"


def _relay(pg_url: str, tmp_path: Path, brokers: dict[str, MemoryBroker], **extra: object) -> Relay:
    lines = [
        f'db = "{pg_url}"',
        # Only wake-ups bring claims: no fallback poll in the test's time.
        "poll_interval = 30",
        *(f"{name} = {value}" for name, value in extra.items()),
    ]
    for name, broker in brokers.items():
        lines += [f"[destinations.{name}]", f'broker = "memory://{broker.name}"']
    config = tmp_path / "outboxer.toml"
    config.write_text("\n".join(lines) + "\n")
    return Relay.from_settings(load_settings({}, config_file=config, environ={}))


async def _write(pg_url: str, destination: str, commits: int, rate: float) -> None:
    """``commits`` transactions of one message for ``destination``, at ``rate`` a second."""
    outbox = outboxer.Outbox(destinations=(destination,))
    with psycopg.connect(pg_url) as conn:
        started = time.monotonic()
        for n in range(commits):
            outbox.enqueue(conn, "t", {"n": n}, key=f"k{n % 5}")
            conn.commit()
            await asyncio.sleep(max(0.0, started + (n + 1) / rate - time.monotonic()))


def _count_questions(store: PostgresStore) -> tuple[list[str], list[list[str]]]:
    """The destinations that asked whether they have a row due, and the questions sent."""
    asks: list[str] = []
    questions: list[list[str]] = []
    due, args = store._due, store._args

    async def asked(destination: str) -> bool:
        asks.append(destination)
        return await due(destination)

    def sent(name: str, params: dict[str, Any]) -> tuple[str, list[Any]]:
        if name == "due_destinations":
            questions.append(list(params["destinations"]))
        return args(name, params)

    store._due = asked  # type: ignore[method-assign]
    store._args = sent  # type: ignore[method-assign]
    return asks, questions


def _claims(relay: Relay) -> dict[str, int]:
    return dict(relay._claims_sent)


@pytest.mark.parametrize(
    ("mode", "options"),
    [
        # At 100 commits/s the relay listens, and each commit's NOTIFY wakes every destination.
        ("notify", {}),
        # 0: after any work the relay chases: one loop of each destination polls every 3 ms.
        ("chase", {"wake_on_commit_below": 0}),
    ],
)
async def test_quiet_destinations_neither_claim_for_nothing_nor_miss_their_rows(
    pg_url: str, tmp_path: Path, mode: str, options: dict[str, object]
) -> None:
    tag = uuid.uuid4().hex[:8]
    brokers = {f"d{i}": memory_broker(f"quiet-{tag}-{i}") for i in range(DESTINATIONS)}
    relay = _relay(pg_url, tmp_path, brokers, **options)
    task = asyncio.create_task(relay.run())
    try:
        store = relay.store
        assert isinstance(store, PostgresStore)
        # Every loop of every destination claimed once and waits.
        await eventually(
            lambda: _true(
                sum(len(w) for w in store._wakeups._waiters.values())
                == DESTINATIONS * relay.settings.concurrency
            ),
            timeout=10,
        )
        asks, questions = _count_questions(store)
        before = _claims(relay)
        writer = asyncio.create_task(_write(pg_url, BUSY, 200, 100.0))
        await asyncio.sleep(1.0)  # the busy destination's traffic under way
        # A row for a quiet destination, while the other's traffic wakes the relay.
        sent = time.monotonic()
        await _write(pg_url, "d7", 1, 1000.0)
        await eventually(lambda: _true(len(brokers["d7"].messages) == 1), 5, 0.001)
        reached = time.monotonic() - sent
        await writer
        await eventually(lambda: _true(len(brokers[BUSY].messages) == 200), timeout=10)
        claims = {name: n - before[name] for name, n in _claims(relay).items()}
    finally:
        relay.stop()
        await asyncio.wait_for(task, 10)
    # Before: each NOTIFY woke a loop of every quiet destination (about 200 claims each, that
    # found nothing), and the chase claimed for each every 3 ms (about 330 a second each).
    # Now: none, but d7's for its row, and the ones it makes while it is not quiet (0.1 s).
    quiet = {name: n for name, n in claims.items() if name not in (BUSY, "d7")}
    assert set(quiet.values()) == {0}, f"{mode}: claims of quiet destinations: {quiet}"
    assert 1 <= claims["d7"] <= 30, f"{mode}: {claims['d7']} claims of d7"
    # Missed, it waited for the fallback poll (30 s).
    assert reached < 0.5, f"{mode}: a quiet destination's row took {reached:.3f} s"
    # One question for the quiet destinations woken together (a NOTIFY, a tick of the chase).
    assert asks and len(questions) * 4 <= len(asks), f"{len(questions)} for {len(asks)} asks"
    assert all(not broker.messages for name, broker in brokers.items() if name not in (BUSY, "d7"))


async def test_a_lone_destination_never_asks_before_claiming(pg_url: str, tmp_path: Path) -> None:
    """The question costs a round trip: a relay of one destination goes on claiming at once."""
    broker = memory_broker(f"lone-{uuid.uuid4().hex[:8]}")
    relay = _relay(pg_url, tmp_path, {"default": broker})
    task = asyncio.create_task(relay.run())
    asked: list[str] = []
    try:
        store = relay.store
        assert isinstance(store, PostgresStore)
        due = store._due

        async def counted(destination: str) -> bool:
            asked.append(destination)
            return await due(destination)

        store._due = counted  # type: ignore[method-assign]
        await _write(pg_url, "default", 20, 200.0)
        await eventually(lambda: _true(len(broker.messages) == 20), timeout=10)
    finally:
        relay.stop()
        await asyncio.wait_for(task, 10)
    assert asked == []


async def _true(value: bool) -> bool:
    return value
