"""A relay process serving two databases: one stops answering (a proxy holds its
connections: no error, no answer) while its relay claims, or while it settles a batch it
published; the other finds a row a crashed relay left in flight and recovers it alone.

The recovered row waited in ``RecoveryGate.alone`` for the hung claim or settle to come
back (asyncpg's command timeout, a minute, or never behind a stalled network), and while
it waited nobody in the process claimed: the database that answers published nothing for
as long as the other hung."""

from __future__ import annotations

import asyncio
import sqlite3
import uuid
from pathlib import Path
from typing import Any

import outboxer
from outboxer import load_settings
from outboxer.relay_group import RelayGroup
from tests.chaos.proxy import FaultProxy
from tests.relaying import drained, enqueue, until


async def group_beside_a_dead_relay(
    sqlite_url: str, hung_url: str, tmp_path: Path, name: str
) -> RelayGroup:
    """Relays of two databases in one process, ``steady`` (SQLite) and ``name`` (behind the
    proxy); a relay that died holds one row of ``steady`` (its lease expired by the test)."""
    enqueue(sqlite_url, ("t", "k0"))
    async with outboxer.create_store(sqlite_url) as store:
        assert len(await store.claim("default", "relay-that-died", 1, 600, False)) == 1
    config = tmp_path / "outboxer.toml"
    config.write_text(
        f'broker = "memory://{name}-{uuid.uuid4().hex[:8]}"\n'
        "poll_interval = 0.05\nbackoff_base = 0.05\nbackoff_max = 0.1\n"
        f'[databases.steady]\nurl = "{sqlite_url}"\n'
        f'[databases.{name}]\nurl = "{hung_url}"\n'
    )
    return RelayGroup.from_settings(load_settings({}, config_file=config, environ={}))


def expire_the_dead_relay_s_lease(sqlite_url: str) -> None:
    path = sqlite_url.removeprefix("sqlite:///")
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE outbox SET locked_until = 0 WHERE status = 'PROCESSING'")


async def test_a_row_recovered_in_one_database_waits_for_no_claim_stalled_in_another(
    pg_url: str, sqlite_url: str, tmp_path: Path, pg_proxy: FaultProxy
) -> None:
    stalled_url = pg_url.replace(":5432/", f":{pg_proxy.port}/")
    group = await group_beside_a_dead_relay(sqlite_url, stalled_url, tmp_path, "stalled")
    stalled = group.relays["stalled"]
    running = asyncio.create_task(group.run())
    try:
        await until(lambda: stalled._loops_running, "the stalled relay did not start", 10)
        pg_proxy.stall()
        # Its relay's next claim (a poll every 50 ms) hangs, held by the gate.
        await until(lambda: stalled._gate.active("stalled") > 0, "no claim under way", 10)
        expire_the_dead_relay_s_lease(sqlite_url)
        enqueue(sqlite_url, *(("t", f"k{n}") for n in range(1, 4)))
        enqueue(pg_url, *(("t", f"k{n}") for n in range(3)))  # directly, not through the proxy
        await until(
            lambda: drained(sqlite_url),
            "the steady database stopped publishing while the other database hung",
            5,
        )
        assert group.relays["steady"].stats.recovered == 1
        assert not running.done()
        pg_proxy.resume()
        await until(lambda: drained(pg_url), "the stalled database did not catch up", 10)
    finally:
        pg_proxy.resume()
        group.stop()
        await asyncio.wait_for(running, 15)


async def test_a_row_recovered_in_one_database_waits_for_no_settle_hung_in_another(
    pg_url: str, sqlite_url: str, tmp_path: Path, pg_proxy: FaultProxy
) -> None:
    hung_url = pg_url.replace(":5432/", f":{pg_proxy.port}/")
    group = await group_beside_a_dead_relay(sqlite_url, hung_url, tmp_path, "hung")
    hung = group.relays["hung"]
    settling = asyncio.Event()
    settle = hung.store.settle

    async def settle_then_hang(*args: Any, **kwargs: Any) -> Any:
        # The database stops answering right after the claim: this settle is sent, and hangs.
        if not settling.is_set():
            pg_proxy.stall()
            settling.set()
        return await settle(*args, **kwargs)

    hung.store.settle = settle_then_hang  # type: ignore[method-assign]
    running = asyncio.create_task(group.run())
    try:
        await until(lambda: hung._loops_running, "the hung relay did not start", 10)
        enqueue(pg_url, ("t", "h0"))  # directly, not through the proxy
        await asyncio.wait_for(settling.wait(), 10)
        expire_the_dead_relay_s_lease(sqlite_url)
        enqueue(sqlite_url, *(("t", f"k{n}") for n in range(1, 4)))
        await until(
            lambda: drained(sqlite_url),
            "the steady database stopped publishing while the other's settle hung",
            8,
        )
        assert group.relays["steady"].stats.recovered == 1
        assert not running.done()
        pg_proxy.resume()
        await until(lambda: drained(pg_url), "the hung database did not catch up", 10)
        # The parked settle answered: counted off once (claims under way may still be held).
        gate = hung._gate
        await until(lambda: not any(gate._parked.values()), "a batch is still parked", 5)
        assert gate.active() == gate.held >= 0
    finally:
        pg_proxy.resume()
        group.stop()
        await asyncio.wait_for(running, 15)
