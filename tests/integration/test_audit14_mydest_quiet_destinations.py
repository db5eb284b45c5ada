"""MySQL/MariaDB and SQLite relays of many destinations, traffic on one: the quiet
destinations do not claim at every change of the wake-up mark, the waiting loops share one
probe per interval, and a row for a quiet destination is still published at once."""

from __future__ import annotations

import asyncio
import sqlite3
import time
import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pymysql
import pytest

import outboxer
from outboxer.brokers.memory import memory_broker
from outboxer.stores.mysql import WAKE_PROBE_INTERVAL, MySQLStore, mysql_connect_args
from outboxer.stores.sqlite import SqliteStore, sqlite_path
from outboxer.testing import eventually
from tests.integration.test_quiet_destinations import _relay

DESTINATIONS = 20
BUSY = "d0"
LATE = "d7"
COMMITS = 200
RATE = 100.0


def _connect(url: str) -> AbstractContextManager[Any]:
    if url.startswith("sqlite"):
        return sqlite3.connect(sqlite_path(url))
    args = mysql_connect_args(url)
    if "connect_timeout" in args:
        args["connect_timeout"] = int(args["connect_timeout"])
    return pymysql.connect(**args)


async def _write(url: str, destination: str, commits: int, rate: float) -> None:
    """``commits`` transactions of one message for ``destination``, at ``rate`` a second."""
    outbox = outboxer.Outbox(destinations=(destination,))
    conn = _connect(url)
    with conn:
        started = time.monotonic()
        for n in range(commits):
            outbox.enqueue(conn, "t", {"n": n}, key=f"k{n % 5}")
            conn.commit()
            await asyncio.sleep(max(0.0, started + (n + 1) / rate - time.monotonic()))


def _count_probes(store: Any) -> Callable[[], int]:
    """Counts the wake-up probe statements the relay sends from now on."""
    probes = 0
    if isinstance(store, SqliteStore):
        assert store._conn is not None

        def traced(statement: str) -> None:
            nonlocal probes
            if "data_version" in statement or "json_each" in statement:
                probes += 1

        # The relay's one connection (every statement runs on it, under its lock).
        store._conn.set_trace_callback(traced)
    else:
        execute = store._execute

        async def counted(cursor: Any, name: str, *args: Any, **kwargs: Any) -> Any:
            nonlocal probes
            if name == "pending_mark":
                probes += 1
            return await execute(cursor, name, *args, **kwargs)

        store._execute = counted
    return lambda: probes


@pytest.fixture(params=["mysql", "sqlite"])
def db_url(request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue(f"{request.param}_url"))


async def test_quiet_destinations_neither_claim_for_nothing_nor_miss_their_rows(
    db_url: str, tmp_path: Path
) -> None:
    tag = uuid.uuid4().hex[:8]
    brokers = {f"d{i}": memory_broker(f"mydest-{tag}-{i}") for i in range(DESTINATIONS)}
    relay = _relay(db_url, tmp_path, brokers)
    task = asyncio.create_task(relay.run())
    try:
        store = relay.store
        assert isinstance(store, MySQLStore | SqliteStore)
        # Every loop of every destination claimed once and waits.
        await eventually(
            lambda: _true(
                len(relay._waiting) == DESTINATIONS * relay.settings.concurrency
                and all(n >= 1 for n in relay._claims_sent.values())
            ),
            timeout=10,
        )
        probes = _count_probes(store)
        before = dict(relay._claims_sent)
        started = time.monotonic()
        writer = asyncio.create_task(_write(db_url, BUSY, COMMITS, RATE))
        await asyncio.sleep(1.0)  # the busy destination's traffic under way
        # A row for a quiet destination, while the other's traffic wakes the relay.
        sent = time.monotonic()
        await _write(db_url, LATE, 1, 1000.0)
        await eventually(lambda: _true(len(brokers[LATE].messages) == 1), 5, 0.001)
        reached = time.monotonic() - sent
        await writer
        await eventually(lambda: _true(len(brokers[BUSY].messages) == COMMITS), timeout=10)
        elapsed = time.monotonic() - started
        probed = probes()
        claims = {name: n - before[name] for name, n in relay._claims_sent.items()}
    finally:
        relay.stop()
        await asyncio.wait_for(task, 10)
    quiet = {name: n for name, n in claims.items() if name not in (BUSY, LATE)}
    rate = probed / elapsed
    print(f"\n{db_url.split(':')[0]}: {elapsed:.2f} s, quiet claims {quiet}, d7 {claims[LATE]}, ")
    print(f"busy {claims[BUSY]}, probes {probed} ({rate:.0f}/s), d7 reached in {reached:.3f} s")
    # Before: every change of the mark woke a loop of every destination, which claimed and
    # found nothing (MariaDB: ~90 claims each in 2 s; SQLite: ~200).
    assert set(quiet.values()) == {0}, f"claims of quiet destinations: {quiet}"
    assert 1 <= claims[LATE] <= 30, f"{claims[LATE]} claims of {LATE}"
    # Missed, it waited for the fallback poll (30 s).
    assert reached < 0.5, f"a quiet destination's row took {reached:.3f} s"
    # One probe per interval for all the waiting loops (and, on SQLite, a due question when
    # the version changed): not one per loop.
    interval = WAKE_PROBE_INTERVAL if isinstance(store, MySQLStore) else 0.02
    assert rate <= 2.5 / interval, f"{rate:.0f} probes/s"
    assert all(not broker.messages for name, broker in brokers.items() if name not in (BUSY, LATE))


async def _true(value: bool) -> bool:
    return value
