"""The consumer's database runs out of disk space, then space is freed (tests/diskfull.py: a
real tmpfs filled by a ballast file, never a mock).

Before, the refusal (PostgreSQL's 53100 disk_full, SQLITE_FULL) was taken for the message's
own failure: the inbox claim failed for each message alone, each was charged its attempts,
and once space came back written as a dead letter and acked, never applied (measured: 2 of
9 messages dead-lettered after a 4 s outage with max_attempts=3; an hour of it dead-letters
everything that came). Now a full database is an outage: not acked, no attempt counted,
nothing dead-lettered for it, each head tried again after the outage backoff; once space
returns every message is applied once, in key order.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sqlite3
import time
import uuid
from collections.abc import Callable, Sized
from pathlib import Path
from typing import Any

import psycopg
import pytest

from outboxer.brokers.memory import memory_broker
from outboxer.consumer import Consumer, Delivery
from outboxer.receivers.memory import group_state
from outboxer.testing import make_message
from tests import relaying
from tests.chaos.servers import PrivatePostgres
from tests.diskfull import (  # noqa: F401 -- diskfull_postgres: a fixture
    Ballast,
    diskfull_postgres,
    pg_database_on_tmpfs,
    tmpfs,
)

#: Seconds the consumer has, once space is back, to apply everything (the outage backoff of
#: a lane refused three or four times in a row is 0.8 to 1.6 s).
BOUND = 6.0
KEYS = 3
PER_KEY = 3


def sync_handler(message: Delivery, conn: Any) -> None:
    conn.execute(
        "INSERT INTO applied (message_id, k, n, pad) VALUES (%s, %s, %s, %s)",
        (str(message.id), message.key, message.payload["n"], message.payload.get("pad", "")),
    )


async def asyncpg_handler(message: Delivery, conn: Any) -> None:
    await conn.execute(
        "INSERT INTO applied (message_id, k, n, pad) VALUES ($1, $2, $3, $4)",
        str(message.id),
        message.key,
        message.payload["n"],
        message.payload.get("pad", ""),
    )


def sqlite_handler(message: Delivery, conn: Any) -> None:
    conn.execute(
        "INSERT INTO applied (message_id, k, n, pad) VALUES (?, ?, ?, ?)",
        (str(message.id), message.key, message.payload["n"], message.payload.get("pad", "")),
    )


PG_HANDLERS: dict[str, tuple[Callable[..., Any], str | None]] = {
    "psycopg": (sync_handler, None),
    "asyncpg": (asyncpg_handler, "asyncpg"),
}
#: Every row on a page of its own (PLAIN: never compressed nor moved out of line), so that
#: each insert must extend the table: on a full disk the handler's own write fails.
PG_APPLIED = (
    "CREATE TABLE applied (seq bigserial PRIMARY KEY, message_id text NOT NULL, k text, "
    "n int NOT NULL, pad text NOT NULL);"
    "ALTER TABLE applied ALTER COLUMN pad SET STORAGE PLAIN"
)


def pg_applied(url: str) -> list[tuple[str, str, int]]:
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute("SELECT message_id, k, n FROM applied ORDER BY seq").fetchall()
        return [(str(r[0]), str(r[1]), int(r[2])) for r in rows]


def pg_dead_letters(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM outboxer.dead_letters").fetchone()
    return int(row[0]) if row else -1


def check_applied(rows: list[tuple[str, str, int]], sent: list[Any], warmups: int = 0) -> None:
    """Each message once, and each key's in the order sent."""
    rows = rows[warmups:]
    assert sorted(r[0] for r in rows) == sorted(str(m.id) for m in sent), rows
    for k in range(KEYS):
        assert [r[2] for r in rows if r[1] == f"k{k}"] == [
            json.loads(m.payload)["n"] for m in sent if m.key == f"k{k}"
        ]


def messages(pad: str = "") -> list[Any]:
    return [
        make_message("t", {"n": n, "pad": pad}, key=f"k{n % KEYS}") for n in range(KEYS * PER_KEY)
    ]


async def ride_out(
    consumer: Consumer,
    broker: Any,
    acked: Sized,
    ballast: Ballast,
    sent: list[Any],
    *,
    warm: bool,
) -> None:
    """Fill the disk, deliver ``sent``, let the consumer meet the full disk a few times per
    key, check nothing was acked, charged or dead-lettered, then free the space and wait
    until everything is acked. With ``warm``, one message is applied first (the inbox then
    has room for the claims: only the handlers' writes need space)."""
    task = asyncio.create_task(consumer.run_async())
    warmups = int(warm)
    try:
        # Connected before the disk fills (a new PostgreSQL backend reads, or writes, its
        # catalog cache file at connect; SQLite's -shm is made by the first connection).
        await relaying.until(lambda: consumer.receiver.connected, "the consumer started", 5)
        if warm:
            broker.messages.append(make_message("t", {"n": -1, "pad": "w"}, key="warm"))
            await relaying.until(lambda: len(acked) == 1, "the warm-up message applied", 5)
        assert ballast.fill() > 0
        broker.messages.extend(sent)
        await relaying.until(
            lambda: consumer.stats.database_errors >= 2 * KEYS,
            f"the full disk not met: {consumer.stats}",
            5,
        )
        assert len(acked) == warmups, "acked while the disk was full"
        assert consumer.stats.failed == 0, consumer.stats
        assert consumer.stats.dead_lettered == 0, consumer.stats
        ballast.free()
        freed = time.monotonic()
        await relaying.until(
            lambda: len(acked) == warmups + len(sent), f"not all applied: {consumer.stats}", BOUND
        )
        print(f"all applied {time.monotonic() - freed:.2f}s after space came back")
    finally:
        ballast.free()
        consumer.stop()
        done, _ = await asyncio.wait({task}, timeout=5)
        if not done:
            task.cancel()
            await asyncio.wait({task})
    assert consumer.stats.failed == 0, consumer.stats
    assert consumer.stats.dead_lettered == 0, consumer.stats
    # Counted as what it was: database errors, and the disk full (in database_errors too).
    assert consumer.stats.database_errors >= consumer.stats.database_full >= 2 * KEYS


def pg_consumer(url: str, driver: str, name: str) -> Consumer:
    handler, async_driver = PG_HANDLERS[driver]
    return Consumer(
        db=url,
        broker=f"memory://{name}",
        group="g",
        handler=handler,
        concurrency=2,
        max_attempts=2,
        async_driver=async_driver,
    )


@pytest.mark.parametrize("driver", list(PG_HANDLERS))
async def test_audit21_pg_inbox_claims_on_a_full_disk_are_an_outage(
    diskfull_postgres: PrivatePostgres,  # noqa: F811 -- the fixture
    driver: str,
) -> None:
    """The inbox is empty: the batches' claims must extend it, and fail."""
    with pg_database_on_tmpfs(diskfull_postgres) as (url, ballast):
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(PG_APPLIED)
        name = f"diskfull-{uuid.uuid4().hex[:8]}"
        broker = memory_broker(name)
        acked = group_state(name, "g").acked
        consumer = pg_consumer(url, driver, name)
        sent = messages()
        await ride_out(consumer, broker, acked, ballast, sent, warm=False)
        check_applied(pg_applied(url), sent)
        assert pg_dead_letters(url) == 0


@pytest.mark.parametrize("driver", list(PG_HANDLERS))
async def test_audit21_pg_handler_write_on_a_full_disk_is_an_outage(
    diskfull_postgres: PrivatePostgres,  # noqa: F811 -- the fixture
    driver: str,
) -> None:
    """The inbox has room; each handler's row needs a page of its own: the handler's own
    write on the consumer's connection meets the full disk, no attempt charged for it."""
    with pg_database_on_tmpfs(diskfull_postgres) as (url, ballast):
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(PG_APPLIED)
        name = f"diskfull-{uuid.uuid4().hex[:8]}"
        broker = memory_broker(name)
        acked = group_state(name, "g").acked
        consumer = pg_consumer(url, driver, name)
        sent = messages(pad="x" * 5000)
        await ride_out(consumer, broker, acked, ballast, sent, warm=True)
        check_applied(pg_applied(url), sent, warmups=1)
        assert pg_dead_letters(url) == 0


async def test_audit21_sqlite_full_disk_is_an_outage(sqlite_template: Path) -> None:
    """SQLITE_FULL ("database or disk is full") as the WAL cannot grow."""
    with tmpfs(16) as mount:
        path = mount / "consumer.db"
        shutil.copyfile(sqlite_template, path)
        url = f"sqlite:///{path}"
        with sqlite3.connect(path) as conn:
            conn.execute(
                "CREATE TABLE applied (seq INTEGER PRIMARY KEY, message_id TEXT NOT NULL, "
                "k TEXT, n INTEGER NOT NULL, pad TEXT NOT NULL)"
            )
        conn.close()
        name = f"diskfull-{uuid.uuid4().hex[:8]}"
        broker = memory_broker(name)
        acked = group_state(name, "g").acked
        consumer = Consumer(
            db=url,
            broker=f"memory://{name}",
            group="g",
            handler=sqlite_handler,
            concurrency=2,
            max_attempts=2,
        )
        sent = messages()
        await ride_out(consumer, broker, acked, Ballast(mount), sent, warm=False)
        with sqlite3.connect(path) as conn:
            rows = conn.execute("SELECT message_id, k, n FROM applied ORDER BY seq").fetchall()
            dead = conn.execute("SELECT count(*) FROM dead_letters").fetchone()[0]
        conn.close()
        check_applied([(str(r[0]), str(r[1]), int(r[2])) for r in rows], sent)
        assert dead == 0
