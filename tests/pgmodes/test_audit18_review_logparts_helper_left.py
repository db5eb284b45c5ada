"""Review of the log's partition upkeep (audit 18): an upkeep whose connection is lost
midway (relay killed -9, host gone, network cut) must not leave the log refusing writes.

The upkeep committed a CHECK on the default partition excluding the days it was about to
attach, then validated it and attached the days in later transactions. Lost between the
two, the CHECK stayed (its ERROR said so, but nothing could drop it without another
upkeep). Once the first excluded day began without its partition, every row of that day
was routed to the default partition, broke the CHECK, and the writer's transaction failed:
with the only relay down, the application could no longer enqueue, where before this
upkeep a relay down only filled the default partition. With the default partition small
(the normal case: it holds only rows of days the upkeep missed) the days are now attached
in one transaction, so nothing is left behind.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time

import psycopg
import pytest

from outboxer.stores.pglog import PgLog


@pytest.fixture
async def url(pg_url: str) -> str:
    async with PgLog(pg_url) as log:
        await log.apply_schema()
    return pg_url


def _today(url: str) -> dt.date:
    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT CAST(statement_timestamp() AT TIME ZONE 'UTC' AS date)"
        ).fetchone()
    assert row is not None
    return row[0]  # type: ignore[no-any-return]


async def _terminate_when_waiting(url: str, pid: int) -> None:
    """End the session ``pid`` (as a relay killed -9 would be) once it waits for a lock."""
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as watcher:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            cursor = await watcher.execute(
                "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)
            )
            row = await cursor.fetchone()
            if row is not None and row[0] == "Lock":
                await watcher.execute("SELECT pg_terminate_backend(%s)", (pid,))
                return
            await asyncio.sleep(0.01)
    raise AssertionError("the upkeep never waited for the lock held on the log")


async def test_an_upkeep_lost_midway_leaves_every_day_writable(url: str) -> None:
    today = _today(url)
    ahead = [today + dt.timedelta(days=n) for n in range(2, 8)]
    with psycopg.connect(url, autocommit=True) as conn:
        for day in ahead:
            conn.execute(f"DROP TABLE outboxer.outbox_log_p{day:%Y%m%d}")
    # A session holding the lock ATTACH takes on the log (a VACUUM, an index build, another
    # DDL): the upkeep waits for it at its attaching step, and is lost there.
    with psycopg.connect(url) as blocker:
        blocker.execute("LOCK TABLE ONLY outboxer.outbox_log IN SHARE UPDATE EXCLUSIVE MODE")
        async with PgLog(url) as log:
            killer = asyncio.create_task(_terminate_when_waiting(url, log.conn.get_server_pid()))
            with pytest.raises(Exception):  # noqa: B017 -- any error of a lost connection
                await log.ensure_partitions(7)
            await killer
        blocker.rollback()
    # The first day it was making begins (as a writer's row of that day, created_at being its
    # transaction's start): still without a partition, so routed to the default partition.
    with psycopg.connect(url) as conn:
        conn.execute(
            "INSERT INTO outboxer.outbox_log "
            "(order_xid, id, topic, payload, content_type, created_at) "
            "VALUES (pg_current_xact_id(), gen_random_uuid(), 'orders', '\\x7b7d', "
            "'application/json', %s)",
            (dt.datetime.combine(ahead[0], dt.time(0, 5), tzinfo=dt.UTC),),
        )
        helpers = conn.execute(
            "SELECT conname FROM pg_constraint "
            "WHERE conrelid = 'outboxer.outbox_log_default'::regclass"
        ).fetchall()
    assert helpers == []
