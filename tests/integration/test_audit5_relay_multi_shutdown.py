"""SIGTERM in a relay process serving several databases, one of which stopped answering
(its connections stalled: no error, no answer): the process still ends within its
``shutdown_timeout``, as documented, and the other database's rows are settled."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from outboxer import load_settings
from outboxer.relay_group import RelayGroup
from outboxer.stores.postgres import CLOSE_TIMEOUT
from tests.chaos.proxy import FaultProxy
from tests.integration.test_relay_databases import config, drained, stream_prefix, write

__all__ = ["stream_prefix"]


async def test_sigterm_with_one_database_stalled_ends_within_the_shutdown_timeout(
    pg_url: str, sqlite_url: str, stream_prefix: str, tmp_path: Path, pg_proxy: FaultProxy
) -> None:
    stalled_url = pg_url.replace(":5432/", f":{pg_proxy.port}/")
    assert stalled_url != pg_url
    databases = {"steady": sqlite_url, "stalled": stalled_url}
    settings = load_settings(
        {},
        config_file=config(tmp_path, databases, stream_prefix, shutdown_timeout=0.5),
        environ={},
    )
    group = RelayGroup.from_settings(settings)
    running = asyncio.create_task(group.run())
    try:
        write(pg_url, "stalled", 1, 3)
        write(sqlite_url, "steady", 1, 3)
        deadline = time.monotonic() + 10
        while not (await drained(pg_url) and await drained(sqlite_url)):
            assert time.monotonic() < deadline, "the databases did not drain"
            await asyncio.sleep(0.05)
        pg_proxy.stall()  # the relay's statements to "stalled" get no answer from now on
        await asyncio.sleep(0.2)  # its loops' next claims (polls every 50 ms) hang
    finally:
        group.stop()  # SIGTERM
        started = time.monotonic()
        done, _ = await asyncio.wait({running}, timeout=5)
        took = time.monotonic() - started
        pg_proxy.resume()
        if not done:
            await asyncio.wait_for(running, 120)
    assert done, f"the relay process took {took:.1f}s to stop (shutdown_timeout 0.5s)"
    # The loops cut short at shutdown_timeout (0.5 s), then one after another: the claims
    # under way get 0.25 s to answer, the connections they held 0.5 s to reset, the pool
    # CLOSE_TIMEOUT to close (2.26 s in all on an idle box; 2.7 s on a loaded one failed a
    # bound of 2.5 s). A second of slack over those.
    assert took < 0.5 + 0.25 + 0.5 + CLOSE_TIMEOUT + 1, took
    running.result()


async def test_sigterm_while_a_database_stalls_its_relays_connect_ends_at_once(
    pg_url: str, sqlite_url: str, stream_prefix: str, tmp_path: Path, pg_proxy: FaultProxy
) -> None:
    """A database that does not answer from the start: its relay is still connecting (the
    driver waits a minute) when SIGTERM comes. It has nothing in flight: it ends at once,
    and the process with it (it outlived shutdown_timeout and a second SIGTERM)."""
    stalled_url = pg_url.replace(":5432/", f":{pg_proxy.port}/")
    databases = {"steady": sqlite_url, "stalled": stalled_url}
    settings = load_settings(
        {},
        config_file=config(tmp_path, databases, stream_prefix, shutdown_timeout=0.5),
        environ={},
    )
    pg_proxy.stall()
    group = RelayGroup.from_settings(settings)
    running = asyncio.create_task(group.run())
    try:
        write(sqlite_url, "steady", 1, 2)
        deadline = time.monotonic() + 10
        while not await drained(sqlite_url):
            assert time.monotonic() < deadline, "the steady database did not drain"
            await asyncio.sleep(0.05)
        assert group.health_problems()["stalled"] == [
            "relay is starting: not connected to the database yet"
        ]
    finally:
        group.stop()  # SIGTERM
        started = time.monotonic()
        done, _ = await asyncio.wait({running}, timeout=3)
        took = time.monotonic() - started
        pg_proxy.resume()
        if not done:
            await asyncio.wait_for(running, 120)
    assert done, f"the relay process took {took:.1f}s to stop (shutdown_timeout 0.5s)"
    assert took < 1, took
    assert running.result()["steady"].published == 2
