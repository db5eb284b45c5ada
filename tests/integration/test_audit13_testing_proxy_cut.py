"""``TcpProxy.cut()`` returns while a client still holds a connection through the proxy.

Since Python 3.12.1, ``asyncio.Server.wait_closed()`` waits until every accepted
connection is closed; ``cut()`` used to await it before dropping the connections, so on
3.12+ it never returned while a client (a relay, a driver) held one. On 3.11 the test puts
3.12.1's ``wait_closed`` in place, to check the same thing on every supported version.
"""

from __future__ import annotations

import asyncio
import sys
from asyncio import base_events

import psycopg
import pytest

from outboxer.testing import TcpProxy


async def _wait_closed_as_in_python_3_12_1(self: base_events.Server) -> None:
    # Python 3.12.1's Server.wait_closed: _wakeup() sets _waiters to None once the server
    # is closed and its last connection dropped.
    if self._waiters is None:  # type: ignore[attr-defined]
        return
    waiter = self._loop.create_future()  # type: ignore[attr-defined]
    self._waiters.append(waiter)  # type: ignore[attr-defined]
    await waiter


async def test_cut_drops_a_held_connection_and_returns(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if sys.version_info < (3, 12, 1):
        monkeypatch.setattr(base_events.Server, "wait_closed", _wait_closed_as_in_python_3_12_1)
    proxy = await TcpProxy("127.0.0.1", 5432).start()
    database = pg_url.rsplit("/", 1)[1]
    via_proxy = f"postgresql://postgres@127.0.0.1:{proxy.port}/{database}"
    try:
        conn = await psycopg.AsyncConnection.connect(via_proxy, autocommit=True)
        try:
            await conn.execute("SELECT 1")
            await asyncio.wait_for(proxy.cut(), 3)
            with pytest.raises(psycopg.OperationalError):
                await conn.execute("SELECT 1")
        finally:
            await conn.close()
        await proxy.restore()
        async with await psycopg.AsyncConnection.connect(via_proxy, autocommit=True) as again:
            cursor = await again.execute("SELECT 1")
            assert await cursor.fetchone() == (1,)
    finally:
        await asyncio.wait_for(proxy.stop(), 3)
