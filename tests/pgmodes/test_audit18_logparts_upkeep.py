"""Log mode partition upkeep with rows in the default partition, beside live writers.

`ensure_partitions` ran `CREATE TABLE ... PARTITION OF` for each missing day: ACCESS
EXCLUSIVE on the log, a scan of the whole default partition under it (which fills when the
upkeep did not run for more than days_ahead days), and no lock_timeout, so it queued behind
any long transaction writing the log and every writer queued behind it. Now the days ahead
are made standalone and attached through a validated CHECK on the default partition (no
writer waits), and every DDL step gives up after PARTITION_LOCK_TIMEOUT.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import threading
import time
from collections.abc import Iterator

import psycopg
import pytest

from outboxer.enqueue import Outbox
from outboxer.stores import pglog
from outboxer.stores.pglog import PgLog

STRANDED_ROWS = 200_000


def _today(url: str) -> dt.date:
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT CAST(statement_timestamp() AT TIME ZONE 'UTC' AS date)")
        day = row.fetchone()
    assert day is not None
    return day[0]  # type: ignore[no-any-return]


def _drop_partitions(url: str, days: list[dt.date]) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        for day in days:
            conn.execute(f"DROP TABLE IF EXISTS outboxer.outbox_log_p{day:%Y%m%d}")


def _strand(url: str, day: dt.date, rows: int) -> None:
    """``rows`` rows dated ``day`` (which has no partition): into the default partition, as
    a writer's rows while the upkeep did not run (created_at is its transaction's start)."""
    with psycopg.connect(url) as conn:
        conn.execute(
            "INSERT INTO outboxer.outbox_log "
            "(order_xid, id, topic, payload, content_type, created_at) "
            "SELECT pg_current_xact_id(), gen_random_uuid(), 'orders', "
            "convert_to(repeat('x', 200), 'UTF8'), 'application/json', %s "
            "FROM generate_series(1, %s)",
            (dt.datetime.combine(day, dt.time(12), tzinfo=dt.UTC), rows),
        )
    with psycopg.connect(url) as conn:
        found = conn.execute("SELECT count(*) FROM outboxer.outbox_log_default").fetchone()
    assert found is not None and found[0] >= rows


def _partitions(url: str) -> set[str]:
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT c.relname FROM pg_inherits AS i JOIN pg_class AS c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = 'outboxer.outbox_log'::regclass"
        ).fetchall()
    return {row[0] for row in rows}


def _helpers(url: str) -> list[str]:
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT conname FROM pg_constraint "
            "WHERE conrelid = 'outboxer.outbox_log_default'::regclass"
        ).fetchall()
    return [row[0] for row in rows]


def _definition(url: str, table: str) -> list[tuple[object, ...]]:
    """What makes a partition: its columns (type, NOT NULL, default, identity, storage) and
    indexes (named after the table), compared across two partitions."""
    with psycopg.connect(url) as conn:
        columns = conn.execute(
            "SELECT a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull, "
            "pg_get_expr(d.adbin, d.adrelid), a.attidentity, a.attstorage "
            "FROM pg_attribute AS a LEFT JOIN pg_attrdef AS d "
            "ON d.adrelid = a.attrelid AND d.adnum = a.attnum "
            "WHERE a.attrelid = CAST(%s AS regclass) AND a.attnum > 0 AND NOT a.attisdropped "
            "ORDER BY a.attnum",
            (f"outboxer.{table}",),
        ).fetchall()
        indexes = conn.execute(
            "SELECT replace(pg_get_indexdef(indexrelid), %s, 'T') FROM pg_index "
            "WHERE indrelid = CAST(%s AS regclass) ORDER BY 1",
            (table, f"outboxer.{table}"),
        ).fetchall()
    return [*columns, *indexes]


class Writer:
    """Enqueues and commits one message after another on a thread of its own, timing each
    commit: what an application's writer waits while the upkeep runs."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.durations: list[float] = []
        self.started = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.error: BaseException | None = None

    def _run(self) -> None:
        outbox = Outbox(mode="log")
        try:
            with psycopg.connect(self.url) as conn:
                while not self._stop.is_set():
                    began = time.monotonic()
                    outbox.enqueue(conn, "orders", {"n": len(self.durations)})
                    conn.commit()
                    self.durations.append(time.monotonic() - began)
                    self.started.set()
        except BaseException as exc:  # the test reports it
            self.error = exc
            self.started.set()

    def __enter__(self) -> Writer:
        self._thread.start()
        assert self.started.wait(10), "the writer never committed"
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def commits_since(self, index: int) -> list[float]:
        return self.durations[index:]


@contextlib.contextmanager
def long_transaction(url: str) -> Iterator[psycopg.Connection]:
    """An application's transaction that wrote the log and stays open (committed at the end,
    or earlier by the test): ROW EXCLUSIVE on the log and on the partition of its row."""
    conn = psycopg.connect(url)
    try:
        Outbox(mode="log").enqueue(conn, "orders", {"long": True})
        yield conn
        conn.commit()
    finally:
        conn.close()


@pytest.fixture
async def url(pg_url: str) -> str:
    async with PgLog(pg_url) as log:
        await log.apply_schema()
    return pg_url


async def test_days_ahead_are_attached_beside_a_long_writer_and_a_full_default_partition(
    url: str,
) -> None:
    """The default partition holds 200,000 rows of a day without a partition and the
    partitions end tomorrow (the upkeep stopped). While a long transaction that wrote the
    log stays open and another writer commits in a loop, ensure_partitions makes the six
    days ahead at once and the writer never waits: before, the first CREATE ... PARTITION
    OF queued behind the long transaction (no lock_timeout) with ACCESS EXCLUSIVE on the
    log, every writer queued behind it, and each creation then scanned the default
    partition with the writers held back."""
    today = _today(url)
    ahead = [today + dt.timedelta(days=n) for n in range(2, 8)]
    _drop_partitions(url, ahead)
    _strand(url, today - dt.timedelta(days=10), STRANDED_ROWS)
    with long_transaction(url) as long, Writer(url) as writer:
        async with PgLog(url) as log:
            first = len(writer.durations)
            try:
                created = await asyncio.wait_for(log.ensure_partitions(7), 5.0)
            except TimeoutError:
                long.commit()  # unblock the old code's CREATE, and the writer behind it
                raise AssertionError(
                    "ensure_partitions waited for the long transaction writing the log"
                ) from None
            assert long.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
            commits = writer.commits_since(first)
    assert writer.error is None
    assert sorted(created) == [f"outbox_log_p{day:%Y%m%d}" for day in ahead]
    assert {f"outbox_log_p{day:%Y%m%d}" for day in ahead} <= _partitions(url)
    assert commits, "the writer committed nothing while the partitions were made"
    assert max(commits) < pglog.PARTITION_LOCK_TIMEOUT, (
        f"a writer's commit took {max(commits):.3f}s while the upkeep ran"
    )
    assert _helpers(url) == [], "the helper constraint was left on the default partition"
    # Made standalone and attached, as CREATE TABLE ... PARTITION OF makes one (no identity
    # of their own, the log's defaults and indexes).
    made = f"outbox_log_p{ahead[0]:%Y%m%d}"
    reference = f"outbox_log_p{today + dt.timedelta(days=1):%Y%m%d}"
    assert [
        tuple(str(v).replace(made, reference) for v in row) for row in _definition(url, made)
    ] == [tuple(str(v) for v in row) for row in _definition(url, reference)]


async def test_a_long_transaction_on_the_default_partition_makes_the_upkeep_give_up_quickly(
    url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The relay was down for over a week: no partition from today on, today's rows go to
    the default partition, where a long transaction's row waits uncommitted. The upkeep
    gives up within PARTITION_LOCK_TIMEOUT (the writers of the default partition wait no
    longer behind it), logs the default partition's rows with their count, and makes the
    days ahead once the transaction has ended. Before, it waited for the transaction for as
    long as it stayed open, with every writer behind it."""
    monkeypatch.setattr(pglog, "PARTITION_LOCK_TIMEOUT", 0.5, raising=False)
    today = _today(url)
    past = today - dt.timedelta(days=10)
    days = [today + dt.timedelta(days=n) for n in range(8)]
    _drop_partitions(url, days)
    _strand(url, past, 1000)
    with psycopg.connect(url) as conn:  # today's first rows: in the default partition
        Outbox(mode="log").enqueue(conn, "orders", {"n": 0})
    caplog.set_level(logging.WARNING, logger="outboxer.pglog")
    with long_transaction(url) as long, Writer(url) as writer:
        async with PgLog(url) as log:
            first = len(writer.durations)
            began = time.monotonic()
            try:
                gave_up = await asyncio.wait_for(log.ensure_partitions(7), 4.0)
            except TimeoutError:
                long.commit()
                raise AssertionError(
                    "ensure_partitions waited for the long transaction writing the log"
                ) from None
            took = time.monotonic() - began
            commits = writer.commits_since(first)
            assert gave_up == []
            assert log.upkeep_busy
            assert took < 0.5 + 1.5, f"the upkeep gave up after {took:.2f}s"
            assert commits and max(commits) < 0.5 + 1.0, (
                f"a writer of the default partition waited {max(commits):.2f}s"
            )
            long.commit()
            created = await log.ensure_partitions(7)
            assert not log.upkeep_busy
    assert writer.error is None
    assert sorted(created) == [f"outbox_log_p{day:%Y%m%d}" for day in days[1:]]
    assert f"outbox_log_p{today:%Y%m%d}" not in _partitions(url)
    assert _helpers(url) == []
    warnings = "\n".join(r.getMessage() for r in caplog.records)
    assert "gave up until its next call" in warnings
    # The rows already in the default partition: counted by day, and today's partition
    # named as one that cannot be made while they are there.
    assert f"{past}: 1000" in warnings
    assert f"outbox_log_p{today:%Y%m%d} cannot be made" in warnings


async def test_a_helper_constraint_left_by_an_upkeep_cut_short_is_dropped(url: str) -> None:
    """An upkeep killed between adding its CHECK to the default partition and attaching the
    days it excludes left it there: once those days began without partitions, their rows
    (routed to the default partition) would break it and every writer's transaction fail.
    The next upkeep drops it first."""
    today = _today(url)
    ahead = [today + dt.timedelta(days=n) for n in range(2, 8)]
    _drop_partitions(url, ahead)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            f"ALTER TABLE outboxer.outbox_log_default ADD CONSTRAINT outboxer_partition_upkeep "
            f"CHECK (created_at < '{ahead[0]} 00:00+00' OR created_at >= '{ahead[-1]} 00:00+00') "
            "NOT VALID"
        )
    async with PgLog(url) as log:
        created = await log.ensure_partitions(7)
    assert sorted(created) == [f"outbox_log_p{day:%Y%m%d}" for day in ahead]
    assert _helpers(url) == []
