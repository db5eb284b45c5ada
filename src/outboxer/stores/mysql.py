"""MySQL and MariaDB store for the relay, on aiomysql (MySQL 8.0.13+, MariaDB 10.6+).

URL: ``mysql://user:password@host:3306/database`` (also ``mysql+pymysql://``,
``mysql+aiomysql://``, ``mariadb://``). The tables live in the URL's database: MySQL's
schemas are databases, so the ``schema`` setting plays no part here.

What differs from PostgreSQL, and why:

* No UPDATE ... RETURNING in MariaDB: a claim is one transaction of four statements
  (destination lock, ``SELECT ... FOR UPDATE SKIP LOCKED``, UPDATE, COMMIT).
* The destination lock is a row of ``<table>_destinations`` (GET_LOCK is held by the
  session, not the transaction, and has no shared mode); the write path's key lock is one
  of the 65536 rows of ``<table>_key_slots``. See migrations 0001 and 0005, queries.sql.
* No LISTEN/NOTIFY: an idle relay probes a cheap mark of the PENDING rows every
  ``WAKE_PROBE_INTERVAL`` (queries.sql, pending_mark) and claims when it changes, so a
  commit is seen within ~50 ms, not only at the next poll.

The write path (``outboxer.enqueue``) does not use this class: it runs the ``key_lock``
and ``insert`` queries on the caller's own PyMySQL, aiomysql or SQLAlchemy connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import parse_qsl, unquote, urlsplit

from outboxer.config import Settings, float_option
from outboxer.errors import ConfigError, MissingDependencyError, StoreError
from outboxer.message import Message
from outboxer.redact import get_logger, redact_url
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
    estimate_from_sample,
    fold_counts,
    parse_headers,
    read_rows,
    refuse_foreign_tables,
    row_id,
    sample_seqs,
    with_published_estimates,
)
from outboxer.stores.mysql_tls import SSL_OPTIONS, hook_aiomysql, refuse_plaintext, ssl_args
from outboxer.stores.sqlfiles import (
    admin_queries,
    migrations,
    queries,
    quote_mysql,
    render,
    statements,
    strip_comments,
    to_pyformat,
)

if TYPE_CHECKING:
    from outboxer.admin import MessageFilter

logger = get_logger("outboxer.store")
R = TypeVar("R")

_MIGRATIONS_TABLE = """
CREATE TABLE IF NOT EXISTS {migrations} (
    version    INT NOT NULL,
    name       VARCHAR(255) NOT NULL,
    applied_at DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    PRIMARY KEY (version)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
"""

#: Seconds between two wake-up probes of an idle relay: the latency floor on MySQL.
WAKE_PROBE_INTERVAL = 0.05

#: Every relay session: each statement reads what was committed when it started.
_SESSION_SETUP = "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED"

#: Every pool session, once, after ``_SESSION_SETUP`` (a statement of its own: SET TRANSACTION
#: takes no other assignment, and the isolation variable's name differs between MySQL 8 and
#: MariaDB before 11.1): no row limit on a SELECT without LIMIT, whatever the server's or
#: the user's sql_select_limit (a DBA's guard against huge result sets). With one of 5 the
#: schema's applied versions read back five of six: ``schema apply`` ran the sixth again
#: and failed on its own record (duplicate entry), the relay refused to start (the schema
#: "lacks" it), and the admin's listings came back cut short. Its default, the largest
#: value, on both servers (``DEFAULT`` would be the server's global value).
_SESSION_PINS = "SET SESSION sql_select_limit = 18446744073709551615"

#: Seconds ``apply_schema`` waits for another process applying the schema.
_SCHEMA_LOCK_WAIT = 60

#: Seconds a statement, a COMMIT or the opening of a connection may take before it is given
#: up (StoreError, the connection closed): aiomysql has no read timeout, so a database that
#: stopped answering (a stalled network, a proxy that accepts and never answers) held the
#: relay's claims, settles and cleanup, an HTTP request or an admin command for ever. A
#: minute, as asyncpg's command_timeout on PostgreSQL; InnoDB's lock waits (50 s by default)
#: answer first. Schema changes are not bounded: DDL on a big table takes what it takes.
STATEMENT_TIMEOUT = 60.0


class NoAnswerError(StoreError):
    """MySQL did not answer a statement, a COMMIT or a connect within ``statement_timeout``."""


def schema_lock_name(database: str, table: str) -> str:
    """The GET_LOCK name of the schema changes of ``table`` (Django's migrations take it too);
    MySQL caps lock names at 64 characters."""
    return f"outboxer:schema:{database}.{table}"[:64]


#: MySQL error numbers.
ER_DUP_ENTRY = 1062
ER_ACCESS_DENIED = (1227, 1142)
#: A CHECK constraint refused a row: MySQL's number and MariaDB's (PyMySQL knows neither,
#: so it raises them as OperationalError, its class for every number it does not map).
ER_CHECK_CONSTRAINT = (3819, 4025)
#: The server refuses writes: it is no primary (a failover demoted it and fenced it with
#: ``read_only``, or the URL names a replica or a reader endpoint). ER_OPTION_PREVENTS_STATEMENT
#: (``--read-only``, MySQL's ``--super-read-only``; the relay's statements meet no other
#: option that refuses them), ER_CANT_EXECUTE_IN_READ_ONLY_TRANSACTION (a session that
#: inherited ``transaction_read_only``), ER_READ_ONLY_MODE, ER_INNODB_READ_ONLY. The same
#: numbers in MySQL and MariaDB.
ER_READ_ONLY = (1290, 1792, 1836, 1874)

_SCHEMES = (
    "mysql",
    "mysql+pymysql",
    "mysql+aiomysql",
    "mariadb",
    "mariadb+pymysql",
    "mariadb+aiomysql",
)


def _aiomysql() -> Any:
    try:
        import aiomysql
    except ImportError as exc:
        raise MissingDependencyError("aiomysql", "mysql") from exc
    return aiomysql


def mysql_connect_args(url: str) -> dict[str, Any]:
    """``mysql://user:password@host:3306/db?unix_socket=/path`` -> PyMySQL ``connect`` arguments."""
    parts = urlsplit(url)
    if parts.scheme.lower() not in _SCHEMES:
        raise ConfigError(
            f"not a MySQL URL: {redact_url(url)!r} (expected mysql://user:password@host:3306/db)"
        )
    database = unquote(parts.path.lstrip("/"))
    if not database or "/" in database:
        raise ConfigError(
            f"a MySQL URL names one database: mysql://user@host:3306/db, got {redact_url(url)!r}"
        )
    args: dict[str, Any] = {
        "host": parts.hostname or "localhost",
        "port": parts.port or 3306,
        "password": unquote(parts.password) if parts.password else "",
        "database": database,
        "charset": "utf8mb4",
    }
    if parts.username:
        args["user"] = unquote(parts.username)
    tls: dict[str, str] = {}
    for name, value in parse_qsl(parts.query):
        if name in ("unix_socket", "read_default_file", "read_default_group"):
            args[name] = value
        elif name in SSL_OPTIONS:
            tls[name] = value
        elif name == "connect_timeout":
            # A ConfigError, not float()'s ValueError; nan, 0 and negatives failed every
            # connect as "Can't connect to MySQL server", inf never gave up on a dead host.
            args["connect_timeout"] = float_option(
                value, "MySQL URL option connect_timeout", 0.001, 3600
            )
        else:
            raise ConfigError(
                f"unknown option {name!r} in the MySQL URL; known: unix_socket, "
                f"connect_timeout, read_default_file, read_default_group, {', '.join(SSL_OPTIONS)}"
            )
    if "read_default_file" in args or "read_default_group" in args:
        # PyMySQL reads host, port and password from the option file only where no argument
        # gives them (aiomysql's file wins anyway): pass the URL's own, not the defaults.
        given = {"host": parts.hostname, "port": parts.port, "password": parts.password}
        for name in [name for name, value in given.items() if not value]:
            del args[name]
    args.update(ssl_args(tls))
    return args


#: A pending_mark reading: the newest PENDING row's updated_at (None: none is PENDING),
#: the last seq, the rows among the last seqs (queries.sql).
_Mark = tuple[datetime | None, int, int]


#: Inbox entries deleted a statement (inbox_cleanup): the derived table that names them is
#: about 100 bytes an entry.
_INBOX_DELETE_SLICE = 1000


def expand_lists(sql: str, params: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """List parameters -> one placeholder per item (PyMySQL escapes no lists):
    ``IN (%(seqs)s)`` with three seqs -> ``IN (%(seqs_0)s, %(seqs_1)s, %(seqs_2)s)``."""
    flat: dict[str, Any] = {}
    for name, value in params.items():
        if isinstance(value, list | tuple):
            if not value:
                raise ValueError(f"list parameter {name!r} is empty")
            sql = sql.replace(
                f"%({name})s", ", ".join(f"%({name}_{i})s" for i in range(len(value)))
            )
            flat.update({f"{name}_{i}": item for i, item in enumerate(value)})
        else:
            flat[name] = value
    return sql, flat


def _utc(value: datetime | None) -> datetime | None:
    """DATETIME(6) values come back naive; they are UTC."""
    return value.replace(tzinfo=UTC) if value is not None else None


def without_overtaking(
    claimed: Sequence[Mapping[str, Any]], earlier: Sequence[Mapping[str, Any]]
) -> list[Mapping[str, Any]]:
    """The claimed rows (in seq order) that no unfinished row of their key outside the batch
    precedes (see queries.sql: claim_earlier); the others stay unclaimed, their locks end
    with the transaction."""
    taken = {row["seq"] for row in claimed}
    first_outside: dict[str, int] = {}
    for row in earlier:
        if row["seq"] not in taken:
            key = row["key"]
            first_outside[key] = min(row["seq"], first_outside.get(key, row["seq"]))
    return [
        row
        for row in claimed
        if row["key"] not in first_outside or row["seq"] < first_outside[row["key"]]
    ]


class MySQLStore(Store):
    dialect = "mysql"
    migrations_table_sql = _MIGRATIONS_TABLE

    def __init__(
        self, url: str, *, schema: str = "outboxer", table: str = "outbox", pool_size: int = 10
    ) -> None:
        super().__init__(url, schema=schema, table=table)
        self.connect_args = mysql_connect_args(url)
        self.pool_size = pool_size
        self.statement_timeout = STATEMENT_TIMEOUT
        #: The transactions under way, and the timer that gives up their hung round trips.
        self._in_transaction: set[_RoundTrips] = set()
        self._watchdog: asyncio.TimerHandle | None = None
        self._pool: Any = None
        #: The latest pending_mark reading, shared by the waiting loops; and per destination
        #: the last one any of its waiting loops saw (every claim after that reading sees the
        #: rows it counts), and whether a loop was nudged.
        self._reading: _Mark | None = None
        self._marks: dict[str, _Mark] = {}
        #: With loops of several destinations waiting: the destinations the latest reading
        #: asked due_destinations for, and those of them it found due (see _probe).
        self._asked: frozenset[str] = frozenset()
        self._found_due: frozenset[str] = frozenset()
        self._waiting_destinations: set[str] = set()
        self._nudged: set[str] = set()
        self._probe_lock = asyncio.Lock()
        self._probed_at = 0.0
        #: Per destination, the claims whose COMMIT got no answer (the connection broke, or
        #: the claim was cancelled): their lease, seqs, and whether they recovered an expired
        #: row. The COMMIT may have reached the server: the rows then wait in flight for
        #: nobody (see _release_unanswered).
        self._unanswered: dict[str, list[tuple[Lease, list[int], bool]]] = {}
        #: Read-only answers so far, and per pool connection how many there had been when
        #: it was first handed out (see _acquire): one made before the latest reaches the
        #: server that gave it, or the address that led there.
        self._read_only_answers = 0
        self._made_after: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        tokens = self.tokens()
        self._sql = {
            name: to_pyformat(strip_comments(render(sql, tokens)))
            for name, sql in queries("mysql").items()
        }

    def tokens(self) -> dict[str, str]:
        # No schemas: the tables live in the URL's database (see the module docstring).
        return {
            "table_raw": self.table,
            "outbox": quote_mysql(self.table),
            "migrations": quote_mysql(self.table + "_migrations"),
            "destinations": quote_mysql(self.table + "_destinations"),
            "keys": quote_mysql(self.table + "_keys"),
            "key_slots": quote_mysql(self.table + "_key_slots"),
            "inbox": quote_mysql("inbox"),
            "dead_letters": quote_mysql("dead_letters"),
            "inbox_suspects": quote_mysql("inbox_suspects"),
        }

    def record_migration_sql(self, table: str, version: int, name: str) -> str:
        return f"INSERT IGNORE INTO {table} (version, name) VALUES ({version}, '{name}');"

    # ----- connections ---------------------------------------------------------------------

    async def connect(self) -> None:
        if self._pool is not None:
            return
        aiomysql = _aiomysql()
        from pymysql.constants import CLIENT

        args = dict(self.connect_args)
        args["db"] = args.pop("database")
        # aiomysql has no such argument, and uses TLS only when given a context.
        args.pop("ssl_disabled", None)
        if "ssl" in args:
            hook_aiomysql()  # the refusal before the login, not after
        bound = asyncio.timeout(self.statement_timeout)
        try:
            async with bound:
                self._pool = await aiomysql.create_pool(
                    minsize=1,
                    maxsize=self.pool_size,
                    autocommit=False,
                    init_command=_SESSION_SETUP,
                    # rowcount = rows matched, as PostgreSQL counts them (not only rows changed).
                    client_flag=CLIENT.FOUND_ROWS,
                    **args,
                )
        except (OSError, aiomysql.Error) as exc:
            if bound.expired():  # aiomysql's connect_timeout covers the TCP connect only
                raise NoAnswerError(
                    f"cannot connect to MySQL: no answer within {self.statement_timeout:g}s"
                ) from None
            raise StoreError(f"cannot connect to MySQL: {exc}") from exc
        try:  # the pool's first connection, made above: refused here, not at the first claim
            async with self._pool.acquire() as conn:  # a free one: no round trip
                self._refuse_plaintext(conn)
        except BaseException:
            await self.close()
            raise

    def _refuse_plaintext(self, conn: Any) -> None:
        """An unencrypted pool connection where the URL asks for TLS is closed, and
        InsecureConnectionError raised (mysql_tls: aiomysql would use it); an attribute test,
        no round trip. Refused before the login already (``hook_aiomysql``): again here in
        case an aiomysql release no longer calls the hook."""
        try:
            refuse_plaintext(self.connect_args, conn)
        except BaseException:
            conn.close()
            raise

    async def close(self) -> None:
        # Kept while a transaction runs: wait_closed() below waits for its connection.
        if self._watchdog is not None and not self._in_transaction:
            self._watchdog.cancel()
            self._watchdog = None
        if self._pool is not None:
            pool, self._pool = self._pool, None
            pool.close()
            await pool.wait_closed()

    @contextlib.asynccontextmanager
    async def _transaction(self, *, bounded: bool = True) -> AsyncIterator[Any]:
        """A cursor in one transaction: committed when the block ends, rolled back if it raises.

        A connection interrupted mid-statement (cancelled, or the server went away) is
        closed rather than given back to the pool. Values the server refuses (a data error,
        a constraint) or text the driver cannot encode raise StoreDataError: no outage, and
        the same statement would fail again. The wait for a new connection and, if
        ``bounded``, each statement and the COMMIT give up after ``statement_timeout``
        (NoAnswerError, the connection closed).
        """
        await self.connect()
        aiomysql = _aiomysql()
        pool = self._pool
        trips = self._watched()
        try:
            try:
                # Bounded even with a free connection: one the server closed meanwhile
                # (wait_timeout, a restart) is replaced inside acquire(), a handshake under
                # the pool's lock, which every other caller waits for.
                trips.arm("waiting for a connection")
                conn = await self._acquire(pool)
                trips.disarm()
                try:
                    # Each time, as the pool opens connections on its own when it runs short.
                    self._refuse_plaintext(conn)
                    try:
                        async with conn.cursor(aiomysql.DictCursor) as cursor:
                            yield _BoundedCursor(cursor, trips) if bounded else cursor
                        if bounded:
                            trips.arm("COMMIT")
                        await conn.commit()
                        trips.disarm()
                    except (aiomysql.Error, UnicodeError) as exc:
                        trips.disarm()  # the server answered: its error, no timeout
                        if _read_only(exc):
                            self._no_primary(conn)
                        else:
                            await _rollback_or_close(conn)
                        raise
                    except BaseException:
                        conn.close()
                        raise
                finally:
                    await pool.release(conn)
            except (aiomysql.Error, OSError, UnicodeError) as exc:
                if _refused_values(exc):
                    raise StoreDataError(f"MySQL refused the values: {exc}") from exc
                if _read_only(exc):
                    raise StoreError(
                        f"MySQL: the server is read-only, no primary (a failover?); its "
                        f"connections closed, new ones made for the next try: {exc}"
                    ) from exc
                raise StoreError(f"MySQL: {exc}") from exc
        except asyncio.CancelledError:
            # The watchdog's cancellation (and no other, as asyncio.timeout tells them apart).
            if trips.expired and trips.task.uncancel() <= trips.cancelling:
                raise NoAnswerError(
                    f"MySQL did not answer within {self.statement_timeout:g}s "
                    f"({trips.what}): given up, the connection closed"
                ) from None
            raise
        finally:
            self._in_transaction.discard(trips)

    async def _acquire(self, pool: Any) -> Any:
        """A pool connection handed out since the latest read-only answer, or made since.

        Older ones are closed as they come out of the pool, and the pool makes others: after
        a failover that leaves the old primary up and read-only, every pooled connection
        reached it, and kept (the pool hands its free connections out in turn), each failed
        every claim and settle for ever while a proxy or DNS led new connections to the new
        primary. Reads succeed there, so a connection used for the wake-up probe alone
        would never have answered read-only itself, and read the old server's rows."""
        while True:
            conn = await pool.acquire()
            made = self._made_after.get(conn)
            if made is None:  # new: the pool made it (a round trip, once per connection)
                try:
                    async with conn.cursor() as cursor:
                        await cursor.execute(_SESSION_PINS)
                except BaseException:
                    conn.close()
                    await pool.release(conn)  # closed: the pool forgets it
                    raise
                made = self._made_after[conn] = self._read_only_answers
            if made == self._read_only_answers:
                return conn
            conn.close()
            await pool.release(conn)  # closed: the pool forgets it

    def _no_primary(self, conn: Any) -> None:
        """``conn``'s server answered read-only: it is no primary. ``conn`` is closed (the
        server rolls its transaction back) and every pool connection handed out before it
        with it (``_acquire``), so that the next try connects anew, where a proxy or DNS
        now leads to the primary."""
        conn.close()
        self._read_only_answers += 1

    def _watched(self) -> _RoundTrips:
        """The round trips of a transaction starting now, watched by ``_watchdog``.

        A watchdog, not an asyncio.timeout a round trip: a timer armed and cancelled for
        each statement cost the relay's short transactions (a probe, a claim) 10-15 µs of
        CPU each; this costs a clock read, and one timer a second while any runs."""
        task = asyncio.current_task()
        assert task is not None
        trips = _RoundTrips(task)
        self._in_transaction.add(trips)
        if self._watchdog is None:
            self._watchdog = asyncio.get_running_loop().call_later(
                self._watch_interval(), self._watch
            )
        return trips

    def _watch_interval(self) -> float:
        return min(1.0, self.statement_timeout / 4)

    def _watch(self) -> None:
        """Cancel each transaction whose round trip has run ``statement_timeout``; again in
        a moment while any transaction runs."""
        self._watchdog = None
        now = time.monotonic()
        for trips in self._in_transaction:
            started = trips.started
            if (
                started is not None
                and not trips.expired
                and now - started >= self.statement_timeout
            ):
                trips.expired = True
                trips.task.cancel()
        if self._in_transaction:
            self._watchdog = asyncio.get_running_loop().call_later(
                self._watch_interval(), self._watch
            )

    async def _execute(
        self, cursor: Any, name: str, params: Mapping[str, Any] | None = None
    ) -> int:
        """Run the named query; return the rows it matched (``FOUND_ROWS``)."""
        sql, args = expand_lists(self._sql[name], params or {})
        return int(await cursor.execute(sql, args))  # a dict, even empty: %% becomes %

    # ----- schema --------------------------------------------------------------------------

    async def apply_schema(self) -> list[str]:
        tokens = self.tokens()
        applied: list[str] = []
        lock_name = schema_lock_name(self.connect_args["database"], self.table)
        # Not bounded: DDL over a big table, and GET_LOCK's own wait, take what they take.
        async with self._transaction(bounded=False) as cursor:
            # One schema change at a time, whoever runs it (GET_LOCK is the session's).
            await cursor.execute(
                "SELECT GET_LOCK(%s, %s) AS granted", (lock_name, _SCHEMA_LOCK_WAIT)
            )
            if (await cursor.fetchone())["granted"] != 1:
                raise StoreError(
                    f"another process has been applying the schema for {_SCHEMA_LOCK_WAIT}s"
                )
            # No "already exists" notes for IF NOT EXISTS (aiomysql turns notes into warnings).
            # Unbounded on MariaDB's side too: a server's or user's max_statement_time (a
            # DBA's guard for the application's queries) cut a migration's DDL, and the
            # upgrade stopped half-way, every try (MySQL's max_execution_time bounds SELECTs
            # only; the /*M! ... */ part is MariaDB's alone).
            await cursor.execute(
                "SET /*M! SESSION max_statement_time = 0, */ SESSION sql_notes = 0"
            )
            try:
                done: set[int] = set()
                if await self._columns(cursor, self.table + "_migrations"):
                    await cursor.execute(f"SELECT version FROM {tokens['migrations']}")
                    done = {row["version"] for row in await cursor.fetchall()}
                pending = [m for m in migrations("mysql") if m.version not in done]
                # Before any DDL: each statement commits by itself, so a refusal found later
                # would leave the schema half-applied.
                refuse_foreign_tables(
                    pending,
                    tokens,
                    {
                        token: await self._columns(cursor, tokens[token].strip("`"))
                        for token in adopted_by(pending)
                    },
                )
                for statement in statements(render(_MIGRATIONS_TABLE, tokens)):
                    await cursor.execute(statement)
                for migration in pending:
                    # DDL commits by itself: every statement of a migration can run again.
                    for statement in statements(render(migration.sql, tokens)):
                        await cursor.execute(statement)
                    await cursor.execute(
                        f"INSERT INTO {tokens['migrations']} (version, name) VALUES (%s, %s)",
                        (migration.version, migration.name),
                    )
                    await cursor.connection.commit()
                    applied.append(migration.name)
            finally:
                await cursor.execute(
                    "SET /*M! SESSION max_statement_time = DEFAULT, */ SESSION sql_notes = 1"
                )
                await cursor.execute("SELECT RELEASE_LOCK(%s)", (lock_name,))
        return applied

    async def _columns(self, cursor: Any, table: str) -> list[str]:
        """The columns of ``table`` (unquoted) in the URL's database; none if it is missing."""
        sql, args = expand_lists(
            to_pyformat(strip_comments(queries("mysql", "schema.sql")["table_columns"])),
            {"table": table},
        )
        await cursor.execute(sql, args)
        return [row["name"] for row in await cursor.fetchall()]

    async def applied_migrations(self) -> set[int]:
        name = self.table + "_migrations"
        async with self._transaction() as cursor:
            await cursor.execute(
                "SELECT COUNT(*) AS found FROM information_schema.TABLES "
                "WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = %s",
                (name,),
            )
            if not (await cursor.fetchone())["found"]:
                return set()
            await cursor.execute(f"SELECT version FROM {quote_mysql(name)}")
            return {row["version"] for row in await cursor.fetchall()}

    # ----- the relay's statements ----------------------------------------------------------

    async def _lock_destination(self, cursor: Any, destination: str, *, exclusive: bool) -> None:
        """Take the destination lock for the rest of the transaction (migration 0001)."""
        name = "lock_destination" if exclusive else "lock_destination_shared"
        if not await self._execute(cursor, name, {"destination": destination}):
            await self._execute(cursor, "add_destination", {"destination": destination})

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
        return await self._deadlock_retried(
            "a claim",
            lambda: self._claim_once(
                destination,
                relay_id,
                limit,
                lock_seconds,
                abandoned_blocks,
                max_attempts=max_attempts,
                recover=recover,
                max_bytes=max_bytes,
            ),
        )

    async def _claim_once(
        self,
        destination: str,
        relay_id: str,
        limit: int,
        lock_seconds: float,
        abandoned_blocks: bool,
        *,
        max_attempts: int,
        recover: bool,
        max_bytes: int,
    ) -> Claim:
        lease = Lease.new(relay_id)
        abandoned: list[AbandonedRow] = []
        recovered = False
        await self._release_unanswered(destination)
        taken: list[int] = []  # the seqs claim_update took: after it, only COMMIT can fail
        try:
            async with self._transaction() as cursor:
                await self._lock_destination(cursor, destination, exclusive=True)
                await self._execute(
                    cursor,
                    "claim_expired",
                    {
                        "destination": destination,
                        "limit": limit,
                        "abandoned_blocks": abandoned_blocks,
                    },
                )
                expired = await cursor.fetchall()
                exhausted = [row["seq"] for row in expired if row["attempts"] + 1 >= max_attempts]
                if exhausted:
                    await self._execute(
                        cursor, "abandon_expired", {"seqs": exhausted, "destination": destination}
                    )
                    abandoned = await self._abandoned(cursor, exhausted)
                if expired and abandoned_blocks:  # else such a row heads its key: recovered
                    await self._release_behind(cursor, destination, max_attempts)
                heads = [row for row in expired if row["seq"] not in exhausted and row["heads_key"]]
                if heads and not recover:
                    return Claim(lease=lease, recovery_waiting=True, abandoned=abandoned)
                if heads:
                    rows, recovered = heads[:1], True
                else:
                    rows = await self._due(cursor, destination, limit, abandoned_blocks, max_bytes)
                if rows:
                    updated = await self._execute(
                        cursor,
                        "claim_update",
                        {
                            "seqs": [row["seq"] for row in rows],
                            "destination": destination,
                            "relay_id": relay_id,
                            "lease": lease.token,
                            "lock_seconds": float(lock_seconds),
                        },
                    )
                    if updated != len(rows):
                        # Cannot happen under the locks; never hand out a row we lack.
                        raise StoreError(f"claim locked {len(rows)} rows but updated {updated}")
                    taken = [row["seq"] for row in rows]
        except BaseException:
            if taken:
                # The COMMIT got no answer (or the claim was cancelled then): it may have
                # committed, its rows held under a lease this relay never learnt. Left
                # there, they waited for the lock timeout, then went to recovery one a
                # claim, each charged an attempt it never made. An error the server
                # reported means it rolled back: the release then matches nothing.
                self._unanswered.setdefault(destination, []).append((lease, taken, recovered))
            raise

        def attempts(row: Mapping[str, Any]) -> int:
            # As claim_update counted it: taking over an expired lease counts the attempt.
            return int(row["attempts"]) + (1 if row["status"] == "PROCESSING" else 0)

        messages, unreadable = read_rows(
            rows,
            lambda row: Message(
                id=uuid.UUID(row["id"]),
                topic=row["topic"],
                payload=bytes(row["payload"]),
                key=row["key"],
                headers=parse_headers(row["headers"]),
                content_type=row["content_type"],
                destination=row["destination"],
                created_at=_utc(row["created_at"]),
                attempts=attempts(row),
                seq=row["seq"],
            ),
            lambda row, error: AbandonedRow(
                row_id(row["id"]), row["seq"], row["topic"], row["key"], attempts(row), error
            ),
        )
        claim = Claim(messages, lease=lease, recovered=recovered, abandoned=abandoned)
        await self.abandon_unreadable(destination, claim, unreadable, max_attempts)
        return claim

    async def _release_unanswered(self, destination: str) -> None:
        """Give back the rows of this destination's claims whose COMMIT got no answer, before
        the next claim (whose order they would otherwise hold up). One transaction under the
        shared destination lock, as a settle (queries.sql: release,
        expire_unanswered_recovery). A failure raises: the relay backs off as from a failed
        claim, and the leases are tried again next time."""
        # Released even when the lease ran out (the statement bound cuts a COMMIT a whole
        # statement_timeout after it was sent, when the default lease has ended already):
        # skipped, the rows went to recovery one a claim, each charged an attempt it never
        # had. Fenced by the lease: rows taken over since are left alone.
        pending = self._unanswered.pop(destination, [])
        if not pending:
            return
        try:
            released = 0
            async with self._transaction() as cursor:
                await self._lock_destination(cursor, destination, exclusive=False)
                for lease, seqs, recovered in pending:
                    holder = {
                        "destination": destination,
                        "relay_id": lease.relay_id,
                        "lease": lease.token,
                        "seqs": seqs,
                    }
                    # A recovered row (the only one its claim took) is recovered alone again.
                    name = "expire_unanswered_recovery" if recovered else "release"
                    released += await self._execute(cursor, name, holder)
        except BaseException:
            self._unanswered.setdefault(destination, [])[:0] = pending
            raise
        if released:
            logger.warning(
                "destination %s: %d message(s) taken by a claim whose answer was lost "
                "(its connection broke) went back to the queue",
                destination,
                released,
            )

    async def _due(
        self, cursor: Any, destination: str, limit: int, abandoned_blocks: bool, max_bytes: int
    ) -> list[Mapping[str, Any]]:
        """The due rows a claim takes (queries.sql: claim), locked, in seq order, within
        ``max_bytes`` of payload (plus one row)."""
        await self._execute(
            cursor,
            "claim",
            {
                "destination": destination,
                "limit": limit,
                "abandoned_blocks": abandoned_blocks,
                "max_bytes": max_bytes,
            },
        )
        rows: list[Mapping[str, Any]] = await cursor.fetchall()
        if any(row["key"] is not None for row in rows):
            await self._execute(
                cursor,
                "claim_earlier",
                {"destination": destination, "last_seq": max(row["seq"] for row in rows)},
            )
            rows = without_overtaking(rows, await cursor.fetchall())
        return rows

    async def _release_behind(self, cursor: Any, destination: str, max_attempts: int) -> None:
        """The in-flight rows of a dead relay behind an ABANDONED row of their key, per key
        from its first abandoned row -> FAILED, due now (queries.sql:
        abandoned_before_expired, release_behind_abandoned)."""
        await self._execute(cursor, "abandoned_before_expired", {"destination": destination})
        first: dict[str, int] = {}
        for row in await cursor.fetchall():
            if row["after"] is not None:
                key, after = row["key"], int(row["after"])
                first[key] = min(after, first.get(key, after))
        if first:
            await cursor.executemany(
                self._sql["release_behind_abandoned"],
                [
                    {
                        "destination": destination,
                        "key": key,
                        "after": after,
                        "max_attempts": max_attempts,
                    }
                    for key, after in first.items()
                ],
            )

    async def _abandoned(self, cursor: Any, seqs: Sequence[int]) -> list[AbandonedRow]:
        """The rows abandon_expired just abandoned, as they are now."""
        await self._execute(cursor, "abandoned_rows", {"seqs": list(seqs)})
        return [
            AbandonedRow(
                row_id(row["id"]),
                row["seq"],
                row["topic"],
                row["key"],
                row["attempts"],
                row["last_error"],
            )
            for row in await cursor.fetchall()
        ]

    async def renew(
        self, destination: str, lease: Lease, seqs: Sequence[int], lock_seconds: float
    ) -> int:
        return await self._deadlock_retried(
            "a renewal", lambda: self._renew_once(destination, lease, seqs, lock_seconds)
        )

    async def _renew_once(
        self, destination: str, lease: Lease, seqs: Sequence[int], lock_seconds: float
    ) -> int:
        async with self._transaction() as cursor:
            return await self._execute(
                cursor,
                "renew",
                {
                    "seqs": list(seqs),
                    "destination": destination,
                    "lease": lease.token,
                    "relay_id": lease.relay_id,
                    "lock_seconds": float(lock_seconds),
                },
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
        return await self._deadlock_retried(
            "a settle",
            lambda: self._settle_once(
                destination, lease, published, failed, released, max_attempts
            ),
        )

    async def _settle_once(
        self,
        destination: str,
        lease: Lease,
        published: Sequence[int],
        failed: Sequence[Failure],
        released: Sequence[int],
        max_attempts: int,
    ) -> SettleResult:
        result = SettleResult()
        holder = {"destination": destination, "relay_id": lease.relay_id, "lease": lease.token}
        async with self._transaction() as cursor:
            await self._lock_destination(cursor, destination, exclusive=False)
            if published:
                result.published = await self._execute(
                    cursor, "settle_published", {**holder, "seqs": list(published)}
                )
            if failed:
                result.failed = await cursor.executemany(
                    self._sql["settle_failed"],
                    [
                        {
                            **holder,
                            "seq": f.seq,
                            "error": f.error,
                            "delay": float(f.delay),
                            "permanent": f.permanent,
                            "max_attempts": max_attempts,
                        }
                        for f in failed
                    ],
                )
            if released:
                result.released = await self._execute(
                    cursor, "release", {**holder, "seqs": list(released)}
                )
        expected = len(published) + len(failed) + len(released)
        result.lost = expected - result.published - result.failed - result.released
        return result

    async def cleanup(self, status: str, retention: float, limit: int) -> int:
        params = {"status": status, "retention": float(retention), "limit": limit}
        async with self._transaction() as cursor:
            # Two statements: see cleanup_candidates in queries.sql.
            await self._execute(cursor, "cleanup_candidates", params)
            seqs = [row["seq"] for row in await cursor.fetchall()]
            if not seqs:
                return 0
            return await self._execute(cursor, "cleanup", {**params, "seqs": seqs})

    async def cleanup_inbox(self, retention: float, limit: int) -> int:
        params = {"retention": float(retention), "limit": limit}
        # One transaction a table: the inbox's locks are let go before the suspects' are
        # taken. The sum is >= limit while either table may hold more, so the caller's batch
        # loop goes on.
        deleted = await self._cleanup_picked("inbox_cleanup_candidates", "inbox_cleanup", params)
        return deleted + await self._cleanup_picked(
            "inbox_suspects_cleanup_candidates", "inbox_suspects_cleanup", params
        )

    async def _cleanup_picked(self, candidates: str, delete: str, params: dict[str, Any]) -> int:
        """Rows of (consumer, message_id) that ``candidates`` locks, deleted by ``delete``."""
        async with self._transaction() as cursor:
            # Two steps: see inbox_cleanup_candidates in queries.sql.
            await self._execute(cursor, candidates, params)
            rows = await cursor.fetchall()
            deleted = 0
            # In slices: a statement for a cleanup_batch of up to a million entries would
            # exceed max_allowed_packet.
            for start in range(0, len(rows), _INBOX_DELETE_SLICE):
                part = rows[start : start + _INBOX_DELETE_SLICE]
                picked = " UNION ALL ".join(
                    f"SELECT %(c{i})s AS consumer, %(m{i})s AS message_id" for i in range(len(part))
                )
                args: dict[str, Any] = {}
                for i, row in enumerate(part):
                    args[f"c{i}"], args[f"m{i}"] = row["consumer"], row["message_id"]
                sql = self._sql[delete].replace("%(picked)s", picked)
                deleted += int(await cursor.execute(sql, args))
            return deleted

    # ----- operations ----------------------------------------------------------------------

    async def status(self) -> list[DestinationStatus]:
        async with self._transaction() as cursor:
            await self._execute(cursor, "seq_range")
            ends = await cursor.fetchone()
            first, last = ends["first_seq"], ends["last_seq"]
            if last is None or last - first + 1 <= self.exact_status_rows:
                await self._execute(cursor, "counts")
                return fold_counts(await cursor.fetchall())
            await self._execute(cursor, "counts_tally")
            counted = fold_counts(await cursor.fetchall())
            seqs = sample_seqs(first, last)
            await self._execute(cursor, "sample_published", {"seqs": seqs})
            hits = {row["destination"]: int(row["hits"]) for row in await cursor.fetchall()}
        return with_published_estimates(counted, estimate_from_sample(hits, len(seqs), first, last))

    async def ping(self) -> None:
        async with self._transaction() as cursor:
            await cursor.execute("SELECT 1")

    async def oldest_transaction(self) -> float:
        """Seconds the oldest open writing transaction has run (it may hold a key's lock)."""
        try:
            async with self._transaction() as cursor:
                await self._execute(cursor, "oldest_transaction")
                row = await cursor.fetchone()
        except StoreError as exc:
            cause = exc.__cause__
            if cause is not None and cause.args and cause.args[0] in ER_ACCESS_DENIED:
                logger.debug("no PROCESS privilege: cannot see other transactions (%s)", cause)
                return 0.0
            raise
        return float(row["age"] or 0.0)

    async def list_messages(self, statuses: Sequence[str], limit: int) -> list[dict[str, object]]:
        if not statuses:
            return []
        async with self._transaction() as cursor:
            await self._execute(cursor, "list", {"statuses": list(statuses), "limit": limit})
            rows = await cursor.fetchall()
        for row in rows:
            row["id"] = uuid.UUID(row["id"])
            for column in ("created_at", "updated_at", "next_attempt_at", "published_at"):
                row[column] = _utc(row[column])
        return [dict(row) for row in rows]

    async def requeue(
        self, destinations: Sequence[str], statuses: Sequence[str], ids: Sequence[str] | None
    ) -> int:
        if not destinations or not statuses or (ids is not None and not ids):
            return 0
        # IN needs a non-empty list even when :all_ids makes it irrelevant.
        wanted = [str(uuid.UUID(i)) for i in ids] if ids is not None else [""]
        async with self._transaction() as cursor:
            for destination in sorted(set(destinations)):  # in name order: see postgres.py
                await self._lock_destination(cursor, destination, exclusive=False)
            return await self._execute(
                cursor,
                "requeue",
                {
                    "destinations": list(destinations),
                    "statuses": list(statuses),
                    "all_ids": ids is None,
                    "ids": wanted,
                },
            )

    # ----- wake-ups ------------------------------------------------------------------------

    def nudge(self, destination: str) -> None:
        """Wake one of the destination's waiting loops: a loop claimed a full batch, so more
        is likely due."""
        self._nudged.add(destination)

    async def _probe(self, *, fresh: bool = False) -> _Mark:
        """The current pending_mark; the relay's waiting loops share one reading per interval
        (``fresh``: not an earlier one, it did not ask for this loop's destination).

        In a relay of several destinations the mark does not say whose rows changed: the
        same probe then asks, for the waiting destinations that have not seen this mark yet,
        which of them have a row due (queries.sql, due_destinations), so that a commit for
        one destination wakes that destination only. The race with writers: the question is
        asked after the mark is read, so a commit after the mark's snapshot is either in the
        answer (its destination is woken now) or after the question's snapshot, and then it
        changes the next mark, whose question sees it. A destination that has not seen the
        mark is never told "not due" by a question asked before the mark was read.
        """
        async with self._probe_lock:
            if (
                fresh
                or self._reading is None
                or time.monotonic() - self._probed_at >= WAKE_PROBE_INTERVAL / 2
            ):
                async with self._transaction() as cursor:
                    await self._execute(cursor, "pending_mark")
                    row = await cursor.fetchone()
                    mark = row["pending_at"], int(row["last_seq"]), int(row["recent"])
                    asked = frozenset(
                        destination
                        for destination in self._waiting_destinations
                        if self._marks.get(destination) != mark
                    )
                    due: frozenset[str] = frozenset()
                    if asked and len(self._waiting_destinations) > 1:
                        await self._execute(
                            cursor, "due_destinations", {"destinations": sorted(asked)}
                        )
                        due = frozenset(row["destination"] for row in await cursor.fetchall())
                self._probed_at = time.monotonic()
                self._reading, self._asked, self._found_due = mark, asked, due
            return self._reading

    async def wait_for_wakeup(self, destination: str, timeout: float) -> bool:
        """Probe the mark of PENDING rows until it changes (True) or ``timeout`` passes.

        It is compared with the last mark any loop of the destination saw, not with one read
        now: a row that committed after this loop's claim began but before this call is then
        still news. The destination's first loop to see a change takes it: one wake-up per
        change and destination, as a NOTIFY.

        In a relay of several destinations a change wakes only the destinations the probe
        found due (see _probe): with traffic on one, the others' loops claimed at every
        change and found nothing. Their loops then probe on shared ticks of the monotonic
        clock, so that one probe answers them all. A relay of one destination never asks.
        """
        self._waiting_destinations.add(destination)
        deadline = time.monotonic() + timeout
        fresh = False
        while True:
            if destination in self._nudged:
                self._nudged.discard(destination)
                return True
            mark = await self._probe(fresh=fresh)
            fresh = False
            previous = self._marks.get(destination)
            several = len(self._waiting_destinations) > 1
            if several and mark != previous and destination not in self._asked:
                # A reading shared from before this destination waited: it did not ask for
                # it. Seen without its answer, the change would be lost until the poll.
                fresh = True
                continue
            self._marks[destination] = mark
            # The first reading has nothing to compare with: PENDING rows then mean look again.
            changed = mark != previous and (previous is not None or mark[0] is not None)
            if changed and (not several or destination in self._found_due):
                return True
            now = time.monotonic()
            remaining = deadline - now
            if remaining <= 0:
                return False
            # Several destinations: sleep to the next tick shared by every waiting loop.
            pause = (
                WAKE_PROBE_INTERVAL - now % WAKE_PROBE_INTERVAL if several else WAKE_PROBE_INTERVAL
            )
            await asyncio.sleep(min(pause, remaining))

    # ----- operators' changes by filter (outboxer.admin; SQL in admin.sql) ----------------

    @functools.cached_property
    def _admin_sql(self) -> dict[str, str]:
        tokens = self.tokens()
        return {
            name: to_pyformat(strip_comments(render(sql, tokens)))
            for name, sql in admin_queries("mysql").items()
        }

    async def _admin(self, cursor: Any, name: str, where: MessageFilter, **extra: Any) -> int:
        sql, args = expand_lists(self._admin_sql[name], {**_filter_params(where), **extra})
        return int(await cursor.execute(sql, args))

    async def count_matching(self, where: MessageFilter) -> dict[str, dict[str, int]]:
        async with self._transaction() as cursor:
            await self._admin(cursor, "count_matching", where)
            rows = await cursor.fetchall()
        counts: dict[str, dict[str, int]] = {}
        for row in rows:
            counts.setdefault(row["destination"], {})[row["status"]] = int(row["count"])
        return counts

    async def _under_destination_locks(
        self, name: str, where: MessageFilter, then: str | None = None
    ) -> tuple[int, int]:
        """Run the admin statement ``name`` in one transaction, under the shared lock of every
        destination it may change (admin.sql: purge): the rows it changed, and the value the
        read ``then`` finds after it, in the transaction (0 without one).

        InnoDB may choose it as a deadlock's victim (1213) beside a live relay, whose settles
        and cleanup lock the same rows in another order: it is tried again (see
        ``_deadlock_retried``). An operator's `requeue` failed with "Deadlock found" and
        changed nothing."""
        return await self._deadlock_retried(
            name, lambda: self._under_destination_locks_once(name, where, then)
        )

    async def _deadlock_retried(self, name: str, attempt: Callable[[], Awaitable[R]]) -> R:
        """``attempt()``, tried again when InnoDB chose its transaction as a deadlock's victim
        (1213), up to DEADLOCK_TRIES times: the whole transaction was rolled back, so trying
        it again is what MySQL advises. Claims and settles are victims too, beside an
        operator's requeue or purge: its UPDATE locks every index record it scans, other
        destinations' rows among them, whose claims it does not hold back. Raised to the
        relay, the deadlock was taken for a database outage (a warning, a back-off)."""
        for tried in range(1, DEADLOCK_TRIES + 1):
            try:
                return await attempt()
            except StoreError as exc:
                if tried == DEADLOCK_TRIES or not _deadlocked(exc):
                    raise
                logger.info("MySQL: %s chosen as a deadlock's victim; trying it again", name)
                await asyncio.sleep(random.uniform(0.01, 0.05) * tried)
        raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises

    async def _under_destination_locks_once(
        self, name: str, where: MessageFilter, then: str | None
    ) -> tuple[int, int]:
        async with self._transaction() as cursor:
            await self._admin(cursor, "destinations_matching", where)
            locked = [row["destination"] for row in await cursor.fetchall()]
            if not locked:
                return 0, 0
            for destination in locked:
                await self._lock_destination(cursor, destination, exclusive=False)
            changed = await self._admin(cursor, name, where, locked=locked)
            if then is None:
                return changed, 0
            await self._admin(cursor, then, where)
            return changed, int((await cursor.fetchone())["deferred"])

    async def purge(self, where: MessageFilter) -> int:
        return (await self._under_destination_locks("purge", where))[0]

    async def requeue_matching(self, where: MessageFilter) -> int:
        return (await self.requeue_matching_counted(where))[0]

    async def requeue_matching_counted(self, where: MessageFilter) -> tuple[int, int]:
        return await self._under_destination_locks(
            "requeue_matching", where, then="count_requeue_deferred"
        )

    async def count_requeue_deferred(self, where: MessageFilter) -> int:
        async with self._transaction() as cursor:
            await self._admin(cursor, "count_requeue_deferred", where)
            row = await cursor.fetchone()
        return int(row["deferred"])

    async def replay(
        self, where: MessageFilter, copy: Callable[[Sequence[Message]], list[Message]]
    ) -> int:
        """Copy the originals ``where`` matches, in one transaction (admin.sql: replay_page).

        InnoDB may choose it as a deadlock's victim (1213): it holds its originals in share
        mode page after page, in seq order, and a purge (whose DELETE locks rows in the
        order of the index it reads) or an operator's session locking them in another order
        meets it; the operator's `replay` failed with "Deadlock found". The whole
        transaction was rolled back, so it is tried again (``_deadlock_retried``). The
        copier's work outside the database is not repeated (``made``, see copied_once): a
        try inserts the claim-checked copies an earlier one made of the originals it reads
        again, so their objects are put once (none left behind for a rolled-back copy,
        unless its original is gone by the next try: the sweep takes it), and a shredded
        original is counted once. The copies' ids were never committed, so inserting them
        again is inserting them once. Other copies are made again: kept, they held every
        copy's payload in memory until the replay ended, not a page's."""
        made: dict[int, list[Message]] = {}
        return await self._deadlock_retried(
            "a replay", lambda: self._replay_once(where, copy, made)
        )

    async def _replay_once(
        self,
        where: MessageFilter,
        copy: Callable[[Sequence[Message]], list[Message]],
        made: dict[int, list[Message]],
    ) -> int:
        from outboxer.admin import REPLAY_PAGE
        from outboxer.enqueue import Outbox, detect, mysql_key_slots

        outbox = Outbox(schema=self.schema, table=self.table)
        inserted = 0
        async with self._transaction() as cursor:
            await self._admin(cursor, "replay_keys", where)
            slots = mysql_key_slots(row["key"] for row in await cursor.fetchall())
            if slots:  # every key locked, in one order, before the first copy takes a seq
                await self._execute(cursor, "key_lock", {"slots": slots})
            await self._admin(cursor, "replay_seqs", where)
            seqs = [row["seq"] for row in await cursor.fetchall()]
            for start in range(0, len(seqs), REPLAY_PAGE):
                page = seqs[start : start + REPLAY_PAGE]
                await self._admin(cursor, "replay_page", where, seqs=page)
                rows = await cursor.fetchall()
                copies = await asyncio.to_thread(
                    copied_once, copy, [_original(row) for row in rows], made
                )
                if copies:
                    # The write path's code, on the raw connection: bounded here, the page's
                    # statements together.
                    await cursor.round_trips(
                        "the copies' writes",
                        detect(cursor.connection).write_async(outbox, cursor.connection, copies),
                    )
                    inserted += len(copies)
        return inserted


#: Tries of a transaction InnoDB chose as a deadlock's victim (see
#: MySQLStore._deadlock_retried).
DEADLOCK_TRIES = 5


def _deadlocked(exc: BaseException) -> bool:
    """Whether the driver error behind ``exc`` is InnoDB's deadlock (1213): the transaction
    was rolled back whole."""
    args: tuple[Any, ...] = getattr(exc.__cause__, "args", ())
    return bool(args) and args[0] == 1213


def _read_only(exc: BaseException) -> bool:
    """Whether the driver error ``exc`` is the server refusing a write because it is
    read-only (``ER_READ_ONLY``): this server is no primary."""
    args: tuple[Any, ...] = getattr(exc, "args", ())
    return isinstance(exc, _aiomysql().Error) and bool(args) and args[0] in ER_READ_ONLY


def _refused_values(exc: BaseException) -> bool:
    """Whether the server refused a statement's values (a data error, a constraint) or the
    driver could not encode them: no outage, and the same statement would fail again."""
    aiomysql = _aiomysql()
    if isinstance(exc, aiomysql.DataError | aiomysql.IntegrityError | UnicodeError):
        return True
    return isinstance(exc, aiomysql.Error) and bool(exc.args) and exc.args[0] in ER_CHECK_CONSTRAINT


class _RoundTrips:
    """Where one transaction is: in a round trip since ``started`` (None: between them),
    doing ``what``; ``expired`` once the watchdog cancelled it for taking too long."""

    __slots__ = ("cancelling", "expired", "started", "task", "what")

    def __init__(self, task: asyncio.Task[Any]) -> None:
        self.task = task
        #: The cancellations already asked for: the watchdog's is one more.
        self.cancelling = task.cancelling()
        self.started: float | None = None
        self.what = ""
        self.expired = False

    def arm(self, what: str) -> None:
        self.what = what
        self.started = time.monotonic()

    def disarm(self) -> None:
        self.started = None


class _BoundedCursor:
    """A DictCursor whose statements give up after the store's ``statement_timeout``. Its
    fetches read what the statement buffered: no round trip, no bound."""

    __slots__ = ("_cursor", "_trips")

    def __init__(self, cursor: Any, trips: _RoundTrips) -> None:
        self._cursor = cursor
        self._trips = trips

    @property
    def connection(self) -> Any:
        return self._cursor.connection

    async def execute(self, query: str, args: Any = None) -> Any:
        self._trips.arm("a statement")
        try:
            return await self._cursor.execute(query, args)
        finally:
            self._trips.disarm()

    async def executemany(self, query: str, args: Any) -> Any:
        self._trips.arm("a statement")
        try:
            return await self._cursor.executemany(query, args)
        finally:
            self._trips.disarm()

    async def round_trips(self, what: str, work: Awaitable[R]) -> R:
        """``work``'s round trips on ``connection`` (past this cursor), bounded together."""
        self._trips.arm(what)
        try:
            return await work
        finally:
            self._trips.disarm()

    async def fetchone(self) -> Any:
        return await self._cursor.fetchone()

    async def fetchall(self) -> Any:
        return await self._cursor.fetchall()


#: Seconds a ROLLBACK after a refused statement may take; past it the connection is closed.
_ROLLBACK_TIMEOUT = 5.0


async def _rollback_or_close(conn: Any) -> None:
    try:
        # Bounded: a server that refused the statement and then stopped answering held the
        # caller for ever; closing the connection rolls back as well.
        async with asyncio.timeout(_ROLLBACK_TIMEOUT):
            await conn.rollback()
    except Exception:  # noqa: BLE001 -- the connection is broken: drop it, the pool makes another
        conn.close()


def _original(row: Mapping[str, Any]) -> Message:
    """A PUBLISHED row a replay copies, as a Message."""
    return Message(
        id=uuid.UUID(row["id"]),
        topic=row["topic"],
        payload=bytes(row["payload"]),
        key=row["key"],
        headers=parse_headers(row["headers"]),
        content_type=row["content_type"],
        destination=row["destination"],
        created_at=_utc(row["created_at"]),
        seq=row["seq"],
    )


def _filter_params(where: MessageFilter) -> dict[str, Any]:
    """A MessageFilter as admin.sql's filter parameters: each list with its any_ flag (and
    a dummy item when left out: IN needs one), times as naive UTC (DATETIME(6) holds UTC)."""
    params: dict[str, Any] = {}
    for flag, name, values in (
        ("any_status", "statuses", where.statuses),
        ("any_id", "ids", None if where.ids is None else [str(i) for i in where.ids]),
        ("any_destination", "destinations", where.destinations),
        ("any_topic", "topics", where.topics),
        ("any_key", "keys", where.keys),
    ):
        params[flag] = values is None
        params[name] = [""] if values is None else list(values)
    for name in ("created_after", "created_before"):
        moment = getattr(where, name)
        params[name] = moment.astimezone(UTC).replace(tzinfo=None) if moment is not None else None
    params["older_than"] = where.older_than
    params["error"] = where.error
    return params
