"""The consumer against a PostgreSQL database that stays read-only (a URL naming a replica,
a fence whose promotion has not come yet, ``default_transaction_read_only`` for the role or
the database): 08bbb8f takes the refused inbox claim for a lost connection, and its new
connection reached the same read-only server. Each lane (a key's messages) then met the
refusal again, reconnected, and was retried after its own outage backoff: a connect and a
warning per key in flight every few tenths of a second, about 170 connects and 300 warning
lines a second with 200 keys (psycopg; 70 with asyncpg), where a database that cannot be
reached is retried by each worker after its backoff.

Now a connection made after a read-only answer must reach a server that takes writes, or
the reopen fails (ReadOnlyDatabase) and is backed off as an unreachable database's; once the
server takes writes again, every message is applied, no attempt counted.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import asyncpg
import psycopg
import pytest

from outboxer.brokers.memory import memory_broker
from outboxer.consumer import Consumer, Delivery
from outboxer.receivers.memory import group_state
from outboxer.testing import make_message
from tests.integration.test_audit20_myreadonly_failover import Pair, pair, sql

__all__ = ["pair"]  # the fixture: two private MariaDB servers behind a proxy

KEYS = 200
#: Seconds the consumer runs against the read-only database.
WINDOW = 4.0
#: Connects allowed in that window: each of the four workers' first, the reopen at once
#: after the refusal, then its reopens after the outage backoff (0.2 s, 0.4 s, 0.8 s,
#: 1.6 s, jittered): six each at most. Before, hundreds (fewer on a loaded machine: each
#: lane's retry waited for a worker and its connect).
MOST = 32


def sync_handler(message: Delivery, conn: Any) -> None:
    conn.execute("INSERT INTO applied (id) VALUES (%s)", (message.id,))


async def asyncpg_handler(message: Delivery, conn: Any) -> None:
    await conn.execute("INSERT INTO applied (id) VALUES ($1)", message.id)


HANDLERS: dict[str, tuple[Callable[..., Any], str | None]] = {
    "psycopg": (sync_handler, None),
    "asyncpg": (asyncpg_handler, "asyncpg"),
}


def _database(url: str) -> str:
    return url.rsplit("/", 1)[1].split("?", 1)[0]


def _read_only(url: str, on: bool) -> None:
    """For the test's own database only (new sessions): the shared server is left alone."""
    setting = (
        "SET default_transaction_read_only = on" if on else "RESET default_transaction_read_only"
    )
    # This session writable whatever the database's default says by now.
    with psycopg.connect(
        url, autocommit=True, options="-c default_transaction_read_only=off"
    ) as conn:
        conn.execute(f'ALTER DATABASE "{_database(url)}" {setting}')


async def _within(check: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


@pytest.mark.parametrize("driver", list(HANDLERS))
async def test_a_read_only_database_is_backed_off_not_reconnected_per_key(
    pg_url: str, driver: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE applied (id uuid PRIMARY KEY)")
    _read_only(pg_url, True)
    connects = 0
    for module in (psycopg, asyncpg):
        connect = module.connect

        def counting(*args: Any, _connect: Any = connect, **kwargs: Any) -> Any:
            nonlocal connects
            connects += 1
            return _connect(*args, **kwargs)

        monkeypatch.setattr(module, "connect", counting)
    name = f"ro-storm-{uuid.uuid4().hex[:8]}"
    memory_broker(name).messages.extend(
        make_message("t", {"n": n}, key=f"k{n}") for n in range(KEYS)
    )
    handler, async_driver = HANDLERS[driver]
    consumer = Consumer(
        db=pg_url,
        broker=f"memory://{name}",
        group="g",
        handler=handler,
        concurrency=4,
        async_driver=async_driver,
    )
    caplog.set_level(logging.WARNING, logger="outboxer")
    running = asyncio.create_task(consumer.run_async())
    try:
        await asyncio.sleep(WINDOW)
        in_window, warnings = connects, len(caplog.records)
        _read_only(pg_url, False)
        applied = await _within(lambda: len(group_state(name, "g").acked) == KEYS, 5)
    finally:
        consumer.stop()
        await asyncio.wait_for(running, 10)
    print(f"{driver}: {in_window} connects and {warnings} warnings in {WINDOW:g}s")
    assert in_window <= MOST, f"{in_window} connects in {WINDOW:g}s ({warnings} warnings)"
    assert applied, "not every message was applied once the database took writes"
    assert consumer.stats.failed == 0, consumer.stats


async def test_a_read_only_mysql_server_is_backed_off_not_reconnected_per_key(
    pair: Pair, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The same with PyMySQL sessions on a MariaDB left ``read_only`` (a private server:
    ``SET GLOBAL`` is not for the shared one)."""
    import pymysql

    sql(pair.old, "CREATE TABLE applied (id CHAR(36) PRIMARY KEY)")
    sql(pair.old, "SET GLOBAL read_only = ON")
    connects = 0
    connect = pymysql.connections.Connection.connect

    def counting(self: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal connects
        connects += 1
        return connect(self, *args, **kwargs)

    monkeypatch.setattr(pymysql.connections.Connection, "connect", counting)

    def record(message: Delivery, conn: Any) -> None:
        with conn.cursor() as cursor:
            cursor.execute("INSERT INTO applied (id) VALUES (%s)", (str(message.id),))

    name = f"ro-storm-{uuid.uuid4().hex[:8]}"
    memory_broker(name).messages.extend(
        make_message("t", {"n": n}, key=f"k{n}") for n in range(KEYS)
    )
    consumer = Consumer(
        db=pair.url(), broker=f"memory://{name}", group="g", handler=record, concurrency=4
    )
    caplog.set_level(logging.WARNING, logger="outboxer")
    running = asyncio.create_task(consumer.run_async())
    try:
        await asyncio.sleep(WINDOW)
        in_window, warnings = connects, len(caplog.records)
        sql(pair.old, "SET GLOBAL read_only = OFF")
        applied = await _within(lambda: len(group_state(name, "g").acked) == KEYS, 5)
    finally:
        consumer.stop()
        await asyncio.wait_for(running, 10)
    print(f"pymysql: {in_window} connects and {warnings} warnings in {WINDOW:g}s")
    assert in_window <= MOST, f"{in_window} connects in {WINDOW:g}s ({warnings} warnings)"
    assert applied, "not every message was applied once the server took writes"
    assert consumer.stats.failed == 0, consumer.stats
