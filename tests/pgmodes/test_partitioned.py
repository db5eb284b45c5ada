"""The partitioned outbox (``outboxer schema apply --partitioned``) against the real
PostgreSQL: the store contract, partition upkeep and retention, the schema's guards."""

from __future__ import annotations

import asyncio
import datetime as dt
import itertools
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest

from outboxer.config import DAY, Settings
from outboxer.errors import SchemaError
from outboxer.relay import cleanup
from outboxer.stores import Failure, create_store
from outboxer.stores.pgpartitions import PartitionPolicy
from outboxer.stores.postgres import PostgresStore
from outboxer.stores.sqlfiles import migrations
from tests.integration import test_store_contract as contract

TABLE = "outboxer.outbox"


def execute(url: str, *statements: str) -> None:
    with psycopg.connect(url) as conn:
        for statement in statements:
            conn.execute(statement)


def where_rows(url: str) -> dict[int, tuple[str, str]]:
    """seq -> (partition, status) of every row."""
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            f"SELECT seq, CAST(tableoid AS regclass)::text, status FROM {TABLE}"
        ).fetchall()
    return {seq: (partition.removeprefix("outboxer."), status) for seq, partition, status in rows}


def statuses(url: str) -> list[str]:
    """The statuses of the rows, in seq order."""
    return [status for _, (_, status) in sorted(where_rows(url).items())]


def retention(**changes: Any) -> Settings:
    values: dict[str, Any] = {"published_retention": 7 * DAY, "abandoned_retention": 30 * DAY}
    return Settings(**{**values, **changes})


class TestPartitionedStore(contract.TestPostgresStore):
    """Every promise of the default table, kept by the partitioned one."""

    @pytest.fixture
    def url(self, pg_partitioned_url: str) -> str:
        return pg_partitioned_url

    async def test_cleanup_deletes_old_finished_rows_in_bounded_batches(
        self, url: str, store: Any
    ) -> None:
        """Replaced: retention drops whole partitions here, never rows one by one (see
        test_retention_drops_a_partition_once_every_row_is_past_its_retention)."""
        self.enqueue(url, ("t", None))
        with pytest.raises(Exception, match="DELETE on the partitioned outbox"):
            await store.cleanup("PUBLISHED", 0, 10)
        assert len(self.rows(url)) == 1

    async def test_claim_and_settle_change_only_their_rows_across_partitions(
        self, url: str, store: Any
    ) -> None:
        """Rows of two partitions sit at the same places (ctid) in each: a claim, a settle and
        a takeover change exactly the rows they name, never their twins."""
        sent = self.enqueue(url, *[("t", None)] * 3)
        moved = self.enqueue(url, *[("t", None)] * 3)
        ids = ", ".join(f"'{m.id}'" for m in moved)
        # Into tomorrow's partition, where they take the first places, as the others do today.
        execute(
            url,
            f"UPDATE {TABLE} SET created_at = created_at + interval '1 day' WHERE id IN ({ids})",
        )
        places = where_rows(url)
        assert len({partition for partition, _ in places.values()}) == 2
        claim = await self.claim(store, limit=2)
        assert [m.id for m in claim] == [m.id for m in sent[:2]]
        assert statuses(url) == ["PROCESSING"] * 2 + ["PENDING"] * 4
        await self.settle(store, claim, published=[claim[0].stored_seq])
        assert statuses(url) == ["PUBLISHED", "PROCESSING"] + ["PENDING"] * 4
        self.execute(url, self.shift_sql("locked_until", 120))
        taken = await self.claim(store, "relay-b")
        assert taken.recovered and [m.id for m in taken] == [sent[1].id]
        assert statuses(url) == ["PUBLISHED", "PROCESSING"] + ["PENDING"] * 4
        rest = await self.claim(store, "relay-c")
        assert [m.id for m in rest] == [sent[2].id, *(m.id for m in moved)]


async def test_schema_apply_makes_partitions_ahead_and_the_relay_accepts_it(
    pg_partitioned_url: str,
) -> None:
    async with PostgresStore(pg_partitioned_url) as store:
        await store.check_schema()
        assert await store.is_partitioned()
        partitions = await store.partitions()
        assert partitions[0].name == "outbox_default" and partitions[0].lower is None
        now = dt.datetime.now(dt.UTC)
        ranged = partitions[1:]
        assert ranged[0].lower is not None and ranged[0].lower <= now
        assert ranged[-1].upper is not None and ranged[-1].upper > now + dt.timedelta(days=3)
        assert all(a.upper == b.lower for a, b in itertools.pairwise(ranged))
        assert await store.apply_schema() == []
        assert len(await store.partitions()) == len(partitions), "nothing more to make today"
        applied = await store.applied_migrations()
        assert applied == {m.version for m in migrations("postgres", "partitioned")}
        assert {4, 5} & applied == set(), "an outboxer without this layout refuses the table"


async def test_partitioned_refuses_an_existing_plain_table(pg_url: str) -> None:
    async with PostgresStore(pg_url) as store:
        with pytest.raises(SchemaError, match=r"exists as a plain table.*migrate-partitioned"):
            await store.apply_schema(partitioned=True)
        assert not await store.is_partitioned()
        assert await store.partitions() == []


def test_delete_on_the_table_is_refused_unless_meant(pg_partitioned_url: str) -> None:
    """An outboxer without this layout deletes rows by ctid, unsafe here: refused."""
    contract.TestPostgresStore().enqueue(pg_partitioned_url, ("t", None))
    with pytest.raises(psycopg.errors.RestrictViolation, match="partitioned outbox"):
        execute(pg_partitioned_url, f"DELETE FROM {TABLE}")
    execute(pg_partitioned_url, "SET outboxer.allow_delete = on", f"DELETE FROM {TABLE}")
    assert where_rows(pg_partitioned_url) == {}


async def test_rows_no_partition_covers_wait_in_the_default_and_move_out_in_flight(
    pg_partitioned_url: str,
) -> None:
    """A writer never fails for want of a partition; upkeep moves such rows where they
    belong, a row in flight included, and its relay settles it there."""
    url = pg_partitioned_url
    helper = contract.TestPostgresStore()
    first, second = helper.enqueue(url, ("t", "k"), ("t", "k"))
    async with PostgresStore(url) as store:
        claim = await store.claim("default", "relay-a", 1, 60, False)
        assert [m.id for m in claim] == [first.id]
        execute(url, f"UPDATE {TABLE} SET created_at = created_at + interval '10 days'")
        assert {p for p, _ in where_rows(url).values()} == {"outbox_default"}
        status = await store.status_report()
        assert status["partitions"]["default_partition_rows"] == 2, "status shows them"
        report = await store.maintain_partitions(PartitionPolicy(ahead=3))
        status = await store.status_report()
        assert status["partitions"]["default_partition_rows"] == 0
        assert status["partitions"]["count"] == len(await store.partitions()) - 1
        assert report.moved == 2 and len(report.created) >= 7
        [home] = {p for p, _ in where_rows(url).values()}
        in_ten_days = dt.datetime.now(dt.UTC) + dt.timedelta(days=10)
        assert home == f"outbox_p{in_ten_days:%Y%m%d}"
        result = await store.settle("default", claim.lease, [claim[0].stored_seq], [], [], 5)
        assert result.published == 1
        [after] = await store.claim("default", "relay-a", 10, 60, False)
        assert after.id == second.id, "the key's order held through the move"
        partitions = await store.partitions()
        assert all(a.upper == b.lower for a, b in itertools.pairwise(partitions[1:]))


async def test_retention_drops_a_partition_once_every_row_is_past_its_retention(
    pg_partitioned_url: str,
) -> None:
    url = pg_partitioned_url
    helper = contract.TestPostgresStore()
    helper.enqueue(url, *[("t", None)] * 3)
    async with PostgresStore(url) as store:
        first = await store.claim("default", "relay-a", 2, 60, False)
        failure = Failure(first[1].stored_seq, "rejected", 0, True)
        await store.settle("default", first.lease, [first[0].stored_seq], [failure], [], 5)
        # Ten days ago: the rows go to the default partition, then to one made for them.
        execute(
            url,
            f"UPDATE {TABLE} SET created_at = created_at - interval '10 days', "
            "updated_at = updated_at - interval '10 days'",
        )
        assert await cleanup(store, retention()) == 0
        [old] = {p for p, _ in where_rows(url).values()}
        assert old != "outbox_default" and old in {p.name for p in await store.partitions()}
        # Today's partition: a row published long ago, but its partition is young.
        helper.enqueue(url, ("t", None))
        claim = await store.claim("default", "relay-a", 10, 60, False)
        assert len(claim) == 2
        await store.settle("default", claim.lease, [claim[1].stored_seq], [], [], 5)
        execute(url, f"UPDATE {TABLE} SET updated_at = updated_at - interval '10 days'")
        policy = PartitionPolicy(published_retention=7 * DAY, abandoned_retention=3 * DAY)
        report = await store.maintain_partitions(policy)
        # The partitions made between it and today are empty: those past retention go.
        assert report.kept == [old], "a PROCESSING row keeps it"
        assert report.dropped and all(p.estimated_rows <= 0 for p in report.dropped)
        await store.settle("default", claim.lease, [claim[0].stored_seq], [], [], 5)
        report = await store.maintain_partitions(policy)
        assert report.kept == [old] and report.dropped == [], "published just now: kept"
        execute(url, f"UPDATE {TABLE} SET updated_at = now() - interval '10 days'")
        report = await store.maintain_partitions(
            PartitionPolicy(published_retention=7 * DAY, abandoned_retention=30 * DAY)
        )
        assert report.kept == [old] and report.dropped == [], "the ABANDONED row's retention"
        execute(url, f"ANALYZE {TABLE}")
        assert await cleanup(store, retention(abandoned_retention=3 * DAY)) == 3
        assert old not in {p.name for p in await store.partitions()}
        assert [status for _, status in where_rows(url).values()] == ["PUBLISHED"], "today's"


async def test_a_drop_never_races_a_requeue(pg_partitioned_url: str) -> None:
    """The check and the DROP run under the table's lock: a requeue that makes an old
    ABANDONED row PENDING while the upkeep looks either commits first (and the partition
    is kept) or finds the partition gone. Never a PENDING row dropped."""
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
        await store.maintain_partitions(PartitionPolicy())
        [old] = {p for p, _ in where_rows(url).values()}
        with psycopg.connect(url) as requeue:
            # An operator's requeue, not yet committed when the upkeep looks.
            requeue.execute(
                f"UPDATE {TABLE} SET status = 'PENDING' WHERE id = %s", (str(message.id),)
            )
            upkeep = asyncio.create_task(store.maintain_partitions(retention_policy()))
            await asyncio.sleep(0.3)
            assert not upkeep.done(), "the DROP waits for the requeue's transaction"
            requeue.commit()
        report = await upkeep
        assert report.kept == [old] and old not in {p.name for p in report.dropped}
        assert list(where_rows(url).values()) == [(old, "PENDING")]


def retention_policy() -> PartitionPolicy:
    return PartitionPolicy(published_retention=7 * DAY, abandoned_retention=30 * DAY)


async def test_cleanup_of_a_partitioned_outbox_keeps_the_inbox_retention(
    pg_partitioned_url: str,
) -> None:
    execute(
        pg_partitioned_url,
        "INSERT INTO outboxer.inbox (consumer, message_id, received_at) "
        "VALUES ('c', gen_random_uuid(), now() - interval '40 days')",
    )
    async with create_store(pg_partitioned_url) as store:
        assert await cleanup(store, retention()) == 1


async def test_migrate_moves_a_plain_table_with_its_unfinished_rows(pg_url: str) -> None:
    """`outboxer schema migrate-partitioned`: one transaction; the unfinished rows go on
    with their seq and lease, the sequence goes on, a writer that waited for the move
    writes to the new table, and the history stays in <table>_plain."""
    helper = contract.TestPostgresStore()
    published, in_flight, pending = helper.enqueue(pg_url, ("t", "k"), ("t", "k"), ("t", "k"))
    async with PostgresStore(pg_url) as store:
        first = await store.claim("default", "relay-a", 1, 60, False)
        await store.settle("default", first.lease, [first[0].stored_seq], [], [], 5)
        claim = await store.claim("default", "relay-a", 1, 60, False)
        assert [m.id for m in claim] == [in_flight.id]
    with psycopg.connect(pg_url) as before:
        # A writer inside its transaction when the move begins: the move waits for it.
        written_before = enqueue_one(before)
        migrate = asyncio.create_task(PostgresStore(pg_url).migrate_to_partitioned())
        await asyncio.sleep(0.3)
        # A writer that comes while the move waits: it waits behind the move.
        waiting = asyncio.create_task(asyncio.to_thread(write_one, pg_url))
        await asyncio.sleep(0.3)
        assert not migrate.done() and not waiting.done()
        before.commit()
    report = await migrate
    written_while = await waiting
    assert report.moved == 3 and report.kept_as == "outbox_plain"
    with psycopg.connect(pg_url) as after:
        written_after = enqueue_one(after)
    rows = where_rows(pg_url)
    assert sorted(rows) == [claim[0].stored_seq + n for n in range(5)], "seq goes on"
    assert statuses(pg_url) == ["PROCESSING"] + ["PENDING"] * 4
    async with PostgresStore(pg_url) as store:
        await store.check_schema()
        assert await store.is_partitioned()
        result = await store.settle("default", claim.lease, [claim[0].stored_seq], [], [], 5)
        assert result.published == 1, "the lease held through the move"
        rest = await store.claim("default", "relay-a", 10, 60, False)
        expected = [pending.id, written_before, written_while, written_after]
        assert [m.id for m in rest] == expected, "the key's order"
    with psycopg.connect(pg_url) as conn:
        history = conn.execute("SELECT id FROM outboxer.outbox_plain WHERE status = 'PUBLISHED'")
        assert [row[0] for row in history] == [published.id]


def enqueue_one(conn: Any) -> Any:
    from outboxer.enqueue import enqueue

    return enqueue(conn, "t", {"n": 1}, key="k").id


def write_one(url: str) -> Any:
    with psycopg.connect(url) as conn:
        return enqueue_one(conn)


async def test_migrate_refuses_while_a_relay_is_connected(pg_url: str) -> None:
    async with PostgresStore(pg_url) as relay:
        await relay.ping()
        with pytest.raises(SchemaError, match=r"session\(s\) of outboxer relays"):
            await PostgresStore(pg_url).migrate_to_partitioned()
        assert not await relay.is_partitioned(), "nothing changed"


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "outboxer.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_the_commands_of_the_partitioned_layout(pg_url: str, tmp_path: Path) -> None:
    ddl = cli("schema", "sql", "--partitioned").stdout
    assert "PARTITION BY RANGE (created_at)" in ddl and "PARTITION OF" in ddl
    assert "0004_claim_and_settle_functions" not in ddl and "0006_leases_partitioned" in ddl
    refused = cli("schema", "apply", "--db", f"sqlite:///{tmp_path / 'x.db'}", "--partitioned")
    assert refused.returncode == 2 and "--partitioned needs PostgreSQL" in refused.stderr
    plain = cli("schema", "apply", "--db", pg_url, "--partitioned")
    assert plain.returncode == 2 and "schema migrate-partitioned" in plain.stderr
    moved = cli("schema", "migrate-partitioned", "--db", pg_url, "--partitions-ahead", "2")
    assert moved.returncode == 0, moved.stderr
    assert "moved 0 unfinished or abandoned message(s)" in moved.stdout
    assert "outboxer.outbox_plain" in moved.stdout
    again = cli("schema", "apply", "--db", pg_url)
    assert again.returncode == 0 and "4 partition(s) and a default" in again.stdout, "3 ahead"
    assert "schema is up to date" in again.stdout
    status = cli("status", "--db", pg_url)
    assert "partitions: 4 from" in status.stdout and "0 row(s) in the default" in status.stdout
    cleaned = cli("cleanup", "--db", pg_url)
    assert cleaned.returncode == 0 and "deleted 0" in cleaned.stdout, cleaned.stderr


async def test_status_counts_a_partitioned_outbox_from_its_partitions(
    pg_partitioned_url: str,
) -> None:
    """The estimate of PUBLISHED rows reads the partitions' statistics (the parent has
    none); the other counts stay exact."""
    url = pg_partitioned_url
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SET session_replication_role = replica")
        conn.execute(
            f"INSERT INTO {TABLE} (id, destination, topic, payload, content_type, status) "
            "SELECT gen_random_uuid(), CASE WHEN g % 4 = 0 THEN 'b' ELSE 'a' END, 't', '', "
            "'text/plain', 'PUBLISHED' FROM generate_series(1, 4000) AS g"
        )
        conn.execute(f"ANALYZE {TABLE}")
    contract.TestPostgresStore().enqueue(url, ("t", None), ("t", None))
    async with PostgresStore(url) as store:
        store.exact_status_rows = 100  # a "big" table: estimate the PUBLISHED rows
        report = {entry.destination: entry for entry in await store.status()}
    assert report["default"].counts.get("PENDING") == 2
    assert 2400 <= report["a"].counts["PUBLISHED"] <= 3600, report["a"].counts
    assert 600 <= report["b"].counts["PUBLISHED"] <= 1400, report["b"].counts


async def test_purge_deletes_through_the_guard(pg_partitioned_url: str) -> None:
    from outboxer.admin import MessageFilter

    helper = contract.TestPostgresStore()
    kept, _ = helper.enqueue(pg_partitioned_url, ("keep", None), ("drop", None))
    async with PostgresStore(pg_partitioned_url) as store:
        assert await store.purge(MessageFilter(topics=("drop",))) == 1
    assert [row["id"] for row in helper.rows(pg_partitioned_url)] == [kept.id]
