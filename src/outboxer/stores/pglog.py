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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from outboxer.errors import ConfigError, StoreError
from outboxer.message import Message
from outboxer.redact import get_logger
from outboxer.stores.base import UNREADABLE_ROW, parse_headers
from outboxer.stores.pgmodes import ModeSchema, ReaderLock
from outboxer.stores.pgstream import Backlog, DeadLetter, StreamBook, StreamFailure
from outboxer.stores.sqlfiles import quote_ident, to_numbered
from outboxer.streamrelay import Entry

logger = get_logger("outboxer.pglog")

#: Seconds drop_partitions waits for a partition's locks (behind its open writers, while
#: new writers of the log wait behind it) before it keeps the partition for next time.
DROP_LOCK_TIMEOUT = 5.0

_PARTITION_DAY = re.compile(r"_p(\d{8})$")


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

    async def ensure_partitions(
        self, days_ahead: int = 7, *, today: dt.date | None = None
    ) -> list[str]:
        """Create the daily partitions (UTC days) from today to ``days_ahead`` days on."""
        start = today or dt.datetime.now(dt.UTC).date()
        existing = {
            row["name"] for row in await self._fetch("partitions", {"log": self.names["log"]})
        }
        created = []
        for offset in range(days_ahead + 1):
            day = start + dt.timedelta(days=offset)
            name = self.partition_name(day)
            if name in existing:
                continue
            upper = day + dt.timedelta(days=1)
            try:
                await self.conn.execute(
                    f"CREATE TABLE {quote_ident(self.schema)}.{quote_ident(name)} "
                    f"PARTITION OF {self.names['log']} "
                    f"FOR VALUES FROM ('{day.isoformat()} 00:00+00') TO ('{upper.isoformat()} 00:00+00')"
                )
            except Exception as exc:  # asyncpg errors: the day's rows already sit in the default
                if getattr(exc, "sqlstate", None) in ("42P07", "23505"):
                    # Another reader's relay created it since the listing (duplicate_table;
                    # unique_violation in the catalogs when both passed the name check):
                    # it exists, which is all this wants. Raised, it stopped the relay.
                    continue
                if "default partition" not in str(exc):
                    raise
                logger.warning("log partition %s not created: %s", name, exc)
                continue
            created.append(name)
        return created

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
        retention never drops."""
        if time.monotonic() - self._maintained_at < self.maintenance_seconds:
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
