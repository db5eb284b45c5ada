"""The partitioned outbox's upkeep and migration against the real PostgreSQL, under the
conditions that broke them: a database whose default isolation is not READ COMMITTED, and
a row that arrives, after its partition was dropped, in a range another partition no
longer covers."""

from __future__ import annotations

import asyncio
import datetime as dt

import psycopg
import pytest

from outboxer.config import DAY
from outboxer.stores import Failure
from outboxer.stores.pgpartitions import PartitionPolicy
from outboxer.stores.postgres import PostgresStore
from tests.integration import test_store_contract as contract
from tests.pgmodes.test_partitioned import (
    TABLE,
    enqueue_one,
    execute,
    retention_policy,
    where_rows,
    write_one,
)


def default_isolation(url: str, level: str) -> None:
    """Every later session of the database's starts its transactions at ``level``, as a
    database an operator set up so (``ALTER DATABASE ... SET default_transaction_isolation``)."""
    with psycopg.connect(url, autocommit=True) as conn:
        name = conn.execute("SELECT current_database()").fetchone()
        assert name is not None
        conn.execute(f"ALTER DATABASE \"{name[0]}\" SET default_transaction_isolation = '{level}'")


@pytest.mark.parametrize("level", ["repeatable read", "serializable"])
async def test_a_drop_sees_a_requeue_that_committed_while_it_waited_whatever_the_isolation(
    pg_partitioned_url: str, level: str
) -> None:
    """The check that a partition holds no unfinished row reads the rows as the DROP's lock
    finds them. At REPEATABLE READ (or SERIALIZABLE) the transaction's snapshot was taken
    before that lock was granted: a requeue that committed meanwhile was invisible and its
    PENDING row was dropped with the partition."""
    url = pg_partitioned_url
    [message] = contract.TestPostgresStore().enqueue(url, ("t", None))
    async with PostgresStore(url) as store:
        claim = await store.claim("default", "relay-a", 1, 60, False)
        failure = Failure(claim[0].stored_seq, "rejected", 0, True)
        await store.settle("default", claim.lease, [], [failure], [], 5)
    execute(
        url,
        f"UPDATE {TABLE} SET created_at = created_at - interval '40 days', "
        "updated_at = updated_at - interval '40 days'",
    )
    default_isolation(url, level)
    async with PostgresStore(url) as store:
        await store.maintain_partitions(PartitionPolicy())
        [old] = {p for p, _ in where_rows(url).values()}
        with psycopg.connect(url) as requeue:
            requeue.execute(
                f"UPDATE {TABLE} SET status = 'PENDING' WHERE id = %s", (str(message.id),)
            )
            upkeep = asyncio.create_task(store.maintain_partitions(retention_policy()))
            await asyncio.sleep(0.3)
            assert not upkeep.done(), "the DROP waits for the requeue's transaction"
            requeue.commit()
        report = await upkeep
    assert old not in {p.name for p in report.dropped}, "a PENDING row dropped"
    assert report.kept == [old]
    assert list(where_rows(url).values()) == [(old, "PENDING")]


async def test_migrate_moves_a_row_committed_while_it_waited_whatever_the_isolation(
    pg_url: str,
) -> None:
    """`schema migrate-partitioned` copies the rows the lock on the old table finds: at
    REPEATABLE READ its snapshot was taken before that lock, and a writer's row committed
    meanwhile stayed behind in <table>_plain, PENDING and never sent."""
    default_isolation(pg_url, "repeatable read")
    with psycopg.connect(pg_url) as before:
        written_before = enqueue_one(before)
        migrate = asyncio.create_task(PostgresStore(pg_url).migrate_to_partitioned())
        await asyncio.sleep(0.3)
        assert not migrate.done(), "the move waits for the writer"
        before.commit()
    report = await migrate
    written_after = await asyncio.to_thread(write_one, pg_url)
    assert report.moved == 1
    async with PostgresStore(pg_url) as store:
        taken = await store.claim("default", "relay-a", 10, 60, False)
        assert [m.id for m in taken] == [written_before, written_after]


async def test_a_row_arriving_in_a_gap_retention_left_moves_into_a_partition_of_its_own(
    pg_partitioned_url: str,
) -> None:
    """Retention drops the partitions past it while an older one stays, kept by an
    unfinished row: a gap. A row that arrives in the gap (a writer whose transaction began
    before the drop: created_at is its start) waits in the default partition, and the
    upkeep makes a partition for it there, not for the rest of the gap. It stayed in the
    default partition for ever, every later partition made with the writers held back to
    move it."""
    url = pg_partitioned_url
    helper = contract.TestPostgresStore()
    [stuck] = helper.enqueue(url, ("t", None))
    execute(url, f"UPDATE {TABLE} SET created_at = created_at - interval '40 days'")
    async with PostgresStore(url) as store:
        policy = PartitionPolicy(published_retention=7 * DAY, abandoned_retention=7 * DAY)
        report = await store.maintain_partitions(policy)
        [(old, _)] = where_rows(url).values()
        assert report.kept == [old] and len(report.dropped) > 25, "a gap after the kept one"
        ranged = [p for p in await store.partitions() if p.lower is not None]
        assert ranged[0].name == old and ranged[0].upper is not None
        assert ranged[1].lower is not None and ranged[1].lower > ranged[0].upper
        # The long writer's row: created 20 days ago, committed after the drop.
        [late] = helper.enqueue(url, ("t", None))
        execute(
            url,
            f"UPDATE {TABLE} SET created_at = created_at - interval '20 days' "
            f"WHERE id = '{late.id}'",
        )
        assert where_rows(url)[max(where_rows(url))][0] == "outbox_default"
        report = await store.maintain_partitions(policy)
        assert report.moved == 1
        twenty_days_ago = dt.datetime.now(dt.UTC) - dt.timedelta(days=20)
        home = f"outbox_p{twenty_days_ago:%Y%m%d}"
        assert report.created == [home], "a partition for the row's day only"
        assert sorted(report.kept) == sorted([old, home]), "each kept by its PENDING row"
        assert {p for p, _ in where_rows(url).values()} == {old, home}
        status = await store.status_report()
        assert status["partitions"]["default_partition_rows"] == 0
        again = await store.maintain_partitions(policy)
        assert again.created == [] and again.dropped == [], "nothing made or dropped again"
        taken = await store.claim("default", "relay-a", 10, 60, False)
        assert [m.id for m in taken] == [stuck.id, late.id]
