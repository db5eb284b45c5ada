"""SQLite store: the embedded default, for the demo and for single-process applications.

SQLite has one writer at a time, so seq order is commit order. The relay runs
each statement on its own connection in the store's own worker thread; wake-ups come
from ``PRAGMA data_version``, which changes when another connection commits.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import json
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from outboxer.config import Settings
from outboxer.errors import ConfigError, SchemaError, StoreError
from outboxer.message import Message, Status
from outboxer.redact import Log, get_logger, redact_url
from outboxer.stores.base import (
    AbandonedRow,
    Claim,
    DestinationStatus,
    Failure,
    Lease,
    SettleResult,
    Store,
    StoreDataError,
    adopted_by,
    estimate_from_sample,
    fold_counts,
    parse_headers,
    read_rows,
    refuse_foreign_tables,
    row_id,
    sample_seqs,
    with_published_estimates,
)
from outboxer.stores.sqlfiles import (
    admin_queries,
    migrations,
    queries,
    quote_ident,
    render,
    statements,
)

if TYPE_CHECKING:
    from outboxer.admin import MessageFilter

T = TypeVar("T")

logger = get_logger("outboxer.stores.sqlite")

_MIGRATIONS_TABLE = """
CREATE TABLE IF NOT EXISTS {migrations} (
    version    INTEGER PRIMARY KEY,
    name       TEXT NOT NULL,
    applied_at REAL NOT NULL DEFAULT ((julianday('now') - 2440587.5) * 86400.0)
);
"""


def sqlite_path(url: str) -> str:
    """``sqlite:///relative.db`` or ``sqlite:////absolute.db`` (SQLAlchemy's convention)."""
    for prefix in ("sqlite+aiosqlite:///", "sqlite+pysqlite:///", "sqlite:///"):
        if url.startswith(prefix):
            path = url[len(prefix) :].split("?", 1)[0]
            if not path:
                raise ConfigError(f"sqlite URL needs a file path: {redact_url(url)!r}")
            return path
    raise ConfigError(f"not a sqlite URL: {redact_url(url)!r} (expected sqlite:///path.db)")


#: Milliseconds a statement of outboxer's connections waits for another's lock.
BUSY_TIMEOUT_MS = 30_000


def open_connection(path: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30)
    conn.execute("PRAGMA journal_mode = WAL")  # readers do not block the writer
    conn.execute("PRAGMA synchronous = FULL")  # a confirmed enqueue survives power loss
    conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
    return conn


#: A -wal file larger than this at the relay's cleanup is checkpointed and truncated
#: (SqliteStore.bound_wal). SQLite's automatic checkpoint (every 1000 pages: 4 MiB of 4 KiB
#: pages) restarts the WAL at its start but never shrinks the file, so steady traffic keeps
#: it about that size and reuses it (truncating it would only make the next writes grow it
#: again); twice that, a burst or a long reader grew it, and it keeps that size for as long
#: as any connection is open: an application's connection beside a relay, for weeks.
WAL_TRUNCATE_ABOVE = 8 * 1024 * 1024

#: Seconds a truncating checkpoint waits for the readers of the WAL to end. It holds the
#: write lock meanwhile, so the application's writers (and the relay's statements, on the
#: same connection) wait as long: a reader that does not end soon is left for next time.
WAL_TRUNCATE_WAIT = 0.1

#: Seconds the -wal file may stay too large for bound_wal to truncate before a warning: a
#: reader may hold its snapshot for a moment; one that still holds it at the next round
#: (``cleanup_interval``, 5 minutes by default) is stuck.
WAL_STUCK_WARNING = 60.0


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:  # no connection open: SQLite deleted it
        return 0


def _timestamp(value: float | None) -> datetime | None:
    return datetime.fromtimestamp(value, UTC) if value is not None else None


#: Seconds between two readings of PRAGMA data_version by a waiting relay: its latency floor.
WAKE_PROBE_INTERVAL = 0.02

#: The time columns of a listed row (list in queries.sql), stored as Unix seconds.
_LISTED_TIMES = ("created_at", "updated_at", "next_attempt_at", "published_at")

#: The name of a store's statement thread (SqliteStore._in_thread), for thread dumps.
THREAD_NAME = "outboxer-sqlite"


class SqliteStore(Store):
    dialect = "sqlite"
    migrations_table_sql = _MIGRATIONS_TABLE

    def __init__(self, url: str, *, schema: str = "outboxer", table: str = "outbox") -> None:
        super().__init__(url, schema=schema, table=table)
        self.path = sqlite_path(url)
        self._conn: sqlite3.Connection | None = None
        self._lock = threading.Lock()
        #: The one thread that runs this store's statements (see _in_thread); made on first
        #: use, retired by close (a later statement makes another).
        self._executor: ThreadPoolExecutor | None = None
        #: The process that made the last ``_executor`` (0: none yet): a forked child has
        #: none of that process's threads.
        self._executor_pid = 0
        #: Per destination, the last data_version one of its waiting loops saw.
        self._data_versions: dict[str, int] = {}
        #: The latest data_version reading, shared by the waiting loops (see _probe): the
        #: version, when it was read, the destinations it asked due_destinations for and
        #: those of them it found due.
        self._reading: tuple[int, float, frozenset[str], frozenset[str]] | None = None
        self._probe_lock = asyncio.Lock()
        self._waiting_destinations: set[str] = set()
        #: Since when bound_wal has found the -wal file too large and could not truncate it
        #: (monotonic), and its size at the last warning about it (0: none yet).
        self._wal_stuck_since: float | None = None
        self._wal_warned_at = 0
        tokens = self.tokens()
        self._sql = {name: render(sql, tokens) for name, sql in queries("sqlite").items()}

    def tokens(self) -> dict[str, str]:
        # SQLite has no schemas: the table lives in the main database.
        return {
            "table_raw": self.table,
            "outbox": quote_ident(self.table),
            "migrations": quote_ident(self.table + "_migrations"),
            "inbox": quote_ident("inbox"),
            "dead_letters": quote_ident("dead_letters"),
            "inbox_suspects": quote_ident("inbox_suspects"),
        }

    async def connect(self) -> None:
        """Open the database file if it exists: only ``apply_schema`` makes a missing one.

        Every other command (status, messages, the relay) would otherwise leave an empty
        database, and its directories, wherever a mistyped path pointed, for the next
        command or relay to find empty; their first statement raises SchemaError instead.
        """
        if self._conn is None and await self._in_thread(self._exists):
            await self._open(create=False)

    def _exists(self) -> bool:
        return self.path == ":memory:" or Path(self.path).is_file()

    async def _open(self, *, create: bool) -> sqlite3.Connection:
        if self._conn is None:
            self._conn = await self._in_thread(functools.partial(self._open_file, create))
        return self._conn

    def _open_file(self, create: bool) -> sqlite3.Connection:
        if create and self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        elif not self._exists():
            raise SchemaError(
                f"no SQLite database at {self.path}: run `outboxer schema apply` with this URL "
                "first"
            )
        return open_connection(self.path)

    async def close(self) -> None:
        try:
            if self._conn is not None:
                conn, self._conn = self._conn, None

                def close_when_idle() -> None:
                    # A cancelled caller's statement may still run in the store's thread:
                    # closing the connection under it crashes the sqlite3 module, so wait.
                    with self._lock:
                        conn.close()

                await self._in_thread(close_when_idle)
        finally:
            # What was queued before runs first (a cancelled caller's statement under way);
            # then the thread ends, not joined here. A store used again makes a new one.
            executor, self._executor = self._executor, None
            if executor is not None:
                executor.shutdown(wait=False)

    def _in_thread(self, call: Callable[[], T]) -> asyncio.Future[T]:
        """``call()`` on the store's own thread, as ``asyncio.to_thread`` would run it on the
        event loop's default executor, which this store does not use.

        That executor's few threads (min(32, CPUs + 4)) are shared with whatever else
        blocks in the process, and a caller's timeout does not free one: name lookups
        (``loop.getaddrinfo``, each connect to a broker named by host), MQTT connects
        (paho's, lookup included). In a DNS outage those held every thread for the
        resolver's timeout, and every claim, settle and lease renewal of the relay, for
        all destinations, and /health's ping, queued behind them: a healthy destination
        published nothing for 20 to 45 s, and batches in flight lost their leases.

        One thread is all the store can use: its statements take ``_lock`` one at a time
        (one connection), so more threads would only wait on it; here they queue in the
        order the callers asked. A ThreadPoolExecutor's thread, as the default executor's:
        the interpreter's exit waits for a statement under way (a cancelled caller's, a
        COMMIT), and ``close`` does too (close_when_idle), as before.
        """
        executor = self._executor
        if self._executor_pid != os.getpid():
            if self._executor_pid:
                # Forked since (a worker process of a prefork server, multiprocessing): the
                # executor's thread stayed in the parent, and the executor, counting it,
                # made no other one, so every statement waited for ever. A statement under
                # way in the parent at the fork left ``_lock`` held in this copy of it.
                self._lock = threading.Lock()
            executor = None
        if executor is None:
            executor = self._executor = ThreadPoolExecutor(1, thread_name_prefix=THREAD_NAME)
            self._executor_pid = os.getpid()
        # The caller's context, as asyncio.to_thread gives it (logging's, tracing's).
        run = contextvars.copy_context().run
        return asyncio.get_running_loop().run_in_executor(executor, run, call)

    async def _run(self, work: Callable[[sqlite3.Connection], T]) -> T:
        conn = await self._open(create=False)

        def locked() -> T:
            with self._lock:
                try:
                    return work(conn)
                except (sqlite3.Error, UnicodeError) as exc:
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                    if isinstance(exc, sqlite3.DataError | sqlite3.IntegrityError | UnicodeError):
                        # Refused values (or text sqlite3 cannot encode): no outage, and the
                        # same statement would fail again.
                        raise StoreDataError(f"SQLite refused the values: {exc}") from exc
                    raise StoreError(f"SQLite: {exc}") from exc

        return await self._in_thread(locked)

    # ----- schema --------------------------------------------------------------------------

    async def apply_schema(self) -> list[str]:
        await self._open(create=True)
        tokens = self.tokens()

        def work(conn: sqlite3.Connection) -> list[str]:
            applied = []
            conn.execute("BEGIN IMMEDIATE")
            for statement in statements(render(_MIGRATIONS_TABLE, tokens)):
                conn.execute(statement)
            done = {row[0] for row in conn.execute(f"SELECT version FROM {tokens['migrations']}")}
            pending = [m for m in migrations("sqlite") if m.version not in done]
            columns_sql = queries("sqlite", "schema.sql")["table_columns"]
            try:
                refuse_foreign_tables(
                    pending,
                    tokens,
                    {
                        token: [
                            row[0]
                            for row in conn.execute(
                                columns_sql, {"table": tokens[token].strip('"')}
                            )
                        ]
                        for token in adopted_by(pending)
                    },
                )
            except SchemaError:
                conn.execute("ROLLBACK")  # the migrations table too: nothing changed
                raise
            for migration in pending:
                for statement in statements(render(migration.sql, tokens)):
                    conn.execute(statement)
                conn.execute(
                    f"INSERT INTO {tokens['migrations']} (version, name) VALUES (?, ?)",
                    (migration.version, migration.name),
                )
                applied.append(migration.name)
            conn.execute("COMMIT")
            return applied

        return await self._run(work)

    async def applied_migrations(self) -> set[int]:
        table = self.tokens()["migrations"]

        def work(conn: sqlite3.Connection) -> set[int]:
            try:
                return {row[0] for row in conn.execute(f"SELECT version FROM {table}")}
            except sqlite3.OperationalError:  # no such table: nothing applied yet
                return set()

        return await self._run(work)

    # ----- the relay's statements ----------------------------------------------------------

    async def claim(
        self,
        destination: str,
        relay_id: str,
        limit: int,
        lock_seconds: float,
        abandoned_blocks: bool,
        *,
        max_attempts: int = Settings.max_attempts,
        recover: bool = True,
        max_bytes: int = Settings.claim_max_bytes,
    ) -> Claim:
        lease = Lease.new(relay_id)
        params = {
            "destination": destination,
            "relay_id": relay_id,
            "lease": lease.token,
            "limit": limit,
            "lock_seconds": lock_seconds,
            "abandoned_blocks": abandoned_blocks,
            "max_attempts": max_attempts,
            "max_bytes": max_bytes,
            "now": time.time(),
        }

        def work(conn: sqlite3.Connection) -> tuple[list[Any], list[Any], bool]:
            conn.execute("BEGIN IMMEDIATE")
            # The clock is read under the write lock, so claims and settles see times in
            # the order they ran: read before it, a claim could run after a settle that
            # released a row at a later time, find it not yet due, and take its key's next.
            params["now"] = time.time()
            # RETURNING: seq, id, topic, key, attempts, last_error.
            abandoned = conn.execute(self._sql["abandon_expired"], params).fetchall()
            if abandoned_blocks:
                # The dead relay's rows behind an abandoned row of their key are released
                # (see the SQL); else such a row heads its key: recovered alone.
                conn.execute(self._sql["release_behind_abandoned"], params)
            head = conn.execute(self._sql["expired_head"], params).fetchone()
            if head is not None and recover:
                rows = conn.execute(self._sql["recover"], {**params, "seq": head[0]}).fetchall()
            elif head is None:
                rows = conn.execute(self._sql["claim"], params).fetchall()
            else:
                rows = []  # a row waits to be recovered, and the caller may not: say so
            conn.execute("COMMIT")
            return abandoned, rows, head is not None

        abandoned, rows, expired = await self._run(work)
        messages, unreadable = read_rows(
            sorted(rows, key=lambda row: row[0]),
            lambda row: Message(
                id=uuid.UUID(row[1]),
                destination=row[2],
                topic=row[3],
                key=row[4],
                payload=bytes(row[5]),
                content_type=row[6],
                headers=parse_headers(row[7]),
                attempts=row[8],
                created_at=_timestamp(row[9]),
                seq=row[0],
            ),
            lambda row, error: AbandonedRow(row_id(row[1]), row[0], row[3], row[4], row[8], error),
        )
        claim = Claim(
            messages,
            lease=lease,
            recovered=expired and recover,
            recovery_waiting=expired and not recover,
            abandoned=[
                AbandonedRow(row_id(row[1]), row[0], row[2], row[3], row[4], row[5])
                for row in sorted(abandoned, key=lambda row: row[0])
            ],
        )
        await self.abandon_unreadable(destination, claim, unreadable, max_attempts)
        return claim

    async def renew(
        self, destination: str, lease: Lease, seqs: Sequence[int], lock_seconds: float
    ) -> int:
        params = {
            "seqs": json.dumps(list(seqs)),
            "lease": lease.token,
            "relay_id": lease.relay_id,
            "lock_seconds": lock_seconds,
            "now": time.time(),
        }
        return await self._run(lambda conn: conn.execute(self._sql["renew"], params).rowcount)

    async def settle(
        self,
        destination: str,
        lease: Lease,
        published: Sequence[int],
        failed: Sequence[Failure],
        released: Sequence[int],
        max_attempts: int,
    ) -> SettleResult:
        holder = {"relay_id": lease.relay_id, "lease": lease.token, "now": time.time()}

        def work(conn: sqlite3.Connection) -> SettleResult:
            result = SettleResult()
            conn.execute("BEGIN IMMEDIATE")
            holder["now"] = time.time()  # under the write lock, as the claim's (see there)
            cursor = conn.executemany(
                self._sql["settle_published"], [{**holder, "seq": seq} for seq in published]
            )
            result.published = max(cursor.rowcount, 0)
            cursor = conn.executemany(
                self._sql["settle_failed"],
                [
                    {
                        **holder,
                        "seq": f.seq,
                        "error": f.error,
                        "delay": f.delay,
                        "permanent": f.permanent,
                        "max_attempts": max_attempts,
                    }
                    for f in failed
                ],
            )
            result.failed = max(cursor.rowcount, 0)
            cursor = conn.executemany(
                self._sql["release"], [{**holder, "seq": seq} for seq in released]
            )
            result.released = max(cursor.rowcount, 0)
            conn.execute("COMMIT")
            return result

        result = await self._run(work)
        result.lost = (
            len(published)
            + len(failed)
            + len(released)
            - (result.published + result.failed + result.released)
        )
        return result

    async def cleanup(self, status: str, retention: float, limit: int) -> int:
        params = {"status": status, "retention": retention, "limit": limit, "now": time.time()}
        return await self._run(lambda conn: conn.execute(self._sql["cleanup"], params).rowcount)

    async def cleanup_inbox(self, retention: float, limit: int) -> int:
        params = {"retention": retention, "limit": limit, "now": time.time()}
        # Two bounded statements, one write transaction each (_run); the sum is >= limit
        # while either table may hold more, so the caller's batch loop goes on.
        deleted = await self._run(
            lambda conn: conn.execute(self._sql["inbox_cleanup"], params).rowcount
        )
        return deleted + await self._run(
            lambda conn: conn.execute(self._sql["inbox_suspects_cleanup"], params).rowcount
        )

    async def bound_wal(self, *, log: Log | None = None) -> int:
        """Truncate the -wal file if a burst grew it past WAL_TRUNCATE_ABOVE; its bytes after.

        The relay runs this after each cleanup round: nothing else shrinks the file while
        any connection is open, and ``journal_size_limit`` acts only on the connection that
        restarts the WAL, often the application's, whose pragmas are not outboxer's to set.

        A PASSIVE checkpoint first, which waits for nothing: frames it could not copy into
        the database are those a reader's old snapshot still needs, and a truncation would
        only wait for that reader, holding the write lock. Otherwise a TRUNCATE checkpoint,
        waiting at most WAL_TRUNCATE_WAIT for the readers of the WAL. Either refusal is left
        for the next round, and warned about once it has lasted WAL_STUCK_WARNING (again each
        time the file has doubled): while a reader holds its snapshot the WAL cannot restart,
        so it grows with every write, without bound.
        """
        if self.path == ":memory:":
            return 0
        log = logger if log is None else log

        def work(conn: sqlite3.Connection) -> tuple[int, int, int, bool, float]:
            # The file SQLite names, not the configured path's: SQLite resolves symbolic
            # links (the -wal file lies beside the real database) and opened a relative
            # path from the directory current then; ``<path>-wal`` may not exist, and
            # a burst's -wal file was never measured nor truncated.
            database = next(
                (row[2] for row in conn.execute("PRAGMA database_list") if row[1] == "main"), ""
            )
            if not database:  # a temporary or in-memory database: no file
                return 0, 0, 0, False, 0.0
            wal = Path(database + "-wal")
            before = _file_size(wal)
            if before <= WAL_TRUNCATE_ABOVE:
                return before, before, 0, False, 0.0
            started = time.monotonic()
            # (busy, frames in the WAL, frames copied into the database); PASSIVE's busy is
            # another connection's checkpoint under way.
            busy, frames, copied = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
            if not busy and copied >= frames:
                conn.execute(f"PRAGMA busy_timeout = {round(WAL_TRUNCATE_WAIT * 1000)}")
                try:
                    busy, frames, copied = conn.execute(
                        "PRAGMA wal_checkpoint(TRUNCATE)"
                    ).fetchone()
                finally:
                    conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            blocked = bool(busy) or copied < frames
            return before, _file_size(wal), max(frames - copied, 0), blocked, started

        before, after, left, blocked, started = await self._run(work)
        if before <= WAL_TRUNCATE_ABOVE:
            self._wal_stuck_since, self._wal_warned_at = None, 0
            return after
        now = time.monotonic()
        if not blocked:
            (log.info if self._wal_warned_at else log.debug)(
                "SQLite -wal file of %s truncated: %.1f MB to %.1f MB in %.0f ms",
                self.path,
                before / 1e6,
                after / 1e6,
                (now - started) * 1000,
            )
            self._wal_stuck_since, self._wal_warned_at = None, 0
            return after
        stuck_since = self._wal_stuck_since = self._wal_stuck_since or started
        if now - stuck_since < WAL_STUCK_WARNING or after < 2 * self._wal_warned_at:
            log.debug(
                "SQLite -wal file of %s (%.1f MB) not truncated: a connection holds a "
                "transaction open, or checkpoints (%d WAL frame(s) not copied); the next "
                "cleanup tries again",
                self.path,
                after / 1e6,
                left,
            )
            return after
        self._wal_warned_at = after
        why = (
            f"{left} WAL frame(s) written after its snapshot cannot be copied into the "
            "database until it ends"
            if left
            else "the WAL cannot restart until it ends (or a write under way commits)"
        )
        log.warning(
            "SQLite -wal file of %s is %.1f MB and could not be truncated for %.0f s: a "
            "connection holds a read transaction on an old snapshot (a transaction left "
            "open, or a cursor not read to its end), so %s; the file grows with every write "
            "meanwhile, and the cleanup tries again each round",
            self.path,
            after / 1e6,
            now - stuck_since,
            why,
        )
        return after

    # ----- operations ----------------------------------------------------------------------

    async def status(self) -> list[DestinationStatus]:
        def work(conn: sqlite3.Connection) -> list[DestinationStatus]:
            def rows(name: str, params: dict[str, Any]) -> list[dict[str, Any]]:
                cursor = conn.execute(self._sql[name], params)
                names = [d[0] for d in cursor.description]
                return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]

            # One read transaction: the statements see the same table (a failure rolls
            # it back: _run).
            conn.execute("BEGIN")
            [ends] = rows("seq_range", {})
            first, last = ends["first_seq"], ends["last_seq"]
            if last is None or last - first + 1 <= self.exact_status_rows:
                exact = fold_counts(rows("counts", {"now": time.time()}))
                conn.execute("COMMIT")
                return exact
            counted = fold_counts(rows("counts_tally", {"now": time.time()}))
            seqs = sample_seqs(first, last)
            sampled = rows("sample_published", {"seqs": json.dumps(seqs)})
            conn.execute("COMMIT")
            hits = {row["destination"]: int(row["hits"]) for row in sampled}
            return with_published_estimates(
                counted, estimate_from_sample(hits, len(seqs), first, last)
            )

        return await self._run(work)

    async def ping(self) -> None:
        await self._run(lambda conn: conn.execute("SELECT 1").fetchone())

    async def list_messages(self, statuses: Sequence[str], limit: int) -> list[dict[str, object]]:
        def work(conn: sqlite3.Connection) -> list[dict[str, object]]:
            wanted = {f"list_{status.lower()}": status in statuses for status in Status}
            cursor = conn.execute(self._sql["list"], {**wanted, "limit": limit})
            names = [d[0] for d in cursor.description]
            rows = [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]
            # As the other stores give them (and /messages, `outboxer messages --json` print
            # them): a UUID, and aware UTC datetimes, not the Unix seconds SQLite holds.
            for row in rows:
                row["id"] = uuid.UUID(row["id"])
                for column in _LISTED_TIMES:
                    row[column] = _timestamp(row[column])
            return rows

        return await self._run(work)

    async def requeue(
        self, destinations: Sequence[str], statuses: Sequence[str], ids: Sequence[str] | None
    ) -> int:
        params = {
            "destinations": json.dumps(list(destinations)),
            "statuses": json.dumps(list(statuses)),
            "ids": json.dumps(list(ids)) if ids is not None else None,
            "now": time.time(),
        }
        return await self._run(lambda conn: conn.execute(self._sql["requeue"], params).rowcount)

    # ----- wake-ups ------------------------------------------------------------------------

    async def _probe(self, *, fresh: bool) -> tuple[int, frozenset[str], frozenset[str]]:
        """``PRAGMA data_version``, one reading per interval for all waiting loops (``fresh``:
        not an earlier one, it did not ask for this loop's destination).

        The version says nothing about destinations: in a relay of several, when it changed
        for some waiting destination, the same probe asks which of them have a row due
        (queries.sql, due_destinations). The race with writers: the question runs after the
        version is read, so a commit after the version's read is either in the answer or
        after it, and then it changes the next version, whose question sees it.
        """
        async with self._probe_lock:
            reading = self._reading
            if fresh or reading is None or time.monotonic() - reading[1] >= WAKE_PROBE_INTERVAL / 2:
                waiting = set(self._waiting_destinations)
                versions = dict(self._data_versions)
                due_sql = self._sql["due_destinations"]

                def probe(conn: sqlite3.Connection) -> tuple[int, frozenset[str], frozenset[str]]:
                    version = int(conn.execute("PRAGMA data_version").fetchone()[0])
                    asked = frozenset(d for d in waiting if versions.get(d) != version)
                    if not (asked and len(waiting) > 1):
                        return version, asked, frozenset()
                    params = {"destinations": json.dumps(sorted(asked)), "now": time.time()}
                    due = frozenset(row[0] for row in conn.execute(due_sql, params))
                    return version, asked, due

                version, asked, due = await self._run(probe)
                reading = self._reading = version, time.monotonic(), asked, due
            return reading[0], reading[2], reading[3]

    async def wait_for_wakeup(self, destination: str, timeout: float) -> bool:
        """Poll ``PRAGMA data_version`` (a cheap read) until another connection commits.

        Compared per destination: one destination's loop seeing a commit leaves it news for
        the others'. In a relay of several destinations a change wakes only those the probe
        found due (see _probe): with traffic on one, every other destination's loops claimed
        at each commit and found nothing. All loops probe on shared ticks of the monotonic
        clock, one reading for all of them. A relay of one destination never asks.
        """
        self._waiting_destinations.add(destination)
        deadline = time.monotonic() + timeout
        fresh = False
        while True:
            version, asked, due = await self._probe(fresh=fresh)
            fresh = False
            previous = self._data_versions.get(destination)
            several = len(self._waiting_destinations) > 1
            if (
                several
                and previous is not None
                and version != previous
                and destination not in asked
            ):
                # A reading shared from before this loop waited did not ask for its
                # destination: taken without the answer, the change would wait for the poll.
                fresh = True
                continue
            self._data_versions[destination] = version
            if previous is not None and version != previous and (not several or destination in due):
                return True
            now = time.monotonic()
            remaining = deadline - now
            if remaining <= 0:
                return False
            await asyncio.sleep(min(WAKE_PROBE_INTERVAL - now % WAKE_PROBE_INTERVAL, remaining))

    # ----- operators' changes by filter (outboxer.admin; SQL in admin.sql) ----------------

    @functools.cached_property
    def _admin_sql(self) -> dict[str, str]:
        tokens = self.tokens()
        return {name: render(sql, tokens) for name, sql in admin_queries("sqlite").items()}

    async def count_matching(self, where: MessageFilter) -> dict[str, dict[str, int]]:
        params = _filter_params(where)
        rows = await self._run(
            lambda conn: conn.execute(self._admin_sql["count_matching"], params).fetchall()
        )
        counts: dict[str, dict[str, int]] = {}
        for destination, status, count in rows:
            counts.setdefault(destination, {})[status] = int(count)
        return counts

    async def _change(
        self, name: str, where: MessageFilter, then: str | None = None
    ) -> tuple[int, int]:
        """One admin statement in its own BEGIN IMMEDIATE transaction: the rows it changed,
        and the value the read ``then`` finds after it, in the transaction (0 without one)."""
        params = _filter_params(where)

        def work(conn: sqlite3.Connection) -> tuple[int, int]:
            conn.execute("BEGIN IMMEDIATE")
            count = conn.execute(self._admin_sql[name], params).rowcount
            read = 0 if then is None else conn.execute(self._admin_sql[then], params).fetchone()[0]
            conn.execute("COMMIT")
            return int(count), int(read)

        return await self._run(work)

    async def purge(self, where: MessageFilter) -> int:
        return (await self._change("purge", where))[0]

    async def requeue_matching(self, where: MessageFilter) -> int:
        return (await self.requeue_matching_counted(where))[0]

    async def requeue_matching_counted(self, where: MessageFilter) -> tuple[int, int]:
        return await self._change("requeue_matching", where, then="count_requeue_deferred")

    async def count_requeue_deferred(self, where: MessageFilter) -> int:
        params = _filter_params(where)
        row = await self._run(
            lambda conn: conn.execute(self._admin_sql["count_requeue_deferred"], params).fetchone()
        )
        return int(row[0])

    async def replay(
        self, where: MessageFilter, copy: Callable[[Sequence[Message]], list[Message]]
    ) -> int:
        from outboxer.admin import REPLAY_PAGE
        from outboxer.enqueue import Outbox, detect

        outbox = Outbox(schema=self.schema, table=self.table)
        params = _filter_params(where)

        def work(conn: sqlite3.Connection) -> int:
            # The whole replay holds the write lock: no writer commits between two pages.
            conn.execute("BEGIN IMMEDIATE")
            try:
                inserted, after = 0, 0
                while rows := conn.execute(
                    self._admin_sql["replay_page"], {**params, "after": after, "page": REPLAY_PAGE}
                ).fetchall():
                    after = rows[-1][0]
                    copies = copy([_original(row) for row in rows])
                    if copies:
                        detect(conn).write(outbox, conn, copies)
                        inserted += len(copies)
            except BaseException:
                # _run rolls back on sqlite3's errors only; a copy's own error (ReplayError)
                # must not leave the transaction open on the shared connection.
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
            return inserted

        return await self._run(work)


def _original(row: Sequence[Any]) -> Message:
    """A PUBLISHED row a replay copies, as a Message."""
    seq, identifier, destination, topic, key, payload, content_type, headers, created_at = row
    return Message(
        id=uuid.UUID(identifier),
        topic=topic,
        payload=bytes(payload),
        key=key,
        headers=json.loads(headers),
        content_type=content_type,
        destination=destination,
        created_at=_timestamp(created_at),
        seq=seq,
    )


def _filter_params(where: MessageFilter) -> dict[str, Any]:
    """A MessageFilter as admin.sql's filter parameters: lists as JSON arrays, times as Unix
    seconds, None where a criterion is left out."""

    def listed(values: tuple[Any, ...] | None) -> str | None:
        return json.dumps([str(value) for value in values]) if values is not None else None

    def seconds(moment: datetime | None) -> float | None:
        return moment.timestamp() if moment is not None else None

    return {
        "statuses": listed(where.statuses),
        "ids": listed(where.ids),
        "destinations": listed(where.destinations),
        "topics": listed(where.topics),
        "keys": listed(where.keys),
        "older_than": where.older_than,
        "created_after": seconds(where.created_after),
        "created_before": seconds(where.created_before),
        "error": where.error,
        "now": time.time(),
    }
