"""A relay process serving two databases: one stops answering while its relay's claim is
under way (a proxy holds its connections: no error, no answer); the other finds a row a
crashed relay left in flight and recovers it alone.

The recovered row waited in ``RecoveryGate.alone`` for the stalled claim to come back, and
while it waited nobody in the process claimed: the database that answers published
nothing for as long as the other hung (asyncpg's command timeout, a minute, each claim)."""

from __future__ import annotations

import asyncio
import sqlite3
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest

import outboxer
from outboxer import load_settings
from outboxer.relay_group import RelayGroup
from tests.chaos.proxy import FaultProxy
from tests.relaying import enqueue, rows


@pytest.fixture
def proxy() -> Iterator[FaultProxy]:
    proxy = FaultProxy(5432).start()
    yield proxy
    proxy.resume()
    proxy.stop()


async def until(check: Callable[[], Awaitable[bool] | bool], what: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while True:
        found = check()
        if not isinstance(found, bool):
            found = await found
        if found:
            return
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


async def drained(url: str) -> bool:
    return {row["status"] for row in await rows(url)} == {"PUBLISHED"}


async def test_a_row_recovered_in_one_database_waits_for_no_claim_stalled_in_another(
    pg_url: str, sqlite_url: str, tmp_path: Path, proxy: FaultProxy
) -> None:
    # A relay that died holding one row of the steady database (a long lease, expired below).
    enqueue(sqlite_url, ("t", "k0"))
    async with outboxer.create_store(sqlite_url) as store:
        assert len(await store.claim("default", "relay-that-died", 1, 600, False)) == 1
    stalled_url = pg_url.replace(":5432/", f":{proxy.port}/")
    config = tmp_path / "outboxer.toml"
    config.write_text(
        f'broker = "memory://stalled-claim-{uuid.uuid4().hex[:8]}"\n'
        "poll_interval = 0.05\nbackoff_base = 0.05\nbackoff_max = 0.1\n"
        f'[databases.steady]\nurl = "{sqlite_url}"\n'
        f'[databases.stalled]\nurl = "{stalled_url}"\n'
    )
    group = RelayGroup.from_settings(load_settings({}, config_file=config, environ={}))
    stalled = group.relays["stalled"]
    running = asyncio.create_task(group.run())
    try:
        await until(lambda: stalled._loops_running, "the stalled relay did not start", 10)
        proxy.stall()
        # Its relay's next claim (a poll every 50 ms) hangs, held by the gate.
        await until(lambda: stalled._gate.active("stalled") > 0, "no claim under way", 10)
        path = sqlite_url.removeprefix("sqlite:///")
        with sqlite3.connect(path) as conn:
            conn.execute("UPDATE outbox SET locked_until = 0 WHERE status = 'PROCESSING'")
        enqueue(sqlite_url, *(("t", f"k{n}") for n in range(1, 4)))
        enqueue(pg_url, *(("t", f"k{n}") for n in range(3)))  # directly, not through the proxy
        await until(
            lambda: drained(sqlite_url),
            "the steady database stopped publishing while the other database hung",
            5,
        )
        recovered = group.relays["steady"].stats.recovered
        assert recovered == 1
        assert not running.done()
        proxy.resume()
        await until(lambda: drained(pg_url), "the stalled database did not catch up", 10)
    finally:
        proxy.resume()
        group.stop()
        await asyncio.wait_for(running, 15)
