"""The partitioned outbox's upkeep: partitions made ahead, rows moved out of the default
partition, partitions past retention dropped whole.

The partitioned layout (``outboxer schema apply --partitioned``, the ``partitioned``
migrations) range-partitions the outbox table by ``created_at``, with a default partition
that takes the rows no partition covers, so a writer never fails for want of one. A relay
runs this with its cleanup (every ``cleanup_interval``), and so does ``outboxer cleanup``:

* **ahead**: partitions ``partitions_ahead`` widths past now, each as wide as the newest
  partition (``partition_interval`` for the first ones). Rows that arrived in the default
  partition meanwhile (the upkeep stopped for longer than that) move into the partitions
  made for their time, in the transaction that attaches them, a gap retention left
  between two partitions included (a partition made for the slots holding such rows);
* **retention**: a partition whose upper bound is older than the retention is dropped once
  it holds no unfinished row and no finished row younger than its status's retention,
  checked under the lock the DROP takes (``partitions.sql``: lock_table has the invariant).
  A partition kept by one unfinished row waits for it; no row is ever deleted one by one.

Every change runs in a READ COMMITTED transaction of its own (whatever the database's
default: its checks read the rows as its locks find them) with a short lock_timeout: DDL
waiting for a lock holds every later statement on the table (writers too) behind it, so
it gives up and the next round tries again. Once one change has given up, the round makes
no other: the transaction it waited for is likely still open, and each further change would
hold the relay's claims and settles back for another lock_timeout.
"""

from __future__ import annotations

import datetime as dt
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from outboxer.redact import get_logger
from outboxer.stores.sqlfiles import queries, quote_ident, render, to_numbered

logger = get_logger("outboxer.partitions")

#: The name of the layout: its migrations are in ``sql/postgres/partitioned/``.
PARTITIONED = "partitioned"
DAY = 86400.0
EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
#: timestamptz's resolution: the last instant before a range's upper bound is upper - _TICK.
_TICK = dt.timedelta(microseconds=1)
#: How long an upkeep statement waits for a lock before it leaves the change to the next
#: round: what it can add to a writer's statement that queues behind it.
LOCK_TIMEOUT = "1s"
#: The most partitions one round makes: a default partition holding rows of times far
#: apart (a clock set wrong) must not make thousands of partitions at once.
MAX_CREATED_PER_ROUND = 100
#: A range starting sooner than this after now may receive rows before its partition is
#: attached (the attach may wait for locks): it is attached with the writers held back.
SOON = dt.timedelta(minutes=5)
#: The isolation of every upkeep transaction, whatever the database's default
#: (default_transaction_isolation): each statement must read the rows as they are once the
#: locks taken before it were granted. At REPEATABLE READ or SERIALIZABLE the snapshot is
#: taken by the transaction's first query, before those locks: the drop's check missed a
#: requeue that committed while it waited for the table's lock, and dropped a PENDING row.
ISOLATION = "read_committed"
#: SQLSTATEs: lock_timeout ran out; ATTACH found rows for the range in the default
#: partition; a partition listed a moment ago is gone.
_LOCK_NOT_AVAILABLE = "55P03"
#: PostgreSQL broke a lock cycle by failing the upkeep's transaction: like a lock not
#: granted in time, the change waits for the next round (each change's transaction is
#: rolled back whole). The upkeep's own lock order has no cycle (partitions.sql:
#: lock_writers); this covers another session's order (an application's transaction that
#: reads the table before writing it, or locks a partition by its name).
_DEADLOCK_DETECTED = "40P01"
_YIELDS = (_LOCK_NOT_AVAILABLE, _DEADLOCK_DETECTED)
_CHECK_VIOLATION = "23514"
_UNDEFINED_TABLE = "42P01"


@dataclass(frozen=True)
class PartitionPolicy:
    """What the upkeep keeps: partitions ``ahead`` widths past now; partitions whose rows
    are all past their retention dropped (None: none dropped). ``interval`` is the width of
    the first partitions; later ones take the width of the newest partition."""

    ahead: int = 3
    interval: float = DAY
    published_retention: float | None = None
    abandoned_retention: float | None = None


@dataclass(frozen=True)
class Partition:
    name: str
    #: The range [lower, upper); both None for the default partition.
    lower: dt.datetime | None
    upper: dt.datetime | None
    #: PostgreSQL's estimate (pg_class.reltuples); -1 before the first ANALYZE.
    estimated_rows: int = -1


@dataclass
class PartitionReport:
    """What one round of upkeep did."""

    created: list[str] = field(default_factory=list)
    dropped: list[Partition] = field(default_factory=list)
    #: Past retention, but holding an unfinished row or one younger than its retention.
    kept: list[str] = field(default_factory=list)
    #: Left for the next round: a lock was not granted within LOCK_TIMEOUT (the first
    #: one), and those after it, not tried once the table was found busy.
    busy: list[str] = field(default_factory=list)
    #: Rows moved out of the default partition.
    moved: int = 0

    @property
    def dropped_rows(self) -> int:
        """The rows of the dropped partitions, as PostgreSQL's statistics estimated them."""
        return sum(max(0, partition.estimated_rows) for partition in self.dropped)


def partition_name(table: str, lower: dt.datetime) -> str:
    """``<table>_p20251123`` for a partition starting at midnight UTC, else
    ``_p20251123_1300`` (or ``_p20251123_130005`` off the minute)."""
    utc = lower.astimezone(dt.UTC)
    if utc.time() == dt.time(0):
        stamp = f"{utc:%Y%m%d}"
    elif utc.second == 0 and utc.microsecond == 0:
        stamp = f"{utc:%Y%m%d_%H%M}"
    else:
        stamp = f"{utc:%Y%m%d_%H%M%S}"
    return f"{table}_p{stamp}"


def align(moment: dt.datetime, width: float) -> dt.datetime:
    """The start of the ``width``-second slot (counted from the Unix epoch) holding ``moment``."""
    seconds = (moment - EPOCH).total_seconds()
    return EPOCH + dt.timedelta(seconds=math.floor(seconds / width) * width)


def plan_ranges(
    existing: list[tuple[dt.datetime, dt.datetime]],
    width: float,
    now: dt.datetime,
    ahead: int,
    default_span: tuple[dt.datetime, dt.datetime] | None,
    default_slots: Sequence[dt.datetime] = (),
) -> list[tuple[dt.datetime, dt.datetime]]:
    """The ranges to create, nearest first, at most MAX_CREATED_PER_ROUND: partitions must
    reach past ``now`` plus ``ahead`` widths, and cover the times of the default
    partition's rows (``default_span``: the oldest and the newest). ``existing``: the
    ranges there are, by lower bound. New ranges continue them, forward from the newest
    and backward from the oldest, so a changed width or a hand-made partition leaves no
    gap; with none yet, they start at the slot (counted from the Unix epoch) holding the
    earliest of now and the default partition's oldest row.

    Retention leaves gaps between the ranges: it drops a partition while an older one is
    kept by an unfinished row. A row can still arrive in a gap (a writer whose transaction
    began before the drop, created_at being its start): ``default_slots``, the starts of
    the ``width``-wide slots (from the Unix epoch) holding the default partition's rows,
    say where. The gap gets ranges for those slots only, stepping from the gap's start and
    ending at the next partition; an empty range made there would be past retention, dropped
    and made again every round."""
    step = dt.timedelta(seconds=width)
    if existing:
        upper = existing[-1][1]
    else:
        upper = align(min(now, default_span[0]) if default_span else now, width)
    target = now + step * ahead
    if default_span is not None:
        target = max(target, default_span[1])
    ranges: list[tuple[dt.datetime, dt.datetime]] = []
    while upper <= target and len(ranges) < MAX_CREATED_PER_ROUND:
        ranges.append((upper, upper + step))
        upper += step
    for (_, gap_start), (gap_end, _) in itertools.pairwise(existing):
        if gap_start >= gap_end:
            continue
        steps: set[int] = set()
        for slot in default_slots:
            first, last = max(slot, gap_start), min(slot + step, gap_end)
            if first < last:
                # Every step of the gap that the slot [first, last) overlaps.
                steps.update(
                    range((first - gap_start) // step, (last - gap_start - _TICK) // step + 1)
                )
        for index in sorted(steps):
            if len(ranges) >= MAX_CREATED_PER_ROUND:
                break
            lower = gap_start + step * index
            ranges.append((lower, min(lower + step, gap_end)))
    if existing and default_span is not None:
        lower = existing[0][0]
        while lower > default_span[0] and len(ranges) < MAX_CREATED_PER_ROUND:
            ranges.append((lower - step, lower))
            lower -= step
    return ranges


def _literal(moment: dt.datetime) -> str:
    """A timestamptz literal for DDL (which takes no parameters); ours, never user text."""
    return "'" + moment.astimezone(dt.UTC).isoformat() + "'"


def _sqlstate(exc: BaseException) -> str | None:
    return getattr(exc, "sqlstate", None)


class Partitions:
    """The partitions of one outbox table, kept on an asyncpg connection."""

    def __init__(self, schema: str, table: str, lock_key: int) -> None:
        self.schema = schema
        self.table = table
        self.lock_key = lock_key
        self.names = {
            "outbox": f"{quote_ident(schema)}.{quote_ident(table)}",
            "default_partition": self.qualified(f"{table}_default"),
        }

    def qualified(self, name: str) -> str:
        return f"{quote_ident(self.schema)}.{quote_ident(name)}"

    def _sql(self, name: str, **tokens: str) -> str:
        return render(queries("postgres", "partitions.sql")[name], {**self.names, **tokens})

    async def _fetch(self, conn: Any, name: str, params: dict[str, Any]) -> list[Any]:
        sql, names = to_numbered(self._sql(name))
        return list(await conn.fetch(sql, *(params[n] for n in names)))

    async def _begin(self, conn: Any) -> None:
        """The start of each change's transaction: a bounded wait for locks, one upkeep at a time."""
        await conn.execute(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'")
        sql, _ = to_numbered(self._sql("maintenance_lock"))
        await conn.execute(sql, self.lock_key)

    # ----- reading ----------------------------------------------------------------------------

    async def layout(self, conn: Any) -> str | None:
        """'p' for the partitioned layout, 'r' for the default table, None for no table."""
        rows = await self._fetch(conn, "layout", {"outbox": self.names["outbox"]})
        return str(rows[0]["kind"]) if rows else None

    async def list(self, conn: Any) -> list[Partition]:
        """Every partition, the default one first, then by lower bound."""
        return [
            Partition(row["name"], row["lower"], row["upper"], int(row["estimated_rows"]))
            for row in await self._fetch(conn, "partitions", {"outbox": self.names["outbox"]})
        ]

    async def now(self, conn: Any) -> dt.datetime:
        """The database's clock: it gives created_at its values."""
        moment: dt.datetime = await conn.fetchval("SELECT statement_timestamp()")
        return moment

    # ----- ahead ------------------------------------------------------------------------------

    async def ensure(
        self, conn: Any, policy: PartitionPolicy, report: PartitionReport, now: dt.datetime
    ) -> None:
        """Create the partitions ``policy.ahead`` widths past ``now``, and those the rows of
        the default partition belong in (moving them there)."""
        partitions = [p for p in await self.list(conn) if p.lower is not None]
        ranged = [(p.lower, p.upper) for p in partitions if p.lower and p.upper]
        width = (ranged[-1][1] - ranged[-1][0]).total_seconds() if ranged else policy.interval
        span = await conn.fetchrow(
            f"SELECT min(created_at) AS oldest, max(created_at) AS newest "
            f"FROM {self.names['default_partition']}"
        )
        default_span = (span["oldest"], span["newest"]) if span["oldest"] is not None else None
        slots = (
            [row["lower"] for row in await self._fetch(conn, "default_rows", {"width": width})]
            if default_span is not None
            else []
        )
        for lower, upper in plan_ranges(ranged, width, now, policy.ahead, default_span, slots):
            if report.busy:
                # Another wait for the lock would stall the relay's claims once more.
                report.busy.append(partition_name(self.table, lower))
                continue
            soon = lower <= now + SOON
            await self._create(conn, lower, upper, report, soon=soon, move=default_span is not None)
        if default_span is not None:
            left = await conn.fetchval(f"SELECT count(*) FROM {self.names['default_partition']}")
            if left:
                logger.warning(
                    "%d row(s) of %s.%s stay in its default partition: no partition could be "
                    "made for their time this round (created_at from %s to %s)",
                    left,
                    self.schema,
                    self.table,
                    default_span[0].isoformat(),
                    default_span[1].isoformat(),
                )

    async def _create(
        self,
        conn: Any,
        lower: dt.datetime,
        upper: dt.datetime,
        report: PartitionReport,
        *,
        soon: bool,
        move: bool,
    ) -> None:
        name = partition_name(self.table, lower)
        tokens = {
            "partition": self.qualified(name),
            "lower": _literal(lower),
            "upper": _literal(upper),
        }
        try:
            async with conn.transaction(isolation=ISOLATION):
                await self._begin(conn)
                # Under the upkeep lock: another relay may have made it since we looked.
                if any(
                    p.lower is not None
                    and p.upper is not None
                    and p.lower < upper
                    and lower < p.upper
                    for p in await self.list(conn)
                ):
                    return
                if soon or move:
                    await conn.execute(self._sql("lock_writers"))
                await conn.execute(self._sql("create_partition", **tokens))
                if move:
                    await conn.execute(self._sql("lock_default"))
                    columns = ", ".join(
                        quote_ident(row["name"])
                        for row in await self._fetch(
                            conn, "columns", {"outbox": self.names["outbox"]}
                        )
                    )
                    await conn.execute(self._sql("move_rows", columns=columns, **tokens))
                    deleted = await conn.execute(self._sql("delete_moved", **tokens))
                    moved = int(deleted.rsplit(" ", 1)[-1])
                    report.moved += moved
                    if moved:
                        logger.info(
                            "moved %d row(s) of %s.%s from its default partition to %s",
                            moved,
                            self.schema,
                            self.table,
                            name,
                        )
                await conn.execute(self._sql("attach_partition", **tokens))
        except Exception as exc:
            if _sqlstate(exc) in _YIELDS:
                report.busy.append(name)
                return
            if _sqlstate(exc) == _CHECK_VIOLATION and not move:
                # A row for this range reached the default partition since we looked.
                await self._create(conn, lower, upper, report, soon=soon, move=True)
                return
            raise
        report.created.append(name)
        logger.info("created partition %s.%s", self.schema, name)

    # ----- retention --------------------------------------------------------------------------

    async def drop_expired(
        self, conn: Any, policy: PartitionPolicy, report: PartitionReport, now: dt.datetime
    ) -> None:
        """Drop the partitions whose every row is past its status's retention, oldest first."""
        if policy.published_retention is None or policy.abandoned_retention is None:
            return
        published_before = now - dt.timedelta(seconds=policy.published_retention)
        abandoned_before = now - dt.timedelta(seconds=policy.abandoned_retention)
        # A candidate once past the shorter retention; the check reads each row's own.
        before = max(published_before, abandoned_before)
        params = {"published_before": published_before, "abandoned_before": abandoned_before}
        for partition in await self.list(conn):
            if partition.upper is None or partition.upper > before:
                continue
            if report.busy:
                # Another wait for the lock would stall the relay's claims once more.
                report.busy.append(partition.name)
                continue
            # First without a lock: most partitions kept stay kept, and need not stop the
            # table's writers for a moment to learn it.
            try:
                expired = await self._expired(conn, partition, params)
            except Exception as exc:
                if _sqlstate(exc) != _UNDEFINED_TABLE:
                    raise
                continue  # another relay's upkeep dropped it since we listed the partitions
            if not expired:
                report.kept.append(partition.name)
                continue
            try:
                async with conn.transaction(isolation=ISOLATION):
                    await self._begin(conn)
                    await conn.execute(self._sql("lock_table"))
                    if partition.name not in {p.name for p in await self.list(conn)}:
                        continue  # dropped meanwhile, by hand
                    if not await self._expired(conn, partition, params):
                        report.kept.append(partition.name)
                        continue
                    await conn.execute(
                        self._sql("drop_partition", partition=self.qualified(partition.name))
                    )
            except Exception as exc:
                if _sqlstate(exc) not in _YIELDS:
                    raise
                report.busy.append(partition.name)
                continue
            report.dropped.append(partition)
            logger.info(
                "dropped partition %s.%s (%s rows)",
                self.schema,
                partition.name,
                "about " + str(partition.estimated_rows)
                if partition.estimated_rows >= 0
                else "an unknown number of",
            )

    async def _expired(self, conn: Any, partition: Partition, params: dict[str, Any]) -> bool:
        sql, names = to_numbered(
            self._sql("drop_candidate", partition=self.qualified(partition.name))
        )
        row = await conn.fetchrow(sql, *(params[n] for n in names))
        return bool(row["finished"] and row["expired"])

    # ----- both -------------------------------------------------------------------------------

    async def maintain(
        self, conn: Any, policy: PartitionPolicy, now: dt.datetime | None = None
    ) -> PartitionReport:
        report = PartitionReport()
        moment = now or await self.now(conn)
        await self.ensure(conn, policy, report, moment)
        await self.drop_expired(conn, policy, report, moment)
        if report.kept:
            logger.info(
                "partition(s) %s of %s.%s are past retention but kept: each holds an "
                "unfinished message, or one younger than its status's retention",
                ", ".join(report.kept),
                self.schema,
                self.table,
            )
        if report.busy:
            logger.warning(
                "partition upkeep of %s.%s gave up until its next round: a lock on the table "
                "was not granted within %s (a long-running transaction holds it), so "
                "partition(s) %s wait",
                self.schema,
                self.table,
                LOCK_TIMEOUT,
                ", ".join(report.busy),
            )
        return report
