"""Partition upkeep against an operator's purge on the partitioned outbox: the lock order.

A purge (``outboxer purge``, the HTTP API) reads the table first (``destinations_matching``:
ACCESS SHARE on the table and on every partition, the default one included), then takes
its destinations' shared locks (it waits there while a claim holds one), then deletes (ROW
EXCLUSIVE on the table). An upkeep attaching a partition whose range starts near now held
SHARE ROW EXCLUSIVE on the table, then asked ACCESS EXCLUSIVE on the default partition
(ATTACH scans it): it waited for the purge's read lock there, and the purge's DELETE waited
for the upkeep's lock on the table. A deadlock: PostgreSQL broke it after deadlock_timeout
(1 s) by failing the upkeep with 40P01, which it did not expect (a failed cleanup round),
or the purge's transaction, the operator's."""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Callable

import psycopg

from outboxer.admin import MessageFilter
from outboxer.stores.pgpartitions import PartitionPolicy
from outboxer.stores.postgres import PostgresStore
from tests.integration import test_store_contract as contract
from tests.pgmodes.test_partitioned import TABLE, enqueue_one, execute


async def wait_for(
    url: str, sql: str, timeout: float = 5.0, done: Callable[[], bool] = lambda: False
) -> None:
    """Poll until ``sql`` returns true (or ``done()`` does)."""
    deadline = asyncio.get_running_loop().time() + timeout
    with psycopg.connect(url, autocommit=True) as conn:
        while not done():
            row = conn.execute(sql).fetchone()
            if row is not None and row[0]:
                return
            assert asyncio.get_running_loop().time() < deadline, f"never true: {sql}"
            await asyncio.sleep(0.01)


async def test_an_attach_near_now_never_deadlocks_with_a_purge(pg_partitioned_url: str) -> None:
    url = pg_partitioned_url
    contract.TestPostgresStore().enqueue(url, ("t", None), ("t", None))
    execute(url, f"UPDATE {TABLE} SET status = 'ABANDONED'")
    async with PostgresStore(url) as store, PostgresStore(url) as operator:
        ranged = [p for p in await store.partitions() if p.upper is not None]
        newest = ranged[-1].upper
        assert newest is not None
        # The clock of the round: the next partition starts within a minute (SOON), so the
        # upkeep attaches it with the writers held back, as with short partitions.
        now = newest - dt.timedelta(minutes=1)
        with psycopg.connect(url, autocommit=True) as claim:
            # A claim of the destination in progress: the purge waits for it after its read.
            claim.execute("SELECT pg_advisory_lock(%s)", (store.lock_key("default"),))
            purge = asyncio.create_task(operator.purge(MessageFilter(statuses=("ABANDONED",))))
            await wait_for(
                url,
                "SELECT count(*) > 0 FROM pg_locks WHERE locktype = 'advisory' AND NOT granted",
            )
            upkeep = asyncio.create_task(
                store.maintain_partitions(PartitionPolicy(ahead=1), now=now)
            )
            # The upkeep is either done (the purge holds no lock on the table while it
            # waits for the destination) or waits for the purge's read lock.
            await wait_for(
                url,
                "SELECT count(*) > 0 FROM pg_locks WHERE locktype = 'relation' AND NOT granted "
                "AND relation IN ('outboxer.outbox'::regclass, 'outboxer.outbox_default'::regclass)",
                done=upkeep.done,
            )
            started = asyncio.get_running_loop().time()
            claim.execute("SELECT pg_advisory_unlock(%s)", (store.lock_key("default"),))
            results = await asyncio.gather(purge, upkeep, return_exceptions=True)
            waited = asyncio.get_running_loop().time() - started
    purged, report = results
    assert not isinstance(purged, BaseException), f"the purge failed: {purged!r}"
    assert not isinstance(report, BaseException), f"the upkeep failed: {report!r}"
    assert purged == 2
    assert waited < 0.5, f"the purge waited {waited:.2f}s behind the upkeep"
    assert report.busy == [] and len(report.created) == 1, report


async def test_an_attach_near_now_never_deadlocks_with_a_writer_that_read_the_table(
    pg_partitioned_url: str,
) -> None:
    """An application's transaction that reads the outbox (ACCESS SHARE on the table and its
    partitions), then enqueues (ROW EXCLUSIVE on the table): the same cycle with the attach,
    and the application's transaction was the one failed (40P01) or held for a second."""
    url = pg_partitioned_url
    async with PostgresStore(url) as store:
        ranged = [p for p in await store.partitions() if p.upper is not None]
        newest = ranged[-1].upper
        assert newest is not None
        with psycopg.connect(url) as writer:
            writer.execute(f"SELECT count(*) FROM {TABLE} WHERE topic = 't'")
            upkeep = asyncio.create_task(
                store.maintain_partitions(
                    PartitionPolicy(ahead=1), now=newest - dt.timedelta(minutes=1)
                )
            )
            await wait_for(
                url,
                "SELECT count(*) > 0 FROM pg_locks WHERE locktype = 'relation' AND NOT granted "
                "AND relation IN ('outboxer.outbox'::regclass, 'outboxer.outbox_default'::regclass)",
            )
            started = asyncio.get_running_loop().time()
            await asyncio.to_thread(enqueue_one, writer)
            waited = asyncio.get_running_loop().time() - started
            writer.commit()
        report = await upkeep
    assert waited < 0.5, f"the writer waited {waited:.2f}s behind the upkeep"
    assert report.busy == [] and len(report.created) == 1, report


async def test_an_upkeep_step_failed_by_a_deadlock_waits_for_the_next_round(
    pg_partitioned_url: str,
) -> None:
    """Another session's lock order can still close a cycle with the upkeep (here one that
    locks the default partition by name, then writes the table). When PostgreSQL breaks it
    by failing the upkeep (deadlock_timeout shorter than the upkeep's lock_timeout), the
    step is left for the next round, as when a lock is not granted in time: the round
    raised 40P01 (a failed cleanup round) and made none of its other changes."""
    url = pg_partitioned_url
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT current_database()").fetchone()
        assert row is not None
        conn.execute(f"ALTER DATABASE \"{row[0]}\" SET deadlock_timeout = '100ms'")
    async with PostgresStore(url) as store:
        ranged = [p for p in await store.partitions() if p.upper is not None]
        newest = ranged[-1].upper
        assert newest is not None
        with psycopg.connect(url) as writer:
            writer.execute("LOCK TABLE outboxer.outbox_default IN ACCESS SHARE MODE")
            upkeep = asyncio.create_task(
                store.maintain_partitions(
                    PartitionPolicy(ahead=1), now=newest - dt.timedelta(minutes=1)
                )
            )
            await wait_for(
                url,
                "SELECT count(*) > 0 FROM pg_locks WHERE locktype = 'relation' AND NOT granted "
                "AND relation = 'outboxer.outbox_default'::regclass",
            )
            written = asyncio.create_task(asyncio.to_thread(enqueue_one, writer))
            report = await asyncio.gather(upkeep, return_exceptions=True)
            await written
            writer.commit()
    [result] = report
    assert not isinstance(result, BaseException), f"the upkeep failed: {result!r}"
    assert result.created == [] and len(result.busy) == 1, result
