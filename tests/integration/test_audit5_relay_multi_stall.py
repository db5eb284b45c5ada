"""A relay process serving two databases, one of which stops answering for a while (its
connections stalled by a pg_proxy: no error, no answer): the other publishes on meanwhile,
and the stalled one catches up once it answers again, without a restart."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from outboxer import load_settings
from outboxer.relay_group import RelayGroup
from tests.chaos.proxy import FaultProxy
from tests.integration.test_relay_databases import config, drained, stream_prefix, write

__all__ = ["stream_prefix"]


async def until(check: Callable[[], Awaitable[bool]], what: str, seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while not await check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


async def test_a_stalled_database_holds_up_only_its_own_relay_and_catches_up(
    pg_url: str, sqlite_url: str, stream_prefix: str, tmp_path: Path, pg_proxy: FaultProxy
) -> None:
    stalled_url = pg_url.replace(":5432/", f":{pg_proxy.port}/")
    databases = {"steady": sqlite_url, "stalled": stalled_url}
    settings = load_settings(
        {}, config_file=config(tmp_path, databases, stream_prefix, concurrency=2), environ={}
    )
    group = RelayGroup.from_settings(settings)
    running = asyncio.create_task(group.run())
    try:
        write(pg_url, "stalled", 1, 2)
        await until(lambda: drained(pg_url), "the database behind the pg_proxy did not drain")
        pg_proxy.stall()
        await asyncio.sleep(0.2)  # its loops' next claims (polls every 50 ms) hang
        write(pg_url, "stalled", 2, 3)  # written directly: only the relay's sessions stall
        write(sqlite_url, "steady", 2, 3)
        await until(lambda: drained(sqlite_url), "the steady database did not drain")
        assert not await drained(pg_url)
        pg_proxy.resume()
        await until(lambda: drained(pg_url), "the stalled database did not catch up")
        assert not running.done()
    finally:
        group.stop()
        await asyncio.wait_for(running, 10)
