"""PostgreSQL store for the relay, on asyncpg.

The write path (``outboxer.enqueue``) does not use this class: it runs the same
``insert`` query on the caller's own connection, whatever its driver.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import functools
import os
import random
import socket
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from outboxer.config import DAY, Settings
from outboxer.errors import MissingDependencyError, SchemaError, StoreError
from outboxer.keepalive import keep_asyncpg_alive
from outboxer.message import Message
from outboxer.redact import get_logger
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
    copied_once,
    fold_counts,
    parse_headers,
    read_rows,
    refuse_foreign_tables,
    row_id,
    with_published_estimates,
)
from outboxer.stores.pgpartitions import ISOLATION as PARTITION_ISOLATION
from outboxer.stores.pgpartitions import (
    PARTITIONED,
    Partition,
    PartitionPolicy,
    PartitionReport,
    Partitions,
)
from outboxer.stores.pgtls import check_tls_files
from outboxer.stores.sqlfiles import (
    Migration,
    admin_queries,
    migrations,
    queries,
    quote_ident,
    render,
    to_numbered,
)
from outboxer.stores.wakeups import WakeUps

if TYPE_CHECKING:
    from outboxer.admin import MessageFilter

logger = get_logger("outboxer.store")

T = TypeVar("T")

#: Seconds ``close`` waits for the database's goodbyes before it cuts the connections.
CLOSE_TIMEOUT = 1.0
#: Seconds a connection whose statement failed or was cut short (a caller's timeout, a
#: forced shutdown) waits for the database to confirm the cancel, or to reset; then it is
#: closed instead. asyncpg waits up to command_timeout (a minute) for a database that
#: stopped answering, and a scrape, a health probe or a shutdown waited with it.
RELEASE_TIMEOUT = 0.5
#: Seconds the wake-up listener's connect and statements (LISTEN, the idle registration
#: and its withdrawal, all trivial) may take: past it the relay polls instead. Its
#: connection had no statement timeout, and one that got no answer (a row lock held on
#: the listeners' table, an idle connection a NAT forgot) held the listener's lock, and
#: with it every idle loop of the relay, for ever: nothing was claimed until it answered.
LISTENER_TIMEOUT = 5.0
#: Seconds the pool's statements may take (asyncpg's command_timeout), and about how long
#: a vanished peer goes unnoticed by the keepalives of the relay's connections
#: (``outboxer.keepalive``): the server's end of the pool's and schema connections, the
#: client's end of the schema connections (their statements have no bound).
COMMAND_TIMEOUT = 60.0
#: Tries of a claim, settle or renewal, or of an operator's purge, requeue or replay,
#: PostgreSQL chose as a deadlock's victim (see PostgresStore._deadlock_retried), as
#: MySQLStore's DEADLOCK_TRIES.
DEADLOCK_TRIES = 5


def _detached(conn: Any) -> bool:
    """Whether asyncpg took this pool connection back on its own: it does so as soon as it
    reads the end of the socket (the server ended the session), and gives its place in the
    pool to the next acquire, which connects anew. An attribute read, no round trip:
    asyncpg's proxy has no public call for it (its ``is_closed()`` raises InterfaceError)."""
    return conn._con is None


def _ended_before_sent(exc: BaseException) -> bool:
    """Whether the statement failed before asyncpg sent anything, on a connection whose
    session the server ended: its goodbye (a FATAL error, as pg_terminate_backend or a
    shutdown sends) was read while the connection was idle, the end of its socket not yet
    (a loop turn later), and asyncpg refuses any statement in between with this error.
    Nothing reached the server: the statement runs again on another connection."""
    asyncpg = _asyncpg()
    return isinstance(exc, asyncpg.InternalClientError) and str(exc).startswith(
        "cannot switch to state"
    )


def _read_only(exc: BaseException) -> bool:
    """Whether the server refused a write because it is read-only now (SQLSTATE 25006,
    read_only_sql_transaction): a hot standby ("cannot execute UPDATE in a read-only
    transaction", "cannot execute LISTEN during recovery"), or a primary demoted by a
    failover that stays up: fenced with default_transaction_read_only (Patroni,
    pg_auto_failover), Aurora's old writer turned reader, each keeping the sessions it had.
    The relay never makes a transaction of its own read-only: the server this connection
    reached is no longer the writable one, and neither are the pool's other connections to it."""
    return isinstance(exc, _asyncpg().ReadOnlySQLTransactionError)


async def _give_back(pool: Any, conn: Any) -> None:
    """Give back ``conn``, whose statement failed or was cut short, within RELEASE_TIMEOUT
    (else asyncpg closes it, and the pool opens a new one when asked)."""
    try:
        await pool.release(conn, timeout=RELEASE_TIMEOUT)
    except TimeoutError:
        logger.info("a connection gave no answer within %gs: closed", RELEASE_TIMEOUT)


_MIGRATIONS_TABLE = """
-- The schema unless it exists: CREATE SCHEMA IF NOT EXISTS asks for the CREATE privilege on
-- the database even when it exists, which a role owning the schema its DBA made lacks.
DO $schema$ BEGIN
    IF to_regnamespace('{schema}') IS NULL THEN
        CREATE SCHEMA {schema};
    END IF;
END $schema$;
CREATE TABLE IF NOT EXISTS {migrations} (
    version    integer PRIMARY KEY,
    name       text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);
"""


async def lock_schema(conn: Any, schema: str) -> None:
    """Wait for every other outboxer schema change in ``schema`` to end (until this
    transaction ends). The tables of one schema share objects they each create IF NOT
    EXISTS (the schema itself, the inbox, the dead letters), and two such creations at once
    fail with a duplicate key of the catalog: applies of two tables (two services
    deploying together), each under its own table's lock, failed that way. Taken before
    the table's own lock, by every schema change (apply, migrate-partitioned, modes)."""
    await conn.execute("SELECT pg_advisory_xact_lock(hashtextextended($1, 0))", schema_lock(schema))


def schema_lock(schema: str) -> str:
    """The text whose hash keys ``lock_schema``'s lock (Django's migrations take it too)."""
    return f"outboxer-schema:{schema}"


def _asyncpg() -> Any:
    try:
        import asyncpg
    except ImportError as exc:
        raise MissingDependencyError("asyncpg", "postgres") from exc
    return asyncpg


@functools.cache
def _connection_class() -> Any:
    asyncpg = _asyncpg()

    class RelayConnection(asyncpg.Connection):  # type: ignore[misc,name-defined]
        """Skips asyncpg's reset on every release to the pool (a round trip per statement):
        the relay leaves no session state behind, its locks end with its transactions and
        it LISTENs on a connection of its own."""

        def get_reset_query(self) -> str:
            return ""

    return RelayConnection


async def _keep_alive(conn: Any) -> None:
    """TCP keepalives of about COMMAND_TIMEOUT on both ends of a relay's connection
    (``keepalive.keep_asyncpg_alive``). The schema connections' statements have no bound:
    one whose database host vanished waited for ever, and the server held a vanished
    relay's schema locks (an outbox table's ACCESS EXCLUSIVE, every writer behind it) for
    as long as the kernel's defaults take to notice, over two hours."""
    await keep_asyncpg_alive(conn, COMMAND_TIMEOUT)


def asyncpg_dsn(url: str) -> str:
    """asyncpg accepts postgresql:// and postgres:// only."""
    for prefix in ("postgresql+asyncpg://", "postgresql+psycopg://", "postgresql+psycopg2://"):
        if url.startswith(prefix):
            return "postgresql://" + url[len(prefix) :]
    return url


class PostgresStore(Store):
    dialect = "postgres"
    gathers_batches = True  # under load, wait_for_wakeup polls every busy_poll_interval
    migrations_table_sql = _MIGRATIONS_TABLE

    def __init__(
        self, url: str, *, schema: str = "outboxer", table: str = "outbox", pool_size: int = 10
    ) -> None:
        super().__init__(url, schema=schema, table=table)
        check_tls_files(url)  # a ConfigError now, not an outage at every connect
        self.pool_size = pool_size
        self._pool: Any = None
        #: Pool connections the relay's claims, settles and renewals reuse (see _statement).
        self._kept: list[Any] = []
        #: Statements waiting for the pool: while one waits, a statement that ends releases.
        self._acquiring = 0
        #: Times a connection answered read-only (``_server_read_only``): a statement that
        #: took its connection before the count moved holds one of the old server's.
        self._read_only_answers = 0
        self._closing = False
        self._listener: Any = None
        #: When the relay's waiting loops wake (nudges, the chase, the registration's timing).
        self._wakeups = WakeUps()
        #: This store's name among the idle listeners.
        self._listener_name = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.listener_timeout = LISTENER_TIMEOUT
        #: The relay's loops share one listening connection: one query on it at a time.
        self._listener_lock = asyncio.Lock()
        self._unregistering: asyncio.Task[None] | None = None
        #: Per destination, the leases of claims that never answered (their connection
        #: broke, or they were cancelled): the claim may have committed, and its rows then
        #: wait in flight for nobody (see _release_unanswered). Whether the claim was
        #: allowed to recover matters (queries.sql: expire_unanswered_recovery).
        self._unanswered: dict[str, list[tuple[Lease, bool]]] = {}
        #: The question to the database the loops of quiet destinations woken in this turn
        #: of the event loop join (see _due), before it is sent.
        self._forming_probe: _DueProbe | None = None
        tokens = self.tokens()
        self._sql: dict[str, tuple[str, tuple[str, ...]]] = {
            name: to_numbered(render(sql, tokens)) for name, sql in queries("postgres").items()
        }

    def tokens(self) -> dict[str, str]:
        return {
            **super().tokens(),
            # The partitioned layout's partition for rows of times no other one covers.
            "default_partition": f"{quote_ident(self.schema)}.{quote_ident(self.table + '_default')}",
        }

    # ----- connections ---------------------------------------------------------------------

    async def connect(self) -> None:
        if self._pool is not None:
            return
        asyncpg = _asyncpg()
        try:
            self._pool = await asyncpg.create_pool(
                asyncpg_dsn(self.url),
                min_size=1,
                max_size=self.pool_size,
                connection_class=_connection_class(),
                command_timeout=COMMAND_TIMEOUT,
                # A round trip per new connection (not per statement): the server ends a
                # session whose relay's host vanished within about a minute, and with it
                # the row locks of a transaction it had open, instead of hours.
                init=_keep_alive,
                # The relay's own commits (claim, settle, cleanup) need not wait for the WAL
                # flush: one lost in a crash only makes its rows publish again, in order,
                # which at-least-once allows. The writers' commits, which make the rows exist,
                # keep their own setting; operators' changes ask for a flush (_durably).
                # READ COMMITTED whatever the database's default: the claim function's
                # steps and the settles take a fresh snapshot per statement, after their
                # locks (see queries.sql); a REPEATABLE READ default made every claim that
                # waited for another fail with a serialization error (an outage, backed off).
                # No JIT: a database's jit_above_cost set low (a DBA tuning for analytics)
                # compiled every claim step and settle, ~100 ms each: 200 messages took the
                # relay 40 s instead of half a second. Its statements are short and indexed.
                server_settings={
                    "application_name": "outboxer-relay",
                    "synchronous_commit": "off",
                    "default_transaction_isolation": "read committed",
                    "jit": "off",
                },
            )
        except (OSError, asyncpg.PostgresError) as exc:
            raise StoreError(f"cannot connect to PostgreSQL: {exc}") from exc

    async def close(self) -> None:
        # From here on a statement that ends (a lease renewal finishing late) hands its
        # connection back instead of keeping it: pool.close() waits for every connection.
        self._closing = True
        try:
            # Bounded: a database that stopped answering (a stalled network) never answers
            # the goodbyes, and the relay's shutdown (SIGTERM) waited for them for ever.
            async with asyncio.timeout(CLOSE_TIMEOUT):
                await self._close_gracefully()
        except TimeoutError:
            logger.warning(
                "PostgreSQL did not answer within %gs while closing: connections cut",
                CLOSE_TIMEOUT,
            )
            # Nothing is lost: the listener's registration lapses, the server ends the
            # sessions (and rolls back what they had begun).
            listener, self._listener = self._listener, None
            if listener is not None and not listener.is_closed():
                listener.terminate()
            pool, self._pool = self._pool, None
            if pool is not None:
                pool.terminate()
        finally:
            self._closing = False

    async def _close_gracefully(self) -> None:
        await self._return_kept()
        if self._unregistering is not None:
            await asyncio.gather(self._unregistering, return_exceptions=True)
        listener = self._listener
        if listener is not None:
            if not listener.is_closed():
                sql, args = self._args("unregister_listener", {"relay": self._listener_name})
                with contextlib.suppress(Exception):  # best effort: the row expires anyway
                    await listener.execute(sql, *args)
                await listener.close()
            self._listener = None
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    async def _statement(self, run: Callable[[Any], Awaitable[T]]) -> T:
        """``run(connection)`` on a connection the relay keeps between its statements.

        asyncpg's pool costs each statement a task (its release is shielded), two timers
        and a few event-loop turns; the relay runs two or three statements per batch,
        hundreds of batches per second under a steady stream of writes. A statement that
        succeeded leaves its connection as it found it (one statement, its own transaction
        ended), so the connection is kept for the next one; after any failure (a
        cancellation included) it goes back through the pool's release, which checks it.
        The kept ones go back to the pool when the relay waits in vain for a whole poll
        interval, and on close: idle, the pool's own lifetime rules apply again.
        """
        pool = self._pool
        # Each connection the server ended fails at most once this way (it is closed then).
        tries = len(self._kept) + pool.get_max_size()
        while True:
            answers = self._read_only_answers
            conn = await self._take(pool)
            try:
                result = await run(conn)
                break
            except BaseException as exc:
                tries -= 1
                if tries > 0 and _ended_before_sent(exc):
                    conn.terminate()  # its session is gone; the pool connects anew
                    continue
                if _read_only(exc):
                    await self._server_read_only(pool, conn, answers, exc)
                else:
                    await _give_back(pool, conn)
                raise
        if answers != self._read_only_answers:
            # Another connection answered read-only meanwhile: this one may be to the same
            # server (a read, due_destinations, succeeds there). Kept, the next claim would
            # meet that server again; the pool closes it (an expired one), within bounds.
            await _give_back(pool, conn)
        elif self._closing or pool is not self._pool or self._starving(pool):
            # close() began while this statement ran (a lease renewal finishing late): kept,
            # the connection would never go back, and the pool's close would wait for it.
            # Or a statement waits for the pool, every connection being kept or in use: kept
            # again, this one would go to the loops that already have one, and under load
            # (no quiet wait returns the kept ones) the waiter, a settle or a lease renewal,
            # would wait for ever while its lease ran out.
            await pool.release(conn)
        else:
            self._kept.append(conn)
        return result

    async def _take(self, pool: Any) -> Any:
        """A kept connection, else one from the pool."""
        while self._kept:
            conn = self._kept.pop()
            if not _detached(conn):
                return conn
            # The server cut it while kept (pg_terminate_backend, a restart): asyncpg gave
            # its place back to the pool already, and any call on it raises InterfaceError,
            # which the relay took for an outage (logged, backed off, on /health).
        self._acquiring += 1
        try:
            return await pool.acquire()
        finally:
            self._acquiring -= 1

    async def _server_read_only(
        self, pool: Any, conn: Any, answers: int, exc: BaseException
    ) -> None:
        """``conn``, taken when ``answers`` connections had answered read-only, has just
        answered so too (``_read_only``): its server is no longer the writable one (a
        failover). Before, the relay gave it back to the pool and kept its other
        connections to that server: every claim and settle failed there, backed off and
        tried again on the same connections for ever, the new primary never reached.

        Closed, with every other connection of the pool (asyncpg replaces each on its next
        acquire, the ones in use as they come back) and the wake-up listener: the next
        statement connects anew, to the host the URL gives now (a URL naming every host with
        ``target_session_attrs=read-write`` finds the promoted one; a DNS name, once moved,
        the new writer). Meanwhile the caller's failure is the relay's database outage
        (logged, /health, backed off); the statement was refused whole, so a claim took
        nothing and a settle or renewal is tried again, on the new primary."""
        conn.terminate()  # no goodbye: the server may be on its way down too
        if answers != self._read_only_answers:
            return  # a connection of the same server, which another answer closed already
        self._read_only_answers += 1
        kept, self._kept = self._kept, []
        for other in kept:
            other.terminate()
        await pool.expire_connections()
        listener, self._listener = self._listener, None
        if listener is not None and not listener.is_closed():
            listener.terminate()  # it waits on the old server for NOTIFYs no writer sends there
        self._wakeups.withdraw()  # registered again, on the new server, at the next wait
        self._wakeups.nudge_all()
        logger.warning(
            "PostgreSQL refused a write as read-only (%s): that server is no longer the "
            "writable one (a failover?); the relay's connections to it are closed and the "
            "next statements connect anew",
            exc,
        )

    def _starving(self, pool: Any) -> bool:
        """A statement waits for the pool and the pool has nothing to give it: no idle
        connection, no room for a new one. (A waiter the pool can serve is no reason to
        give up a kept connection: the next statement would pay for an acquire.)"""
        return (
            self._acquiring > 0
            and pool.get_idle_size() == 0
            and pool.get_size() >= pool.get_max_size()
        )

    @contextlib.asynccontextmanager
    async def _connection(self) -> AsyncIterator[Any]:
        """A pool connection for one request; after a failure (a timeout's cancellation
        too), given back as ``_give_back`` does."""
        pool = self._pool
        answers = self._read_only_answers
        conn = await pool.acquire()
        try:
            yield conn
        except BaseException as exc:
            if _read_only(exc):
                await self._server_read_only(pool, conn, answers, exc)
            else:
                await _give_back(pool, conn)
            raise
        await pool.release(conn)

    async def _return_kept(self) -> None:
        kept, self._kept = self._kept, []
        for conn in kept:
            with contextlib.suppress(Exception):  # the pool closes what it cannot reuse
                await self._pool.release(conn)

    def _args(self, name: str, params: dict[str, Any]) -> tuple[str, list[Any]]:
        sql, names = self._sql[name]
        return sql, [params[n] for n in names]

    # ----- schema --------------------------------------------------------------------------

    def _partitions(self) -> Partitions:
        return Partitions(self.schema, self.table, self.lock_key("partitions"))

    @contextlib.asynccontextmanager
    async def _schema_connection(self) -> AsyncIterator[Any]:
        """A connection of its own for a schema change, without the pool's per-statement
        timeout: an index built over a big table, or a wait for a long transaction, takes
        minutes, and cancelled at the pool's 60 s the upgrade could never complete; nor a
        database's or role's ``statement_timeout`` (a DBA's guard for the application's
        queries), for the same reason. READ COMMITTED as the pool's: the versions recorded
        are read after the locks."""
        asyncpg = _asyncpg()
        try:
            conn = await asyncpg.connect(
                asyncpg_dsn(self.url),
                server_settings={
                    "application_name": "outboxer-schema",
                    "default_transaction_isolation": "read committed",
                    "jit": "off",
                    "statement_timeout": "0",
                },
            )
        except (OSError, asyncpg.PostgresError) as exc:
            raise StoreError(f"cannot connect to PostgreSQL: {exc}") from exc
        try:
            await _keep_alive(conn)
            yield conn
        finally:
            await conn.close()

    async def apply_schema(
        self,
        *,
        partitioned: bool = False,
        partition_interval: float = DAY,
        partitions_ahead: int = 3,
    ) -> list[str]:
        """Create or upgrade the schema; return the migrations applied now.

        ``partitioned``: a new outbox table is created range-partitioned by created_at
        (the ``partitioned`` layout), with partitions ``partition_interval`` wide made
        ``partitions_ahead`` widths ahead. An outbox that exists keeps its layout, whatever
        ``partitioned`` says, except that a default table is never made partitioned here
        (SchemaError: ``outboxer schema migrate-partitioned`` does that).
        """
        await self.connect()
        tokens = self.tokens()
        applied: list[str] = []
        async with self._schema_connection() as conn:
            async with conn.transaction():
                await _durably(conn)
                # One schema change at a time, whoever runs it.
                await lock_schema(conn, self.schema)
                await conn.execute("SELECT pg_advisory_xact_lock($1)", self.lock_key("schema"))
                await conn.execute(render(_MIGRATIONS_TABLE, tokens))
                kind = await self._partitions().layout(conn)
                if partitioned and kind == "r":
                    raise SchemaError(
                        f"the outbox {self.schema}.{self.table} exists as a plain table; "
                        "--partitioned creates a new table only. To move this one: "
                        "`outboxer schema migrate-partitioned` (README: Partitioned outbox)"
                    )
                layout = PARTITIONED if kind == "p" or (kind is None and partitioned) else None
                done = {
                    row["version"]
                    for row in await conn.fetch(f"SELECT version FROM {tokens['migrations']}")
                }
                pending = [m for m in migrations("postgres", layout) if m.version not in done]
                await self._refuse_foreign_tables(
                    conn, pending, tokens, creates=any(m.version == 1 for m in pending)
                )
                for migration in pending:
                    await conn.execute(render(migration.sql, tokens))
                    await conn.execute(
                        f"INSERT INTO {tokens['migrations']} (version, name) VALUES ($1, $2)",
                        migration.version,
                        migration.name,
                    )
                    applied.append(migration.name)
            if layout == PARTITIONED:
                policy = PartitionPolicy(ahead=partitions_ahead, interval=partition_interval)
                await self._partitions().maintain(conn, policy)
        return applied

    async def _refuse_foreign_tables(
        self, conn: Any, pending: list[Migration], tokens: dict[str, str], *, creates: bool
    ) -> None:
        """SchemaError, before any migration runs (the transaction then changes nothing), if
        a pending one would adopt someone else's table (base.refuse_foreign_tables), or, when
        it creates this outbox (``creates``), if an outbox whose name differs from this one's
        only in case is in the schema: the names of their indexes, constraints and functions
        would be the same (queries: same_name_but_case)."""
        sql = queries("postgres", "schema.sql")

        async def fetch(name: str, params: dict[str, Any]) -> list[Any]:
            text, names = to_numbered(sql[name])
            return list(await conn.fetch(text, *(params[n] for n in names)))

        columns = {
            token: [row["name"] for row in await fetch("table_columns", {"table": tokens[token]})]
            for token in adopted_by(pending)
        }
        refuse_foreign_tables(pending, tokens, columns)
        if creates and (
            clashing := await fetch(
                "same_name_but_case", {"schema": self.schema, "table": self.table}
            )
        ):
            raise SchemaError(
                f"table(s) {', '.join(self.schema + '.' + row['name'] for row in clashing)} "
                f"differ from the outbox {self.schema}.{self.table} only in case, "
                "and PostgreSQL folds the names of the indexes, constraints and functions "
                "made after the table name to lower case, so the two outboxes would share "
                "them. Choose another table name or schema; nothing was changed"
            )

    async def migrate_to_partitioned(
        self, *, partition_interval: float = DAY, partitions_ahead: int = 3
    ) -> MigrationReport:
        """Move the default table to the partitioned layout, in one transaction: the old
        table becomes ``<table>_plain`` (history only), a partitioned ``<table>`` takes its
        place with every unfinished (and ABANDONED) row of the old one, and the sequence
        goes on. Writers wait for the lock and then write to the new table; no relay may
        run (SchemaError if one is connected). The invariants are in
        ``sql/postgres/migrate_partitioned.sql``."""
        asyncpg = _asyncpg()
        tokens = self.tokens()
        plain_raw = f"{self.table}_plain"
        tokens |= {
            "plain_raw": plain_raw,
            "plain_name": quote_ident(plain_raw),
            "plain": f"{quote_ident(self.schema)}.{quote_ident(plain_raw)}",
        }
        sql = queries("postgres", "migrate_partitioned.sql")
        partitions = self._partitions()
        try:
            conn = await asyncpg.connect(
                asyncpg_dsn(self.url),
                # Unbounded as the schema connection: it copies every unfinished row.
                server_settings={
                    "application_name": "outboxer-migrate",
                    "jit": "off",
                    "statement_timeout": "0",
                },
            )
        except (OSError, asyncpg.PostgresError) as exc:
            raise StoreError(f"cannot connect to PostgreSQL: {exc}") from exc

        async def fetch(name: str, params: dict[str, Any], **more: str) -> list[Any]:
            text, names = to_numbered(render(sql[name], tokens | more))
            return list(await conn.fetch(text, *(params[n] for n in names)))

        async def refuse_if_relays_run() -> None:
            [row] = await fetch("relays_connected", {})
            if row["sessions"]:
                raise SchemaError(
                    f"{row['sessions']} session(s) of outboxer relays (or of `outboxer "
                    "serve`, status, …) are connected to this database: stop them, then "
                    "migrate (writers may keep running)"
                )

        try:
            await _keep_alive(conn)
            # READ COMMITTED whatever the database's default: move_unfinished must read the
            # old table as the lock (lock_plain) finds it, rows of the writers it waited for
            # included; a snapshot taken before the lock (REPEATABLE READ) left them behind.
            async with conn.transaction(isolation=PARTITION_ISOLATION):
                await _durably(conn)
                await conn.execute("SET LOCAL lock_timeout = '5s'")
                await lock_schema(conn, self.schema)
                await conn.execute("SELECT pg_advisory_xact_lock($1)", self.lock_key("schema"))
                kind = await partitions.layout(conn)
                if kind != "r":
                    raise SchemaError(
                        f"the outbox {self.schema}.{self.table} is already partitioned"
                        if kind == "p"
                        else f"there is no outbox {self.schema}.{self.table}: create it with "
                        "`outboxer schema apply --partitioned`"
                    )
                done = {
                    row["version"]
                    for row in await conn.fetch(f"SELECT version FROM {tokens['migrations']}")
                }
                if missing := [m.name for m in migrations("postgres") if m.version not in done]:
                    raise SchemaError(
                        f"the outbox lacks migration(s) {', '.join(missing)}: run "
                        "`outboxer schema apply` first"
                    )
                if await conn.fetchval("SELECT to_regclass($1)", tokens["plain"]) is not None:
                    raise SchemaError(f"{self.schema}.{plain_raw} exists: drop or rename it first")
                try:
                    await conn.execute(render(sql["lock_plain"], tokens))
                except asyncpg.LockNotAvailableError as exc:
                    raise SchemaError(
                        f"the outbox stayed busy for 5 s (a long transaction?): try again ({exc})"
                    ) from exc
                await refuse_if_relays_run()
                [sequence] = await fetch("plain_sequence", {"outbox": tokens["outbox"]})
                await conn.execute(
                    render(sql["rename_plain"], tokens | {"plain_sequence": sequence["name"]})
                )
                for index in await fetch("plain_indexes", {"plain": tokens["plain"]}):
                    old_name = index["name"]
                    new_name = (
                        plain_raw + old_name[len(self.table) :]
                        if old_name.startswith(self.table + "_")
                        else old_name + "_plain"
                    )[:63]
                    await conn.execute(
                        f"ALTER INDEX {quote_ident(self.schema)}.{quote_ident(old_name)} "
                        f"RENAME TO {quote_ident(new_name)}"
                    )
                for function in await fetch(
                    "old_functions",
                    {
                        "schema": tokens["schema"],
                        **{
                            suffix: f"{self.table}_{suffix}".lower()
                            for suffix in ("claim", "settle", "renew", "notify")
                        },
                    },
                ):
                    await conn.execute(f"DROP FUNCTION {function['signature']}")
                for migration in migrations("postgres", PARTITIONED):
                    await conn.execute(render(migration.sql, tokens))
                new_columns = [
                    row["name"] for row in await fetch("table_columns", {"table": tokens["outbox"]})
                ]
                # Columns a user added to the outbox: refused rather than copied. The column
                # alone would come over without its constraints, indexes, foreign keys or
                # triggers, and left behind its values would survive in the history table
                # only while writers that set it failed. Raised inside the transaction: the
                # rollback undoes the renames and the new table, nothing changes.
                if extra := [
                    f"{row['name']} ({row['type']})"
                    for row in await fetch("user_columns", {"plain": tokens["plain"]})
                    if row["name"] not in new_columns
                ]:
                    raise SchemaError(
                        f"the outbox {self.schema}.{self.table} has column(s) outboxer did not "
                        f"make: {', '.join(extra)}. The partitioned table would not have them "
                        "and their values would stay behind; nothing was changed. Copy them "
                        "to a table of your own and drop them, migrate, then add them to the "
                        "partitioned table (ALTER TABLE ... ADD COLUMN) and copy them back"
                    )
                columns = ", ".join(quote_ident(name) for name in new_columns)
                moved = await conn.execute(
                    render(sql["move_unfinished"], tokens | {"columns": columns})
                )
                await fetch("continue_sequence", {"outbox": tokens["outbox"]})
                await conn.execute(render(sql["forget_migrations"], tokens))
                for migration in migrations("postgres", PARTITIONED):
                    await conn.execute(
                        f"INSERT INTO {tokens['migrations']} (version, name) VALUES ($1, $2)",
                        migration.version,
                        migration.name,
                    )
                await conn.execute(render(sql["comment_plain"], tokens))
                # Partitions for the moved rows (out of the default partition) and ahead.
                report = PartitionReport()
                policy = PartitionPolicy(ahead=partitions_ahead, interval=partition_interval)
                await partitions.ensure(conn, policy, report, await partitions.now(conn))
                await refuse_if_relays_run()
        finally:
            await conn.close()
        return MigrationReport(
            moved=int(moved.rsplit(" ", 1)[-1]), kept_as=plain_raw, partitions=report.created
        )

    async def applied_migrations(self) -> set[int]:
        await self.connect()
        table = self.tokens()["migrations"]
        async with self._connection() as conn:
            if await conn.fetchval("SELECT to_regclass($1)", table) is None:
                return set()
            return {row["version"] for row in await conn.fetch(f"SELECT version FROM {table}")}

    async def layout(self) -> str | None:
        """``partitioned`` for the partitioned layout, else None (the default table, or none)."""
        await self.connect()
        async with self._connection() as conn:
            return PARTITIONED if await self._partitions().layout(conn) == "p" else None

    async def is_partitioned(self) -> bool:
        return await self.layout() == PARTITIONED

    async def maintain_partitions(
        self, policy: PartitionPolicy, *, now: dt.datetime | None = None
    ) -> PartitionReport:
        async with self._pool.acquire() as conn:
            return await self._partitions().maintain(conn, policy, now)

    async def partitions(self) -> list[Partition]:
        """The partitions of the partitioned layout, the default one first (none for the
        default table)."""
        async with self._pool.acquire() as conn:
            return await self._partitions().list(conn)

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
        sql, args = self._args(
            "claim",
            {
                "destination": destination,
                "relay_id": relay_id,
                "lease": lease.token,
                "limit": limit,
                "lock_seconds": float(lock_seconds),
                "abandoned_blocks": abandoned_blocks,
                "max_attempts": max_attempts,
                "recover": recover,
                "lock_key": self.lock_key(destination),
                "max_bytes": max_bytes,
            },
        )
        await self._release_unanswered(destination)
        try:
            rows = await self._deadlock_retried(
                "a claim", lambda: self._statement(lambda conn: conn.fetch(sql, *args))
            )
        except BaseException as exc:
            asyncpg = _asyncpg()
            if not isinstance(exc, asyncpg.PostgresError) or isinstance(
                exc, asyncpg.PostgresConnectionError
            ):
                # No answer (an error the server reported means it rolled back): the claim
                # may have committed, its rows held under a lease this relay never learnt.
                # Left there, they waited for the lock timeout, then went to recovery one a
                # claim, each charged an attempt it never made (abandoned at its last).
                self._unanswered.setdefault(destination, []).append((lease, recover))
            raise
        kinds = {row["taken"] for row in rows}
        taken = sorted((row for row in rows if row["taken"] in _TAKEN), key=_by_seq)
        if taken:
            self._wakeups.worked(len(taken), destination)
            if self._wakeups.registered and self._wakeups.busy:  # under load: poll
                self._stop_listening()
        messages, unreadable = read_rows(
            taken,
            lambda row: Message(
                id=row["id"],
                topic=row["topic"],
                payload=bytes(row["payload"]),
                key=row["key"],
                headers=parse_headers(row["headers"]),
                content_type=row["content_type"],
                destination=row["destination"],
                created_at=row["created_at"],
                attempts=row["attempts"],
                seq=row["seq"],
            ),
            lambda row, error: AbandonedRow(
                row_id(row["id"]), row["seq"], row["topic"], row["key"], row["attempts"], error
            ),
        )
        claim = Claim(
            messages,
            lease=lease,
            recovered="recovered" in kinds,
            recovery_waiting="recovery_waiting" in kinds,
            abandoned=[
                AbandonedRow(
                    row["id"],
                    row["seq"],
                    row["topic"],
                    row["key"],
                    row["attempts"],
                    row["last_error"],
                )
                for row in sorted((row for row in rows if row["taken"] == "abandoned"), key=_by_seq)
            ],
        )
        await self.abandon_unreadable(destination, claim, unreadable, max_attempts)
        return claim

    async def _release_unanswered(self, destination: str) -> None:
        """Give back the rows of this destination's claims that never answered, before the
        next claim (whose order they would otherwise hold up). A failure raises: the relay
        backs off as from a failed claim, and the leases are tried again next time."""
        # Even a lease that ran out: recovery would take its rows over one a claim, each
        # charged an attempt it never made, and a claim cut by command_timeout (60 s) has
        # always outlived the default lease (60 s). Rows someone took over since are not
        # matched (release_unanswered: lease and relay).
        pending = self._unanswered.pop(destination, [])
        if not pending:
            return
        lock_sql, _ = self._sql["destination_lock"]
        lock_key = self.lock_key(destination)
        leases: dict[str, tuple[list[str], list[str]]] = {}
        for lease, recover in pending:
            tokens, recovering = leases.setdefault(lease.relay_id, ([], []))
            tokens.append(lease.token)
            if recover:
                recovering.append(lease.token)

        async def release(conn: Any) -> int:
            released = 0
            async with conn.transaction():
                # First, in a statement of its own: the UPDATE's snapshot must come after
                # the wait (a claim that was waiting for the lock has committed by then).
                await conn.execute(lock_sql, lock_key)
                for relay_id, (tokens, recovering) in leases.items():
                    for name, of in (
                        ("expire_unanswered_recovery", recovering),
                        ("release_unanswered", tokens),
                    ):
                        if not of:
                            continue
                        sql, args = self._args(
                            name, {"destination": destination, "relay_id": relay_id, "leases": of}
                        )
                        released += _count(await conn.execute(sql, *args))
            return released

        try:
            released = await self._statement(release)
            if released:
                logger.warning(
                    "destination %s: %d message(s) taken by a claim whose answer was lost "
                    "(its connection broke) went back to the queue",
                    destination,
                    released,
                )
        except BaseException:
            self._unanswered.setdefault(destination, [])[:0] = pending
            raise

    async def renew(
        self, destination: str, lease: Lease, seqs: Sequence[int], lock_seconds: float
    ) -> int:
        sql, args = self._args(
            "renew",
            {
                "destination": destination,
                "relay_id": lease.relay_id,
                "lease": lease.token,
                "seqs": list(seqs),
                "lock_seconds": float(lock_seconds),
            },
        )
        return int(
            await self._deadlock_retried(
                "a renewal",
                lambda: self._statement(lambda conn: _refusing_data(conn.fetchval(sql, *args))),
            )
        )

    async def settle(
        self,
        destination: str,
        lease: Lease,
        published: Sequence[int],
        failed: Sequence[Failure],
        released: Sequence[int],
        max_attempts: int,
    ) -> SettleResult:
        sql, args = self._args(
            "settle",
            {
                "destination": destination,
                "relay_id": lease.relay_id,
                "lease": lease.token,
                "lock_key": self.lock_key(destination),
                "max_attempts": max_attempts,
                "published": list(published),
                "failed": [f.seq for f in failed],
                "errors": [f.error for f in failed],
                "delays": [float(f.delay) for f in failed],
                "permanent": [f.permanent for f in failed],
                "released": list(released),
            },
        )
        row = await self._deadlock_retried(
            "a settle",
            lambda: self._statement(lambda conn: _refusing_data(conn.fetchrow(sql, *args))),
        )
        result = SettleResult(
            published=row["n_published"], failed=row["n_failed"], released=row["n_released"]
        )
        expected = len(published) + len(failed) + len(released)
        result.lost = expected - result.published - result.failed - result.released
        return result

    async def _deadlock_retried(self, name: str, attempt: Callable[[], Awaitable[T]]) -> T:
        """``attempt()``, tried again when PostgreSQL chose its statement as a deadlock's
        victim (40P01), up to DEADLOCK_TRIES times after a short jittered pause.

        ``attempt`` must be a whole transaction, begun and ended inside it: the server
        answered with the error, so it rolled that transaction back whole, and trying it
        again from its first statement is safe. A claim, a settle or a renewal is one
        statement, its own transaction (a function call in autocommit; its lease token too:
        nothing under it was written). The relay's own statements form no lock cycle
        (migration 0014: a claim never waits for a row, and takes the destination lock
        before any other); someone else's transaction that locks outbox rows in another
        order can (an operator's, holding a row a settle waits for and then asking for one
        the settle holds). Raised to the relay, the deadlock was taken for an outage and
        backed off: a settle's rows stayed leased, and once the back-off outlasted the lease
        they were recovered, published again and charged an attempt.

        An operator's purge, requeue or replay is a transaction of several statements whose
        row locks follow its plan's order (a requeue's the status index's, a purge's the
        heap's, a replay's seq order): two of them over the same rows, or one beside a
        transaction of someone else's, can wait for each other, and the command failed with
        "deadlock detected" (exit 1; 503 from the HTTP API), having changed nothing. Each
        is tried again whole here; what a try does outside the database is its caller's to
        keep from happening twice (``replay``: ``made``). Not 40001: the pool pins READ
        COMMITTED, where no serialization failure arises (the claim function and the settles
        rely on it, see connect)."""
        asyncpg = _asyncpg()
        for tried in range(1, DEADLOCK_TRIES + 1):
            try:
                return await attempt()
            except asyncpg.DeadlockDetectedError:
                if tried == DEADLOCK_TRIES:
                    raise
                logger.info("PostgreSQL: %s chosen as a deadlock's victim; trying it again", name)
                await asyncio.sleep(random.uniform(0.01, 0.05) * tried)
        raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises

    async def _operators_deadlock_retried(
        self, name: str, attempt: Callable[[], Awaitable[T]]
    ) -> T:
        """``_deadlock_retried`` for an operator's purge, requeue or replay; a deadlock that
        outlasts every try is a StoreError saying so. Raised as asyncpg's error it was an
        unexpected failure everywhere but the HTTP API: the CLI pointed at a traceback
        ("run with --log-level DEBUG"), Django admin's requeue action, which reports
        outboxer's errors as a message, answered with a server error (500). MySQL's is a
        StoreError already. The relay's claims and settles keep asyncpg's (an outage)."""
        asyncpg = _asyncpg()
        try:
            return await self._deadlock_retried(name, attempt)
        except asyncpg.DeadlockDetectedError as exc:
            raise StoreError(
                f"PostgreSQL chose {name} as a deadlock's victim on each of its "
                f"{DEADLOCK_TRIES} tries ({exc}), each rolled back whole: run it again"
            ) from exc

    async def cleanup(self, status: str, retention: float, limit: int) -> int:
        sql, args = self._args(
            "cleanup", {"status": status, "retention": float(retention), "limit": limit}
        )
        async with self._connection() as conn:
            return _count(await conn.execute(sql, *args))

    async def cleanup_inbox(self, retention: float, limit: int) -> int:
        params = {"retention": float(retention), "limit": limit}
        sql, args = self._args("inbox_cleanup", params)
        suspects_sql, suspects_args = self._args("inbox_suspects_cleanup", params)
        async with self._connection() as conn:
            # Each statement its own transaction, bounded by :limit; the sum is >= limit
            # while either table may hold more, so the caller's batch loop goes on.
            deleted = _count(await conn.execute(sql, *args))
            return deleted + _count(await conn.execute(suspects_sql, *suspects_args))

    # ----- operations ----------------------------------------------------------------------

    async def status(self) -> list[DestinationStatus]:
        async with self._connection() as conn:
            partitioned = await self._partitions().layout(conn) == "p"
            stats_sql, _ = self._args(
                "status_stats_partitioned" if partitioned else "status_stats", {}
            )
            stats = await conn.fetchrow(stats_sql)
            rows = _estimated_rows(stats)
            rows_by_destination = _rows_by_destination(stats)
            if rows is None or rows_by_destination is None or rows <= self.exact_status_rows:
                sql, _ = self._args("counts", {})
                return fold_counts(await conn.fetch(sql))
            sql, _ = self._args("counts_tally", {})
            counted = fold_counts(await conn.fetch(sql))
        # A destination ANALYZE did not see (new since, or too rare for its sample) gets
        # the share the planner would give it.
        for entry in counted:
            if entry.destination not in rows_by_destination:
                rows_by_destination[entry.destination] = _rare_destination_rows(stats)
        first_attempts = {
            entry.destination: rows_by_destination[entry.destination] - sum(entry.counts.values())
            for entry in counted
        }
        for destination, rows in rows_by_destination.items():
            first_attempts.setdefault(destination, rows)
        return with_published_estimates(counted, first_attempts)

    async def status_report(self) -> dict[str, Any]:
        """As every store's, plus, for the partitioned layout, its partitions: how many,
        the time they cover, and the rows waiting in the default partition (more than none
        means the cleanup that makes partitions has not run for a while)."""
        report = await super().status_report()
        async with self._connection() as conn:
            if await self._partitions().layout(conn) != "p":
                return report
            partitions = [p for p in await self._partitions().list(conn) if p.lower]
            waiting = await conn.fetchval(
                f"SELECT count(*) FROM {self.tokens()['default_partition']}"
            )
        report["partitions"] = {
            "count": len(partitions),
            "from": partitions[0].lower.isoformat() if partitions and partitions[0].lower else None,
            "to": partitions[-1].upper.isoformat() if partitions and partitions[-1].upper else None,
            "default_partition_rows": int(waiting),
        }
        return report

    async def ping(self) -> None:
        await self.connect()
        async with self._connection() as conn:
            await conn.fetchval("SELECT 1")

    async def oldest_transaction(self) -> float:
        """Seconds the oldest open writing transaction has run (it may hold a key's lock)."""
        sql, args = self._args("oldest_transaction", {})
        async with self._connection() as conn:
            return float(await conn.fetchval(sql, *args) or 0.0)

    async def list_messages(self, statuses: Sequence[str], limit: int) -> list[dict[str, object]]:
        sql, args = self._args("list", {"statuses": list(statuses), "limit": limit})
        async with self._connection() as conn:
            return [dict(row) for row in await conn.fetch(sql, *args)]

    async def requeue(
        self, destinations: Sequence[str], statuses: Sequence[str], ids: Sequence[str] | None
    ) -> int:
        sql, args = self._args(
            "requeue",
            {
                "destinations": list(destinations),
                "statuses": list(statuses),
                "ids": [uuid.UUID(i) for i in ids] if ids is not None else None,
            },
        )
        lock_sql, _ = self._sql["destination_lock"]

        async def requeue_once() -> int:
            async with self._pool.acquire() as conn, conn.transaction():
                await _durably(conn)
                # In name order, as purge and requeue_matching take them (admin.sql: purge):
                # two requeues naming them in opposite orders, with claims queued for the
                # exclusive locks between them, could otherwise deadlock.
                for destination in sorted(set(destinations)):
                    await conn.execute(lock_sql, self.lock_key(destination))
                return _count(await conn.execute(sql, *args))

        # Its rows are locked in its plan's order, which a purge's may cross (see
        # _deadlock_retried).
        return await self._operators_deadlock_retried("a requeue", requeue_once)

    # ----- wake-ups ------------------------------------------------------------------------

    def configure_wakeups(
        self, *, wake_on_commit_below: float, busy_poll_interval: float | None = None
    ) -> None:
        self._wakeups.wake_on_commit_below = wake_on_commit_below
        if busy_poll_interval is not None:
            self._wakeups.busy_poll = busy_poll_interval

    def reset_wakeup(self, destination: str) -> None:
        # The claim that follows sees everything committed before this point.
        self._wakeups.reset(destination)

    def nudge(self, destination: str) -> None:
        """Wake one of the destination's waiting loops (a loop that found a full batch)."""
        self._wakeups.nudge(destination)

    async def _ensure_listener(self) -> None:
        if self._listener is not None and not self._listener.is_closed():
            return
        asyncpg = _asyncpg()
        self._listener = await asyncpg.connect(
            asyncpg_dsn(self.url),
            server_settings={
                "application_name": "outboxer-relay-listen",
                # The server gives up too: a statement asyncpg gave up on is cancelled by a
                # request of its own, which the listener's termination (_drop_listener)
                # abandons, so its session waited on (for a lock: until it was released),
                # one more after each failed registration, up to max_connections. Idle
                # waits for a NOTIFY are no statement.
                "statement_timeout": str(max(1, round(self.listener_timeout * 1000))),
            },
            timeout=self.listener_timeout,
            command_timeout=self.listener_timeout,
        )
        # Its backend counts among the relay's sessions (relays_connected: `schema
        # migrate-partitioned` refuses to run) and holds a connection slot: without
        # keepalives one whose relay host vanished stayed over two hours, as the pool's did.
        # A round trip per listener connect (the relay's life, or after a lost one).
        await _keep_alive(self._listener)
        await self._listener.add_listener(self.channel, self._on_notify)
        # Cut by the server (pg_terminate_backend, a restart), it hears no more NOTIFYs and
        # the loops waiting on it slept their whole wait while rows came: wake them, the
        # next wait listens anew (and its nudge covers what was committed meanwhile).
        self._listener.add_termination_listener(self._on_listener_lost)
        # Anything committed before LISTEN took effect was not announced: look once.
        self._wakeups.nudge_all()

    def _on_listener_lost(self, conn: Any) -> None:
        # Not one this store closes or dropped (a failed registration) itself.
        if conn is self._listener and not self._closing:
            self._listener = None
            self._wakeups.nudge_all()

    async def _drop_listener(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None and not listener.is_closed():
            listener.terminate()  # it may be broken: do not wait for a goodbye

    def _on_notify(self, *_: object) -> None:
        # A NOTIFY does not say which destinations the commit wrote rows for.
        self._wakeups.nudge_all()

    async def wait_for_wakeup(self, destination: str, timeout: float) -> bool:
        """Wait for work: by polling while the relay is busy, else for a NOTIFY (or the timeout).

        A NOTIFY holds a cluster-wide lock through the writer's commit, WAL flush included,
        so writers that notify commit one at a time. Writers notify only while a relay is
        registered as listener (migration 0003). Below ``wake_on_commit_below`` messages/s
        claimed the relay stays registered and each commit wakes it; under load it is busy
        after each claim that found work (see stores.wakeups): one loop of each destination
        polls, and such a claim withdraws the registration. Under a heavy stream of writes
        nobody notifies; a moderate one is announced commit by commit, and a NOTIFY wakes a
        loop of every destination.

        Right after a fresh registration this returns at once, so the relay looks for work
        once more: a writer that committed just before the registration did not notify.

        In a relay of several destinations, the loop of a quiet one (stores.wakeups) goes on
        waiting when woken while nothing is due for its destination (``_due``): a NOTIFY
        wakes every destination, and the chase polls them all. The loop claims once
        something is due, or the timeout passed (the relay's fallback poll).
        """
        wakeups = self._wakeups
        wakeups.seen(destination)
        if not (wakeups.several_destinations and wakeups.quiet(destination)):
            return await self._wait_once(destination, timeout)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            woken = await self._wait_once(destination, timeout, on_tick=True)
            if woken and (not wakeups.quiet(destination) or await self._due(destination)):
                return True
            timeout = deadline - loop.time()
            if timeout <= 0:
                return False

    async def _wait_once(self, destination: str, timeout: float, *, on_tick: bool = False) -> bool:
        wakeups = self._wakeups
        if wakeups.busy:
            return await wakeups.chase(destination, timeout, on_tick=on_tick)
        try:
            async with self._listener_lock:
                await self._ensure_listener()
                registered_before = wakeups.registered
                if wakeups.registration_due(timeout):  # renew before it lapses
                    sql, args = self._args(
                        "register_listener",
                        {
                            "relay": self._listener_name,
                            "seconds": wakeups.registration_seconds(timeout),
                        },
                    )
                    await self._listener.execute(sql, *args)
                    wakeups.registered_for(timeout)
            if not registered_before:
                return True
        except Exception as exc:  # noqa: BLE001 -- asyncpg's errors too: poll instead, never stop the relay
            wakeups.withdraw()
            await self._drop_listener()
            logger.warning("cannot LISTEN for wake-ups, polling instead: %s", exc, exc_info=False)
        woken = await wakeups.wait(destination, timeout)
        if not woken and timeout >= QUIET_WAIT:
            # Quiet for a whole wait: the pool looks after idle connections. Not after a
            # short one (the relay's grace after a batch): a release is a round trip.
            await self._return_kept()
        return woken

    async def _due(self, destination: str) -> bool:
        """Whether ``destination`` has a row a claim could take (queries.sql: due_destinations).

        One statement answers the loops of every destination that asks in this turn of the
        event loop (a NOTIFY wakes them all in one turn, the chase's ticks too). Each loop
        forgets its nudges before the statement is sent: a commit its snapshot misses
        notifies after that, and wakes the loop again. A failed question is no outage of
        its own: the loops claim, and the claim meets (and reports) what failed.
        """
        self._wakeups.reset(destination)
        probe = self._forming_probe
        if probe is not None:
            probe.destinations.add(destination)
            return destination in await asyncio.shield(probe.answer)
        probe = self._forming_probe = _DueProbe({destination})
        try:
            try:
                await asyncio.sleep(0)  # the loops woken with this one join
            finally:
                self._forming_probe = None
            sql, args = self._args("due_destinations", {"destinations": sorted(probe.destinations)})
            rows = await self._statement(lambda conn: conn.fetch(sql, *args))
        except Exception as exc:  # noqa: BLE001 -- asyncpg's errors too: the claims report them
            logger.debug("due_destinations failed, claiming: %s", exc)
            probe.answer.set_result(probe.destinations)
            return True
        except BaseException:  # cancelled (the relay stops): the others claim
            probe.answer.set_result(probe.destinations)
            raise
        due = {row["destination"] for row in rows}
        probe.answer.set_result(due)
        return destination in due

    def _stop_listening(self) -> None:
        """Withdraw this relay's idle registration (it is busy), in the background."""
        self._wakeups.withdraw()
        # Quiet destinations' loops wait for a NOTIFY that no writer sends now: they chase.
        self._wakeups.nudge_quiet()
        if self._unregistering is None or self._unregistering.done():
            self._unregistering = asyncio.get_running_loop().create_task(self._unregister())

    async def _unregister(self) -> None:
        try:
            async with self._listener_lock:
                listener = self._listener
                if listener is None or listener.is_closed() or self._wakeups.registered:
                    return  # no listener, or registered again since
                sql, args = self._args("unregister_listener", {"relay": self._listener_name})
                await listener.execute(sql, *args)
        except Exception as exc:  # noqa: BLE001 -- asyncpg's errors too; the registration lapses anyway
            logger.info("could not withdraw the idle registration (it lapses by itself): %s", exc)

    # ----- operators' changes by filter (outboxer.admin; SQL in admin.sql) ----------------

    @functools.cached_property
    def _admin_sql(self) -> dict[str, tuple[str, tuple[str, ...]]]:
        tokens = self.tokens()
        return {
            name: to_numbered(render(sql, tokens))
            for name, sql in admin_queries("postgres").items()
        }

    def _admin(self, name: str, where: MessageFilter, **extra: Any) -> list[Any]:
        """The admin statement ``name`` and its arguments, ready to unpack into a call."""
        sql, names = self._admin_sql[name]
        params = {**_filter_params(where), **extra}
        return [sql, *(params[n] for n in names)]

    async def count_matching(self, where: MessageFilter) -> dict[str, dict[str, int]]:
        await self.connect()
        async with self._pool.acquire() as conn:
            rows = await conn.fetch(*self._admin("count_matching", where))
        counts: dict[str, dict[str, int]] = {}
        for row in rows:
            counts.setdefault(row["destination"], {})[row["status"]] = int(row["count"])
        return counts

    async def _under_destination_locks(
        self, name: str, where: MessageFilter, then: str | None = None
    ) -> tuple[int, int]:
        """Run the admin statement ``name`` in one durable transaction, under the shared lock
        of every destination it may change (admin.sql: purge): the rows it changed, and the
        value the read ``then`` finds after it, in the transaction (0 without one).

        Chosen as a deadlock's victim (a requeue and a purge over the same rows, each
        locking them in its own plan's order; or someone else's transaction), the whole
        transaction is tried again, the destinations read anew: an operator's `purge` or
        `requeue` failed with "deadlock detected" and changed nothing."""
        return await self._operators_deadlock_retried(
            _ADMIN_NAMES.get(name, name),
            lambda: self._under_destination_locks_once(name, where, then),
        )

    async def _under_destination_locks_once(
        self, name: str, where: MessageFilter, then: str | None
    ) -> tuple[int, int]:
        await self.connect()
        lock_sql, _ = self._sql["destination_lock"]
        async with self._pool.acquire() as conn:
            # Read before the transaction, not in it: its first lock must be a destination's,
            # as a claim's is (then the table's). Read in it, the table's ACCESS SHARE was
            # held while waiting for a claim's destination lock, the claim waited for the
            # table behind the partition upkeep's ACCESS EXCLUSIVE, and the upkeep for that
            # ACCESS SHARE: a deadlock, broken only by lock_timeout or deadlock_timeout,
            # writers stalled meanwhile. Nothing is lost: the statement changes only rows of
            # the destinations it locked, and one that gained its first matching row since
            # is left for the next run, as before.
            found = await conn.fetch(*self._admin("destinations_matching", where))
            locked = [row["destination"] for row in found]
            async with conn.transaction():
                await _durably(conn)
                for destination in locked:
                    await conn.execute(lock_sql, self.lock_key(destination))
                if name == "purge":
                    # An operator's deletion, by filter, never by ctid: the partitioned
                    # layout's guard against DELETE (its migration 0001) lets this one through.
                    await conn.execute("SELECT set_config('outboxer.allow_delete', 'on', true)")
                changed = _count(await conn.execute(*self._admin(name, where, locked=locked)))
                read = 0 if then is None else int(await conn.fetchval(*self._admin(then, where)))
                return changed, read

    async def purge(self, where: MessageFilter) -> int:
        return (await self._under_destination_locks("purge", where))[0]

    async def requeue_matching(self, where: MessageFilter) -> int:
        return (await self.requeue_matching_counted(where))[0]

    async def requeue_matching_counted(self, where: MessageFilter) -> tuple[int, int]:
        return await self._under_destination_locks(
            "requeue_matching", where, then="count_requeue_deferred"
        )

    async def count_requeue_deferred(self, where: MessageFilter) -> int:
        await self.connect()
        async with self._pool.acquire() as conn:
            return int(await conn.fetchval(*self._admin("count_requeue_deferred", where)))

    async def replay(
        self, where: MessageFilter, copy: Callable[[Sequence[Message]], list[Message]]
    ) -> int:
        """Copy the originals ``where`` matches, in one transaction (admin.sql:
        replay_originals).

        PostgreSQL may choose it as a deadlock's victim (40P01): it holds its originals FOR
        SHARE as its cursor reads them, in seq order, and a purge deleting them in its
        plan's order, or someone else's transaction locking them in another order, meets
        it; the operator's `replay` failed with "deadlock detected". The whole transaction
        was rolled back, so it is tried again (``_deadlock_retried``), as MySQL's is. The
        copier's work outside the database is not repeated (``made``, see
        base.copied_once): a try inserts the claim-checked copies an earlier one made of
        the originals it reads again, so their objects are put once, and a shredded
        original is counted once. The copies' ids were never committed, so inserting them
        again is inserting them once."""
        made: dict[int, list[Message]] = {}
        return await self._operators_deadlock_retried(
            "a replay", lambda: self._replay_once(where, copy, made)
        )

    async def _replay_once(
        self,
        where: MessageFilter,
        copy: Callable[[Sequence[Message]], list[Message]],
        made: dict[int, list[Message]],
    ) -> int:
        from outboxer.admin import REPLAY_PAGE
        from outboxer.enqueue import Outbox, detect

        await self.connect()
        outbox = Outbox(schema=self.schema, table=self.table)
        inserted = 0
        async with self._pool.acquire() as conn, conn.transaction():
            await _durably(conn)
            keys = await conn.fetchrow(
                *self._admin("replay_key_locks", where, max_key_locks=outbox.max_key_locks)
            )
            # Too many keys to lock one by one (admin.sql: replay_key_locks): lock the table.
            key_locks = keys["keys"] == keys["locked"]
            if not key_locks:
                await conn.execute(outbox._sql("postgres", "table_lock"))
            originals = await conn.cursor(*self._admin("replay_originals", where))
            while rows := await originals.fetch(REPLAY_PAGE):
                copies = await asyncio.to_thread(
                    copied_once, copy, [_original(row) for row in rows], made
                )
                if copies:
                    await detect(conn).write_async(outbox, conn, copies, key_locks=key_locks)
                    inserted += len(copies)
        return inserted


@dataclass(frozen=True)
class MigrationReport:
    """What ``migrate_to_partitioned`` did."""

    #: Rows copied into the partitioned table (every one not PUBLISHED).
    moved: int
    #: The old table's new name: its history, to drop once past retention.
    kept_as: str
    partitions: list[str]


async def _refusing_data(statement: Awaitable[T]) -> T:
    """Await ``statement``; a data error or a violated constraint (SQLSTATE classes 22 and
    23, or an argument asyncpg cannot encode) becomes StoreDataError: no outage, and the
    same statement would fail again."""
    asyncpg = _asyncpg()
    try:
        return await statement
    except (asyncpg.DataError, asyncpg.IntegrityConstraintViolationError) as exc:
        raise StoreDataError(f"PostgreSQL refused the values: {exc}") from exc


async def _durably(conn: Any) -> None:
    """This transaction's commit waits for the WAL flush (the pool's default does not)."""
    await conn.execute("SET LOCAL synchronous_commit = on")


#: The admin statements of _under_destination_locks as its deadlock retry's log names them.
_ADMIN_NAMES = {"purge": "a purge", "requeue_matching": "a requeue"}

#: A wait for wake-ups this long that nobody cut short gives the kept connections back.
QUIET_WAIT = 0.5


@dataclass
class _DueProbe:
    """One due_destinations question: the destinations that asked, and its answer."""

    destinations: set[str]
    answer: asyncio.Future[set[str]] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


#: What the claim function says it did with the rows it returns that it took.
_TAKEN = ("claimed", "recovered")


def _estimated_rows(stats: Any) -> float | None:
    """The table's rows now as the planner estimates them: the density VACUUM or ANALYZE
    last saw (rows per page) times the pages the table has now; None if neither ever ran."""
    reltuples, relpages, pages = float(stats["reltuples"]), int(stats["relpages"]), stats["pages"]
    if reltuples < 0 or (relpages == 0 and pages > 0):
        return None
    return reltuples * pages / relpages if relpages else 0.0


def _rows_by_destination(stats: Any) -> dict[str, float] | None:
    """Estimated rows of each destination ANALYZE found common (every one, unless there are
    more than its statistics target): the table's estimated rows times the destination's
    share in ANALYZE's sample. None when there are no statistics to estimate from."""
    total = _estimated_rows(stats)
    if total is None or stats["destinations"] is None:
        return None
    return {
        destination: total * share
        for destination, share in zip(stats["destinations"], stats["shares"], strict=True)
    }


def _rare_destination_rows(stats: Any) -> float:
    """Estimated rows of a destination not among ANALYZE's common values: the rows that are
    none of those, shared evenly among the other distinct destinations (the planner's rule)."""
    total = _estimated_rows(stats) or 0.0
    rest = max(0.0, 1.0 - float(stats["null_frac"]) - sum(float(s) for s in stats["shares"]))
    distinct = float(stats["n_distinct"])
    if distinct < 0:  # a share of the rows, not a number of values
        distinct = -distinct * total
    others = max(distinct - len(stats["destinations"]), 1.0)
    return total * rest / others


def _by_seq(row: Any) -> int:
    return int(row["seq"])


def _count(command_tag: str) -> int:
    """Rows affected, from a command tag like ``UPDATE 12`` or ``DELETE 3``."""
    return int(command_tag.rsplit(" ", 1)[-1])


def _original(row: Any) -> Message:
    """A PUBLISHED row a replay copies, as a Message."""
    return Message(
        id=row["id"],
        topic=row["topic"],
        payload=bytes(row["payload"]),
        key=row["key"],
        headers=parse_headers(row["headers"]),
        content_type=row["content_type"],
        destination=row["destination"],
        created_at=row["created_at"],
        seq=row["seq"],
    )


def _filter_params(where: MessageFilter) -> dict[str, Any]:
    """A MessageFilter as admin.sql's filter parameters (None: the criterion is left out)."""

    def listed(values: tuple[Any, ...] | None) -> list[Any] | None:
        return list(values) if values is not None else None

    return {
        "statuses": listed(where.statuses),
        "ids": listed(where.ids),
        "destinations": listed(where.destinations),
        "topics": listed(where.topics),
        "keys": listed(where.keys),
        "older_than": where.older_than,
        "created_after": where.created_after,
        "created_before": where.created_before,
        "error": where.error,
    }
