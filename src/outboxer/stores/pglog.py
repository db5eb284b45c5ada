"""PostgreSQL log mode: an append-only outbox read by offset.

Writers append with ``Outbox(mode="log").enqueue(conn, ...)``: one row per message,
never updated. Each reader (one per destination) stores its own offset, the last
``(order_xid, position)`` its broker confirmed, and reads the rows after it that no
running transaction can still precede (migrations/0001_log.sql has the invariant).
Retention drops whole daily partitions: no DELETE, no dead rows, no vacuum of the log.
"""

from __future__ import annotations

import datetime as dt
import math
import re
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from outboxer.errors import ConfigError, StoreError
from outboxer.message import Message
from outboxer.redact import get_logger
from outboxer.stores.base import UNREADABLE_ROW, parse_headers
from outboxer.stores.pgmodes import ModeSchema, ReaderLock
from outboxer.stores.pgpartitions import ISOLATION
from outboxer.stores.pgstream import Backlog, DeadLetter, StreamBook, StreamFailure
from outboxer.stores.sqlfiles import quote_ident, render, to_numbered
from outboxer.streamrelay import Entry

logger = get_logger("outboxer.pglog")

#: Seconds drop_partitions waits for a partition's locks (behind its open writers, while
#: new writers of the log wait behind it) before it keeps the partition for next time.
DROP_LOCK_TIMEOUT = 5.0

#: Seconds each step of ensure_partitions waits for its locks before it gives the round up
#: for the next call: DDL waiting for a lock on the log (behind a long transaction) holds
#: every later statement on the log, writers' too, behind it meanwhile. Above PostgreSQL's
#: deadlock_timeout (1 s by default), after which a waiting step has an autovacuum of the
#: default partition that is in its way cancelled.
PARTITION_LOCK_TIMEOUT = 2.0
#: Seconds ensure_partitions may scan the default partition (counting its rows by day;
#: validating its helper constraint). No writer or reader waits for either, but the relay
#: reads nothing meanwhile (the upkeep runs between its reads). Cut, the step waits for
#: the next call. SCAN_GRACE: the client's own bound beyond the server's statement_timeout.
SCAN_TIMEOUT = 600.0
SCAN_GRACE = 30.0
#: A day starting at least this long after the database's clock gets its partition through
#: a CHECK on the default partition (queries.sql: add_helper), which no writer waits for.
#: From its addition the constraint refuses the default partition's rows of those days,
#: until the partitions are attached or it is dropped: far longer than SCAN_TIMEOUT, so
#: that no writer writes a row of them meanwhile, and room for the next upkeep (the relay's
#: retry after a step gave up: UPKEEP_RETRY_SECONDS) to drop one an upkeep cut short left.
ATTACH_AHEAD = dt.timedelta(hours=2)
#: A day starting sooner (today's, when the upkeep did not run for days_ahead days) is
#: created with the log's writers held back while the default partition is scanned: only
#: if it holds at most this many rows (milliseconds of scan).
LOCKED_SCAN_ROWS = 10_000
#: The helper constraint's name on the default partition (one upkeep at a time per log).
HELPER = "outboxer_partition_upkeep"
#: Seconds the default partition's rows counted by day are reused before a new count (a
#: full scan): they only grow, by rows of the days that have no partition.
STRANDED_RECOUNT_SECONDS = 6 * 3600.0
#: Seconds after which an idle log reader runs the partition upkeep again when the last one
#: gave up for locks (instead of maintenance_seconds).
UPKEEP_RETRY_SECONDS = 300.0

_PARTITION_DAY = re.compile(r"_p(\d{8})$")
#: SQLSTATEs: lock_timeout ran out, or PostgreSQL broke a lock cycle by failing the step
#: (rolled back whole, as one given up); a row of the range in the default partition; a
#: relation that another session created first (duplicate_table, or unique_violation in
#: the catalogs when both passed the name check); statement_timeout.
_YIELDS = ("55P03", "40P01")
_CHECK_VIOLATION = "23514"
_EXISTS = ("42P07", "23505")
_QUERY_CANCELED = "57014"


class _TooManyRows(Exception):
    """The default partition holds more than LOCKED_SCAN_ROWS rows to scan under its lock."""


class _GaveUp(Exception):
    """A step of the partition upkeep was not granted its locks in time."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what


@dataclass(frozen=True, order=True, slots=True)
class LogOffset:
    """A reader's place in the log: reading resumes after this row."""

    order_xid: int
    position: int

    def params(self) -> dict[str, Any]:
        return {"order_xid": self.order_xid, "position": self.position}


BEGINNING = LogOffset(0, 0)


class PgLog(ModeSchema):
    """The log of one outbox (``<schema>.<table>_log``), its readers' offsets and partitions."""

    folder = "pglog"
    also = ("pgstream",)

    def __init__(self, url: str, *, schema: str = "outboxer", table: str = "outbox") -> None:
        super().__init__(url, schema=schema, table=table)
        #: Whether the last ensure_partitions gave up for locks, or left its helper
        #: constraint on the default partition: the idle reader retries sooner.
        self.upkeep_busy = False
        #: The default partition's rows by day, as last counted (monotonic time; None: to
        #: count again).
        self._stranded_days: dict[dt.date, int] = {}
        self._stranded_at: float | None = None

    async def apply_schema(self, days_ahead: int = 7) -> list[str]:
        applied = await super().apply_schema()
        await self.ensure_partitions(days_ahead)
        return applied

    async def _fetch(self, name: str, params: dict[str, Any]) -> list[Any]:
        sql, names = to_numbered(self.sql(name))
        return list(await self.conn.fetch(sql, *(params[n] for n in names)))

    async def _execute(self, name: str, params: dict[str, Any]) -> str:
        sql, names = to_numbered(self.sql(name))
        return str(await self.conn.execute(sql, *(params[n] for n in names)))

    # ----- partitions ----------------------------------------------------------------------

    def partition_name(self, day: dt.date) -> str:
        return f"{self.table}_log_p{day:%Y%m%d}"

    def _ddl(self, name: str, **tokens: str) -> str:
        return render(self.sql(name), {"helper": quote_ident(HELPER), **tokens})

    def _day_tokens(self, lower: dt.date, upper: dt.date, name: str = "") -> dict[str, str]:
        tokens = {"lower": _midnight_literal(lower), "upper": _midnight_literal(upper)}
        if name:
            tokens["partition"] = f"{quote_ident(self.schema)}.{quote_ident(name)}"
        return tokens

    def _transaction(self) -> Any:
        # READ COMMITTED whatever the database's default: a step's checks must read the
        # catalogs and rows as its locks find them, not as a snapshot taken before the wait.
        return self.conn.transaction(isolation=ISOLATION)

    async def _limit_waits(self, scan: bool = False) -> None:
        """Bound the current transaction's lock waits (and, for a scan, its statements)."""
        await self.conn.execute(
            f"SET LOCAL lock_timeout = '{int(PARTITION_LOCK_TIMEOUT * 1000)}ms'"
            + (f"; SET LOCAL statement_timeout = '{int(SCAN_TIMEOUT * 1000)}ms'" if scan else "")
        )

    async def ensure_partitions(
        self, days_ahead: int = 7, *, today: dt.date | None = None
    ) -> list[str]:
        """Create the daily partitions (UTC days) from today to ``days_ahead`` days on;
        return those created now.

        No writer of the log ever waits for a scan of the default partition, nor for a lock
        this upkeep waits for longer than PARTITION_LOCK_TIMEOUT: a step not granted its
        locks by then gives the round up (``upkeep_busy``), for the next call. Days starting
        ATTACH_AHEAD or more after the database's clock are attached through a CHECK on the
        default partition, validated without blocking anyone (queries.sql: add_helper);
        sooner days (today's, after an upkeep that did not run) are created with writers
        held back, only while the default partition is small. A day whose rows already sit
        in the default partition gets no partition (they cannot be moved without skipping
        a reader: see docs/design/stream-relay.md); they are counted and logged."""
        now: dt.datetime = await self.conn.fetchval("SELECT statement_timestamp()")
        start = today or now.astimezone(dt.UTC).date()
        days = [start + dt.timedelta(days=n) for n in range(days_ahead + 1)]
        self.upkeep_busy = False
        key = {"key": f"outboxer-log-partitions:{self.schema}.{self.table}"}
        if not await self._fetchval("upkeep_lock", key):
            logger.info("partition upkeep of %s skipped: another one runs", self.names["log"])
            return []
        created: list[str] = []
        try:
            await self._ensure(days, now, created)
        except _GaveUp as gave_up:
            self.upkeep_busy = True
            logger.warning(
                "partition upkeep of %s gave up until its next call: a lock on the log or its "
                "default partition was not granted within %gs (a long-running transaction "
                "holds one); %s waits (%s)",
                self.names["log"],
                PARTITION_LOCK_TIMEOUT,
                gave_up.what,
                gave_up.__cause__,
            )
        finally:
            if not self.conn.is_closed():
                await self._fetchval("upkeep_unlock", key)
        return created

    async def _fetchval(self, name: str, params: dict[str, Any]) -> Any:
        sql, names = to_numbered(self.sql(name))
        return await self.conn.fetchval(sql, *(params[n] for n in names))

    async def _ensure(self, days: list[dt.date], now: dt.datetime, created: list[str]) -> None:
        existing = {
            row["name"] for row in await self._fetch("partitions", {"log": self.names["log"]})
        }
        await self._drop_helper_left()
        missing = [day for day in days if self.partition_name(day) not in existing]
        if not missing:
            return
        stranded = await self._stranded(missing)
        free = [day for day in missing if stranded is None or day not in stranded]
        soon = [day for day in free if _midnight(day) < now + ATTACH_AHEAD]
        for day in soon:
            if stranded is None or sum(stranded.values()) > LOCKED_SCAN_ROWS:
                logger.warning(
                    "log partition %s not created: its day begins within %s, so it would be "
                    "made with the log's writers held back while the default partition of %s "
                    "is scanned, which holds too many rows for that (%s; at most %d): the "
                    "day's rows go to the default partition",
                    self.partition_name(day),
                    ATTACH_AHEAD,
                    self.names["log"],
                    "uncounted" if stranded is None else sum(stranded.values()),
                    LOCKED_SCAN_ROWS,
                )
                continue
            await self._create_locked(day, created)
        ahead = [day for day in free if day not in soon]
        for run in _consecutive(ahead):
            await self._attach_ahead(run, created)

    async def _stranded(self, missing: list[dt.date]) -> dict[dt.date, int] | None:
        """The default partition's rows by day (None: not counted within SCAN_TIMEOUT), each
        a row of a day without a partition; logged. Counted again after
        STRANDED_RECOUNT_SECONDS only: a full scan of a default partition that may be large."""
        try:
            async with self._transaction():
                await self._limit_waits()
                held = await self._fetchval("default_holds_rows", {})
        except Exception as exc:  # waits only for DDL on the default partition (by hand)
            if _sqlstate(exc) not in _YIELDS:
                raise
            raise _GaveUp("the default partition's check") from exc
        if not held:
            self._stranded_days, self._stranded_at = {}, None
            return {}
        if (
            self._stranded_at is None
            or time.monotonic() - self._stranded_at >= STRANDED_RECOUNT_SECONDS
        ):
            try:
                async with self._transaction():
                    await self._limit_waits(scan=True)
                    rows = await self.conn.fetch(
                        self.sql("default_days"), timeout=SCAN_TIMEOUT + SCAN_GRACE
                    )
            except Exception as exc:
                if not _scan_cut(exc):
                    if _sqlstate(exc) not in _YIELDS:
                        raise
                    raise _GaveUp("the count of the default partition") from exc
                logger.warning(
                    "the default partition of %s holds rows, too many to count within %gs: "
                    "they are of days without a partition, and retention never drops them",
                    self.names["log"],
                    SCAN_TIMEOUT,
                )
                return None
            self._stranded_days = {row["day"]: int(row["rows"]) for row in rows}
            self._stranded_at = time.monotonic()
        days = self._stranded_days
        blocked = [day for day in missing if day in days]
        logger.warning(
            "%d row(s) of %s sit in its default partition, of day(s) without a partition "
            "(%s): written while no partition covered their day (the partition upkeep did "
            "not run for longer than the days it makes ahead). Readers read them as any "
            "other row, but retention never drops the default partition: they stay until "
            "removed by hand.%s",
            sum(days.values()),
            self.names["log"],
            _days_listed(days),
            f" Partition(s) {', '.join(self.partition_name(d) for d in blocked)} cannot be "
            "made while their rows are there: the rest of those days goes there too."
            if blocked
            else "",
        )
        return days

    async def _drop_helper_left(self) -> None:
        """Drop the helper constraint an upkeep cut short left on the default partition:
        left, it would refuse the default partition's rows of days still without one."""
        params = {"default_partition": self.names["default_partition"], "helper": HELPER}
        if not await self._fetchval("helper_left", params):
            return
        try:
            async with self._transaction():
                await self._limit_waits()
                await self.conn.execute(self._ddl("drop_helper"))
        except Exception as exc:
            if _sqlstate(exc) not in _YIELDS:
                raise
            raise _GaveUp(f"the constraint {HELPER} left on the default partition") from exc
        logger.warning(
            "dropped constraint %s left on the default partition of %s by a partition upkeep "
            "cut short",
            HELPER,
            self.names["log"],
        )

    async def _create_locked(self, day: dt.date, created: list[str]) -> None:
        name = self.partition_name(day)
        tokens = self._day_tokens(day, day + dt.timedelta(days=1), name)
        try:
            async with self._transaction():
                await self._limit_waits()
                await self.conn.execute(self._ddl("lock_log"))
                count = await self.conn.fetchval(
                    to_numbered(self.sql("count_default"))[0], LOCKED_SCAN_ROWS + 1
                )
                if count > LOCKED_SCAN_ROWS:
                    logger.warning(
                        "log partition %s not created: the default partition holds more than "
                        "%d rows to scan with the log's writers held back",
                        name,
                        LOCKED_SCAN_ROWS,
                    )
                    return
                await self.conn.execute(self._ddl("create_partition", **tokens))
        except Exception as exc:
            state = _sqlstate(exc)
            if state in _EXISTS:
                # Another reader's relay (or an older version's upkeep, without the upkeep
                # lock) created it since the listing: it exists, which is all this wants.
                return
            if state == _CHECK_VIOLATION:
                logger.warning(
                    "log partition %s not created: rows of its day reached the default "
                    "partition first; the rest of the day goes there too",
                    name,
                )
                self._stranded_at = None  # counted (and logged) at the next upkeep
                return
            if _sqlstate(exc) not in _YIELDS:
                raise
            raise _GaveUp(f"partition {name}") from exc
        created.append(name)

    async def _attach_ahead(self, days: list[dt.date], created: list[str]) -> None:
        """Attach the partitions of ``days`` (consecutive) without a scan of the default
        partition under a lock anyone waits for long: in one transaction while the default
        partition is small, else through the helper (queries.sql: add_helper)."""
        if await self._attach_ahead_locked(days, created):
            return
        await self._attach_ahead_helped(days, created)

    async def _attach_ahead_locked(self, days: list[dt.date], created: list[str]) -> bool:
        """Attach ``days`` in one transaction, the ATTACH scanning the default partition
        under its lock (queries.sql: lock_default), if it holds at most LOCKED_SCAN_ROWS
        rows; False, with nothing done, if it holds more. Nothing is committed midway: the
        helper's way leaves, lost between its transactions, a CHECK that fails the writers
        of its days once they begin, until an upkeep drops it."""
        names = ", ".join(self.partition_name(day) for day in days)
        try:
            async with self._transaction():
                await self._limit_waits()
                made = await self._create_and_attach(
                    days, before_attach=self._default_small_or_rollback
                )
        except _TooManyRows:
            return False
        except Exception as exc:
            if _sqlstate(exc) == _CHECK_VIOLATION:
                self._ahead_rows_warning(days)
                return True
            if _sqlstate(exc) not in _YIELDS:
                raise
            raise _GaveUp(f"partition(s) {names}") from exc
        created.extend(made)
        return True

    async def _default_small_or_rollback(self) -> None:
        await self.conn.execute(self.sql("lock_default"))
        count = await self.conn.fetchval(
            to_numbered(self.sql("count_default"))[0], LOCKED_SCAN_ROWS + 1
        )
        if count > LOCKED_SCAN_ROWS:
            raise _TooManyRows  # rolls the transaction back: the standalone tables too

    def _ahead_rows_warning(self, days: list[dt.date]) -> None:
        # Rows dated ahead, written by hand: no writer's are (created_at is its
        # transaction's start).
        logger.warning(
            "log partition(s) %s not created: the default partition of %s holds rows dated "
            "from %s to %s",
            ", ".join(self.partition_name(day) for day in days),
            self.names["log"],
            days[0],
            days[-1] + dt.timedelta(days=1),
        )
        self._stranded_at = None

    async def _create_and_attach(
        self, days: list[dt.date], before_attach: Callable[[], Awaitable[None]] | None = None
    ) -> list[str]:
        """In the caller's transaction: make the tables of ``days`` missing from the log
        standalone and attach them; the names attached."""
        await self.conn.execute(self._ddl("hold_attach"))
        existing = {
            row["name"] for row in await self._fetch("partitions", {"log": self.names["log"]})
        }
        made: list[str] = []
        for day in days:
            name = self.partition_name(day)
            if name in existing:
                continue  # another relay's upkeep, or an older version's
            if await self.conn.fetchval(
                "SELECT to_regclass($1) IS NOT NULL",
                f"{quote_ident(self.schema)}.{quote_ident(name)}",
            ):
                logger.warning(
                    "log partition %s not created: a table of that name exists and is no "
                    "partition of %s",
                    name,
                    self.names["log"],
                )
                continue
            tokens = self._day_tokens(day, day + dt.timedelta(days=1), name)
            await self.conn.execute(self._ddl("create_standalone", **tokens))
            made.append(name)
        # Every table made before the first ATTACH locks the default partition: its writers
        # (today's rows, after the upkeep did not run) wait for the ATTACHes only.
        if before_attach is not None:
            await before_attach()
        for day in days:
            name = self.partition_name(day)
            if name in made:
                tokens = self._day_tokens(day, day + dt.timedelta(days=1), name)
                await self.conn.execute(self._ddl("attach_partition", **tokens))
        return made

    async def _attach_ahead_helped(self, days: list[dt.date], created: list[str]) -> None:
        """Attach ``days`` through the helper CHECK (queries.sql: add_helper): the default
        partition is too large to scan under its lock."""
        lower, upper = days[0], days[-1] + dt.timedelta(days=1)
        names = ", ".join(self.partition_name(day) for day in days)
        try:
            async with self._transaction():
                await self._limit_waits()
                await self.conn.execute(self._ddl("add_helper", **self._day_tokens(lower, upper)))
        except Exception as exc:
            if _sqlstate(exc) not in _YIELDS:
                raise
            raise _GaveUp(f"partition(s) {names}") from exc
        attached = False
        try:
            try:
                async with self._transaction():
                    await self._limit_waits(scan=True)
                    await self.conn.execute(
                        self._ddl("validate_helper"), timeout=SCAN_TIMEOUT + SCAN_GRACE
                    )
            except Exception as exc:
                if _sqlstate(exc) == _CHECK_VIOLATION:
                    self._ahead_rows_warning(days)
                    return
                if _scan_cut(exc):
                    logger.warning(
                        "log partition(s) %s not created: the default partition of %s could "
                        "not be scanned within %gs",
                        names,
                        self.names["log"],
                        SCAN_TIMEOUT,
                    )
                    return
                if _sqlstate(exc) not in _YIELDS:
                    raise
                raise _GaveUp(f"partition(s) {names}") from exc
            try:
                async with self._transaction():
                    await self._limit_waits()
                    now_attached = await self._create_and_attach(days)
                    await self.conn.execute(self._ddl("drop_helper"))
            except Exception as exc:
                if _sqlstate(exc) not in _YIELDS:
                    raise
                raise _GaveUp(f"partition(s) {names}") from exc
            created.extend(now_attached)
            attached = True
        finally:
            if not attached:
                await self._drop_helper_after(lower, upper)

    async def _drop_helper_after(self, lower: dt.date, upper: dt.date) -> None:
        """Drop the helper after a step gave up; failing that, say so loudly: left, it
        refuses the default partition's rows of days from ``lower`` to ``upper`` (their
        writers' transactions fail) once they begin, unless an upkeep drops it first (the
        next one does: see _drop_helper_left)."""
        try:
            if not self.conn.is_closed():
                async with self._transaction():
                    await self._limit_waits()
                    await self.conn.execute(self._ddl("drop_helper"))
                return
            failure = "the connection is closed"
        except Exception as exc:  # noqa: BLE001 -- reported; the step's own failure is raised
            failure = f"{type(exc).__name__}: {exc}"
        self.upkeep_busy = True
        logger.error(
            "constraint %s stays on the default partition of %s (%s): it refuses rows dated "
            "from %s to %s there until the next partition upkeep drops it, or it is dropped "
            "by hand (ALTER TABLE %s DROP CONSTRAINT %s)",
            HELPER,
            self.names["log"],
            failure,
            lower,
            upper,
            self.names["default_partition"],
            HELPER,
        )

    async def partitions(self) -> list[tuple[str, dt.date]]:
        """The daily partitions, oldest first (the default partition is not listed)."""
        found = []
        for row in await self._fetch("partitions", {"log": self.names["log"]}):
            match = _PARTITION_DAY.search(row["name"])
            if match:
                found.append((row["name"], dt.datetime.strptime(match.group(1), "%Y%m%d").date()))
        return sorted(found, key=lambda item: item[1])

    async def drop_partitions(self, before: dt.date, *, force: bool = False) -> list[str]:
        """Drop the partitions of days before ``before``: retention without DELETE.

        A partition still holding rows that some reader has not confirmed is kept (and
        logged) unless ``force``: retention must not lose what a destination never got. One
        whose locks are not granted within DROP_LOCK_TIMEOUT seconds (a long transaction
        writing the log) is kept too, for the next call.
        """
        dropped = []
        for name, day in await self.partitions():
            if day < before and await self._drop_partition(name, force=force):
                dropped.append(name)
        return dropped

    async def _drop_partition(self, name: str, *, force: bool) -> bool:
        table = f"{quote_ident(self.schema)}.{quote_ident(name)}"
        try:
            if not force and await self._unread(table):  # no lock taken to keep one
                logger.warning("log partition %s kept: a reader has not read all of it", name)
                return False
            # Checked again under the locks DROP TABLE takes (the parent first, as DROP
            # does), in the drop's transaction: they wait for the partition's open writers,
            # and a row one of them commits meanwhile was invisible to the check above;
            # dropped with the partition, no reader would ever have read it. Writers wait
            # for the transaction, at most lock_timeout for the locks and then briefly.
            async with self.conn.transaction():
                await self.conn.execute(
                    f"SET LOCAL lock_timeout = '{int(DROP_LOCK_TIMEOUT * 1000)}ms'; "
                    f"LOCK TABLE ONLY {self.names['log']} IN ACCESS EXCLUSIVE MODE; "
                    f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE"
                )
                if not force and await self._unread(table):
                    logger.warning("log partition %s kept: a reader has not read all of it", name)
                    return False
                await self.conn.execute(f"DROP TABLE {table}")
        except Exception as exc:
            state = getattr(exc, "sqlstate", None)
            if state == "42P01":  # undefined_table
                # Another reader's relay dropped it since the listing (both apply
                # retention, at their start first). Raised, it stopped this relay.
                return False
            if state != "55P03":  # lock_not_available
                raise
            logger.warning("log partition %s kept: still being written (%s)", name, exc)
            return False
        return True

    async def _unread(self, table: str) -> bool:
        """Whether a partition holds a row that the slowest reader has not confirmed."""
        slowest = await self.slowest_offset()
        if slowest is None:
            return False
        return bool(
            await self.conn.fetchval(
                f"SELECT EXISTS (SELECT 1 FROM {table} "
                "WHERE (order_xid, position) > (CAST($1 AS xid8), $2))",
                slowest.order_xid,
                slowest.position,
            )
        )

    # ----- offsets -------------------------------------------------------------------------

    async def readers(self) -> list[tuple[str, LogOffset, dt.datetime]]:
        """Every reader: its name, offset and when the offset last moved."""
        return [
            (row["reader"], _offset(row), row["updated_at"])
            for row in await self._fetch("readers", {})
        ]

    async def backlog(self, offset: LogOffset, limit: int) -> Backlog:
        """The rows after ``offset`` (at most ``limit`` counted) and the first one's time."""
        rows = await self._fetch("backlog", {**offset.params(), "limit": limit})
        behind = int(rows[0]["behind"])
        return Backlog(behind, behind >= limit, rows[0]["oldest"])

    async def offset(self, reader: str) -> LogOffset | None:
        rows = await self._fetch("get_offset", {"reader": reader})
        return _offset(rows[0]) if rows else None

    async def slowest_offset(self) -> LogOffset | None:
        rows = await self._fetch("slowest_offset", {})
        return _offset(rows[0]) if rows else None

    async def seek(
        self, reader: str, *, offset: LogOffset | None = None, since: dt.datetime | None = None
    ) -> LogOffset:
        """Move ``reader`` (replay or skip): to just after ``offset``, or to just before the
        first row (in reading order) written at or after ``since``; with neither, to the
        beginning. Returns the stored offset."""
        if offset is not None and since is not None:
            raise ConfigError("seek takes an offset or a time, not both")
        target = offset or BEGINNING
        if since is not None:
            if since.tzinfo is None:
                raise ConfigError("seek: the time must carry its time zone")
            rows = await self._fetch("first_since", {"since": since})
            if rows:
                first = _offset(rows[0])
                target = LogOffset(first.order_xid, first.position - 1)
            else:  # nothing written since: the reader goes to the end of the log
                rows = await self.conn.fetch(
                    f"SELECT CAST(order_xid AS text) AS order_xid, position FROM {self.names['log']} "
                    "ORDER BY order_xid DESC, position DESC LIMIT 1"
                )
                target = _offset(rows[0]) if rows else BEGINNING
        # Under the reader lock: a running relay keeps its offset in memory and stores it
        # forward only, so a seek beside it was silently undone (back) or not followed
        # (ahead). The lock refuses it instead: stop the reader's relay first.
        lock = ReaderLock(self.url, reader_lock_key(self, reader), f"log reader {reader!r}")
        if not await lock.acquire():
            raise StoreError(
                f"log reader {reader!r} of {self.schema}.{self.table}_log is being read by a "
                "running relay: stop it before moving its offset"
            )
        try:
            await self._execute("set_offset", {"reader": reader, **target.params()})
        finally:
            await lock.release()
        return target

    def reader(
        self,
        name: str,
        *,
        destination: str | None = None,
        retention_days: int | None = None,
        maintenance_seconds: float = 3600.0,
    ) -> LogReader:
        """A stream source for the relay: reader ``name`` (its messages carry
        ``destination``, the reader's name unless given). While idle, at most every
        ``maintenance_seconds``, it creates the coming days' partitions and, with
        ``retention_days``, drops the partitions of days older than that (see
        drop_partitions: never one a reader has not finished)."""
        if retention_days is not None and retention_days < 0:
            raise ConfigError(f"retention_days must be >= 0; got {retention_days}")
        return LogReader(self, name, destination or name, retention_days, maintenance_seconds)


class LogReader:
    """One reader of the log, holding its reader lock on a connection of its own: two relays
    reading for one destination would publish everything twice, so the second one fails."""

    def __init__(
        self,
        log: PgLog,
        name: str,
        destination: str,
        retention_days: int | None = None,
        maintenance_seconds: float = 3600.0,
    ) -> None:
        if not name:
            raise ConfigError("a log reader needs a name")
        self.log = log
        self.name = f"log reader {name!r} of {log.schema}.{log.table}_log"
        self.reader = name
        self.destination = destination
        self.mode = "log"
        #: The stream's failures and dead letters, named by the reader.
        self.book = StreamBook(log.names, "log", name)
        self._offset = BEGINNING
        self._read_sql = to_numbered(log.sql("read"))
        self._commit_sql = to_numbered(log.sql("commit_offset"))
        self._lock = ReaderLock(log.url, reader_lock_key(log, name), self.name)
        self.retention_days = retention_days
        self.maintenance_seconds = maintenance_seconds
        self._maintained_at = -math.inf

    @property
    def conn(self) -> Any:
        return self.log.conn

    async def attach(self) -> None:
        """Connect for the stream's own tables only (replay, status), without the reader
        lock that a running relay holds."""
        await self.log.connect()
        await self.book.check(self.conn)

    async def connect(self) -> None:
        await self.log.connect()
        await self.book.check(self.log.conn)
        if not await self._lock.acquire():
            await self.close()
            raise StoreError(f"{self.name} is already being read by another relay")
        await self.log._execute("register_reader", {"reader": self.reader})
        self._offset = await self.log.offset(self.reader) or BEGINNING

    async def close(self) -> None:
        await self._lock.release()
        await self.log.close()

    async def read(self, limit: int) -> list[Entry]:
        await self._lock.check()
        sql, names = self._read_sql
        params = {
            "limit": limit,
            "after_xid": self._offset.order_xid,
            "after_position": self._offset.position,
        }
        rows = await self.log.conn.fetch(sql, *(params[n] for n in names))
        return [self._entry(row) for row in rows]

    def _entry(self, row: Any) -> Entry:
        """A log row as an entry; one whose headers are not a JSON object of strings (a row
        written by hand) is poison: dead-lettered at its turn, where failing the read would
        stop the relay at this row after every restart."""
        poison = None
        try:
            headers = parse_headers(row["headers"])
        except UNREADABLE_ROW as exc:
            headers, poison = {}, f"unreadable row: {type(exc).__name__}: {exc}"
        message = Message(
            id=row["id"],
            topic=row["topic"],
            payload=row["payload"],
            key=row["key"],
            headers=headers,
            content_type=row["content_type"],
            destination=self.destination,
            created_at=row["created_at"],
            seq=row["position"],
        )
        return Entry(message, _offset(row), poison)

    async def commit(
        self,
        checkpoint: object,
        letters: Sequence[DeadLetter] = (),
        cleared: Iterable[int] = (),
    ) -> None:
        """Move the offset to ``checkpoint``; with dead letters to write, or failure rows
        to clear (``cleared``: seqs of messages the offset passes), all in one transaction:
        a dead letter exists if and only if the offset went past its message."""
        if not isinstance(checkpoint, LogOffset):
            raise TypeError(f"a log reader commits LogOffsets, not {checkpoint!r}")
        sql, names = self._commit_sql
        params = {"reader": self.reader, **checkpoint.params()}
        conn = self.log.conn
        cleared = list(cleared)
        if letters or cleared:
            async with conn.transaction():
                await self.book.write_letters(conn, letters)
                await self.book.clear(conn, cleared)
                await conn.execute(sql, *(params[n] for n in names))
        else:
            await conn.execute(sql, *(params[n] for n in names))
        self._offset = max(self._offset, checkpoint)

    async def failures(self) -> dict[int, StreamFailure]:
        return await self.book.failures(self.log.conn)

    async def record_failure(self, message: Message, error: str) -> int:
        return await self.book.record_failure(self.log.conn, message, error)

    async def held_keys(self, keys: Iterable[str] | None = None) -> set[str]:
        return await self.book.held_keys(self.log.conn, keys)

    async def backlog(self, limit: int) -> Backlog:
        return await self.log.backlog(self._offset, limit)

    async def idle(self) -> None:
        """Partition upkeep while there is nothing to read: without it, rows of days past
        the partitions made at schema apply would fill the default partition, which
        retention never drops. After an upkeep that gave up for locks, again within
        UPKEEP_RETRY_SECONDS rather than maintenance_seconds."""
        interval = self.maintenance_seconds
        if self.log.upkeep_busy:
            interval = min(interval, UPKEEP_RETRY_SECONDS)
        if time.monotonic() - self._maintained_at < interval:
            return
        self._maintained_at = time.monotonic()
        await self.log.ensure_partitions()
        if self.retention_days is not None:
            today = dt.datetime.now(dt.UTC).date()
            await self.log.drop_partitions(today - dt.timedelta(days=self.retention_days))


def reader_lock_key(log: PgLog, reader: str) -> str:
    """The advisory lock's key of one reader: held by its relay, taken by a seek."""
    return f"outboxer-log-reader:{log.schema}.{log.table}:{reader}"


def _offset(row: Any) -> LogOffset:
    return LogOffset(int(row["order_xid"]), int(row["position"]))


def _midnight(day: dt.date) -> dt.datetime:
    return dt.datetime.combine(day, dt.time(0), tzinfo=dt.UTC)


def _midnight_literal(day: dt.date) -> str:
    """A day's start as a timestamptz literal for DDL (which takes no parameters)."""
    return f"'{day.isoformat()} 00:00+00'"


def _consecutive(days: Sequence[dt.date]) -> list[list[dt.date]]:
    """``days`` (ascending) in runs of consecutive days."""
    runs: list[list[dt.date]] = []
    for day in days:
        if runs and runs[-1][-1] + dt.timedelta(days=1) == day:
            runs[-1].append(day)
        else:
            runs.append([day])
    return runs


def _days_listed(days: dict[dt.date, int], shown: int = 10) -> str:
    listed = ", ".join(f"{day}: {rows}" for day, rows in sorted(days.items())[:shown])
    return listed + (f" and {len(days) - shown} more day(s)" if len(days) > shown else "")


def _sqlstate(exc: BaseException) -> str | None:
    return getattr(exc, "sqlstate", None)


def _scan_cut(exc: BaseException) -> bool:
    """Whether a scan of the default partition was cut at SCAN_TIMEOUT (the server's
    statement_timeout, or the client's bound past it)."""
    return _sqlstate(exc) == _QUERY_CANCELED or isinstance(exc, TimeoutError)
