"""A relay process serving two databases: one stops answering while its relay settles a
batch it published (a proxy holds its connections: no error, no answer); the other finds
a row a crashed relay left in flight and recovers it alone.

The recovered row waited in ``RecoveryGate.alone`` for the hung settle: its batch counted
as held until the settle's first failure, asyncpg's command timeout (a minute) later, or
never behind a stalled network. Meanwhile nobody in the process claimed: the database that
answers published nothing for as long as the other hung."""

from __future__ import annotations

import asyncio
import sqlite3
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

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


async def test_a_row_recovered_in_one_database_waits_for_no_settle_hung_in_another(
    pg_url: str, sqlite_url: str, tmp_path: Path, proxy: FaultProxy
) -> None:
    # A relay that died holding one row of the steady database (a long lease, expired below).
    enqueue(sqlite_url, ("t", "k0"))
    async with outboxer.create_store(sqlite_url) as store:
        assert len(await store.claim("default", "relay-that-died", 1, 600, False)) == 1
    hung_url = pg_url.replace(":5432/", f":{proxy.port}/")
    config = tmp_path / "outboxer.toml"
    config.write_text(
        f'broker = "memory://hung-settle-{uuid.uuid4().hex[:8]}"\n'
        "poll_interval = 0.05\nbackoff_base = 0.05\nbackoff_max = 0.1\n"
        f'[databases.steady]\nurl = "{sqlite_url}"\n'
        f'[databases.hung]\nurl = "{hung_url}"\n'
    )
    group = RelayGroup.from_settings(load_settings({}, config_file=config, environ={}))
    hung = group.relays["hung"]
    settling = asyncio.Event()
    settle = hung.store.settle

    async def settle_then_hang(*args: Any, **kwargs: Any) -> Any:
        # The database stops answering right after the claim: this settle is sent, and hangs.
        if not settling.is_set():
            proxy.stall()
            settling.set()
        return await settle(*args, **kwargs)

    hung.store.settle = settle_then_hang  # type: ignore[method-assign]
    running = asyncio.create_task(group.run())
    try:
        await until(lambda: hung._loops_running, "the hung relay did not start", 10)
        enqueue(pg_url, ("t", "h0"))  # directly, not through the proxy
        await asyncio.wait_for(settling.wait(), 10)
        path = sqlite_url.removeprefix("sqlite:///")
        with sqlite3.connect(path) as conn:
            conn.execute("UPDATE outbox SET locked_until = 0 WHERE status = 'PROCESSING'")
        enqueue(sqlite_url, *(("t", f"k{n}") for n in range(1, 4)))
        await until(
            lambda: drained(sqlite_url),
            "the steady database stopped publishing while the other's settle hung",
            8,
        )
        assert group.relays["steady"].stats.recovered == 1
        assert not running.done()
        proxy.resume()
        await until(lambda: drained(pg_url), "the hung database did not catch up", 10)
        # The parked settle answered: counted off once (claims under way may still be held).
        gate = hung._gate
        await until(lambda: not any(gate._parked.values()), "a batch is still parked", 5)
        assert gate.active() == gate.held >= 0
    finally:
        proxy.resume()
        group.stop()
        await asyncio.wait_for(running, 15)
