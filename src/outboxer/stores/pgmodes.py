"""PostgreSQL outbox modes beside the default table: what they share.

* ``log``: an append-only table read by offset (``outboxer.stores.pglog``);
* ``wal``: no table, messages written to the WAL (``outboxer.stores.pgwal``);
* ``debezium``: a table in the layout Debezium's outbox event router reads
  (``outboxer.stores.pgdebezium``).

``Outbox(mode=...)`` (``outboxer.enqueue``) calls ``write`` here; the readers use
``ModeSchema`` for their connection and their migrations, kept apart from the default
table's (an applied migration of one mode never touches another's).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any

from outboxer.errors import ConfigError, PayloadError, StoreError
from outboxer.keepalive import keep_asyncpg_alive, server_keepalives_sql, set_asyncpg_keepalives
from outboxer.message import JSON, Message
from outboxer.redact import get_logger, register_url_secrets
from outboxer.stores.base import check_identifier
from outboxer.stores.pgpartitions import ISOLATION
from outboxer.stores.sqlfiles import migrations, queries, quote_ident, render

if TYPE_CHECKING:
    from outboxer.enqueue import _Driver

logger = get_logger("outboxer.pgmodes")

#: Outbox modes: the default table and the PostgreSQL-only modes.
MODES = ("table", "log", "wal", "debezium")

#: The prefix of the WAL outbox's logical decoding messages, followed by schema.table.
WAL_PREFIX = "outboxer:"

#: Seconds a statement of the stream relays' connections (and of the commands that share
#: them) may go unanswered: then it fails with TimeoutError, an outage the relay backs off
#: from and reconnects after, as the table mode's pool (``command_timeout=60``). Without
#: it, a database that stopped answering (a proxy that accepts and forwards nothing, a
#: partition) held the stream relay for ever while it looked alive. Logical decoding
#: calls have their own bound (pgwal: DECODE_TIMEOUT, watched), schema changes none.
COMMAND_TIMEOUT = 60.0
#: Seconds a connect (TCP, TLS, authentication) may take: asyncpg's own default, named.
CONNECT_TIMEOUT = 60.0
#: Seconds ``close`` waits for the server's goodbye before it cuts the connection: a
#: database that stopped answering never says it, and the relay's reconnect or shutdown
#: waited for it (up to the command timeout, for ever without one).
CLOSE_TIMEOUT = 1.0


def check_mode(mode: object) -> str:
    if mode not in MODES:
        raise ConfigError(f"mode must be one of {', '.join(MODES)}; got {mode!r:.60}")
    return str(mode)


def tokens(schema: str, table: str) -> dict[str, str]:
    """Quoted names of every mode's objects for one outbox (schema, table)."""
    check_identifier("schema", schema)
    check_identifier("table", table)

    def name(suffix: str) -> str:
        return f"{quote_ident(schema)}.{quote_ident(table + suffix)}"

    return {
        "schema": quote_ident(schema),
        "log": name("_log"),
        "log_raw": table + "_log",
        "default_partition": name("_log_default"),
        "keys": name("_log_keys"),
        "offsets": name("_log_offsets"),
        "debezium": name("_debezium"),
        "debezium_raw": table + "_debezium",
        # The stream relays' own tables (log and WAL modes): sql/pgstream.
        "stream_failures": name("_stream_failures"),
        "stream_dead_letters": name("_stream_dead_letters"),
        "stream_dead_letters_raw": table + "_stream_dead_letters",
    }


def wal_prefix(schema: str, table: str) -> str:
    return f"{WAL_PREFIX}{schema}.{table}"


def wal_content(message: Message, destinations: Sequence[str]) -> bytes:
    """A WAL message's content: one JSON line of envelope, then the payload's bytes."""
    envelope = {
        "id": str(message.id),
        "topic": message.topic,
        "key": message.key,
        "content_type": message.content_type,
        "headers": dict(message.headers),
        "destinations": list(destinations),
    }
    head = json.dumps(envelope, separators=(",", ":"), ensure_ascii=False).encode()
    return head + b"\n" + message.payload


def debezium_row(message: Message) -> dict[str, Any]:
    """Debezium's outbox columns for a message: aggregatetype = topic (the router's topic),
    aggregateid = key (the Kafka key; the message id when keyless), type = the ``type``
    header or the topic, payload = the JSON payload."""
    if message.content_type != JSON:
        raise PayloadError(
            "the debezium mode stores JSON payloads only (its payload column is jsonb); "
            f"got content type {message.content_type!r}"
        )
    return {
        "id": str(message.id),
        "aggregatetype": message.topic,
        "aggregateid": message.key if message.key is not None else str(message.id),
        "type": message.headers.get("type", message.topic),
        "payload": message.payload.decode("utf-8"),
        "headers": json.dumps(dict(message.headers), separators=(",", ":"), ensure_ascii=False),
    }


def _log_row(message: Message) -> dict[str, Any]:
    return {
        "id": str(message.id),
        "topic": message.topic,
        "key": message.key,
        "payload": message.payload,
        "content_type": message.content_type,
        "headers": json.dumps(dict(message.headers), separators=(",", ":"), ensure_ascii=False),
    }


def statements(
    mode: str, schema: str, table: str, messages: Sequence[Message]
) -> list[tuple[str, list[dict[str, Any]]]]:
    """The statements that write ``messages`` in ``mode``, each with its rows of parameters.

    ``messages`` holds one copy per destination (``Outbox.build``); the log, WAL and
    Debezium modes write each message once: their readers, not the rows, are per
    destination.
    """
    firsts: dict[uuid.UUID, Message] = {}
    destinations: dict[uuid.UUID, list[str]] = {}
    for message in messages:
        firsts.setdefault(message.id, message)
        destinations.setdefault(message.id, []).append(message.destination)
    unique = list(firsts.values())
    names = tokens(schema, table)
    if mode == "log":
        sql = queries("pglog")
        keys = sorted({m.key for m in unique if m.key is not None})
        locks = [(render(sql["lock_keys"], names), [{"keys": keys}])] if len(keys) > 1 else []
        return [*locks, (render(sql["insert"], names), [_log_row(m) for m in unique])]
    if mode == "wal":
        prefix = wal_prefix(schema, table)
        return [
            (
                queries("pgwal")["emit"],
                [{"prefix": prefix, "content": wal_content(m, destinations[m.id])} for m in unique],
            )
        ]
    if mode == "debezium":
        return [(render(queries("pgdebezium")["insert"], names), [debezium_row(m) for m in unique])]
    raise ConfigError(f"mode {mode!r} has no statements here")


def check_dialect(mode: str, dialect: str, driver_name: str) -> None:
    if dialect != "postgres":
        raise TypeError(f"the {mode} outbox mode needs PostgreSQL; {driver_name} is {dialect}")


def write(
    driver: _Driver, mode: str, schema: str, table: str, conn: Any, messages: Sequence[Message]
) -> None:
    check_dialect(mode, driver.dialect(conn), driver.name)
    _run(driver.execute, driver.execute_many, statements(mode, schema, table, messages), conn)


async def write_async(
    driver: _Driver, mode: str, schema: str, table: str, conn: Any, messages: Sequence[Message]
) -> None:
    check_dialect(mode, driver.dialect(conn), driver.name)
    for sql, rows in statements(mode, schema, table, messages):
        if len(rows) == 1:
            await driver.execute_async(conn, sql, rows[0])
        else:
            await driver.execute_many_async(conn, sql, rows)


def _run(
    execute: Callable[[Any, str, dict[str, Any]], int],
    execute_many: Callable[[Any, str, Sequence[dict[str, Any]]], None],
    plan: list[tuple[str, list[dict[str, Any]]]],
    conn: Any,
) -> None:
    for sql, rows in plan:
        if len(rows) == 1:
            execute(conn, sql, rows[0])
        else:
            execute_many(conn, sql, rows)


class ModeSchema:
    """An asyncpg connection to one database and the migrations of one mode.

    ``folder`` names the SQL folder (``sql/<folder>/migrations``); the mode records its
    applied versions in a table of its own, ``<table>_<folder>_migrations``.
    """

    folder = ""
    #: Further SQL folders whose migrations ``apply_schema`` applies after the mode's own
    #: (the stream relays' tables, ``pgstream``, for log and WAL modes).
    also: tuple[str, ...] = ()

    def __init__(self, url: str, *, schema: str = "outboxer", table: str = "outbox") -> None:
        register_url_secrets(url)
        self.url = url
        self.schema = check_identifier("schema", schema)
        self.table = check_identifier("table", table)
        self.names = tokens(schema, table)
        self.names["migrations"] = self._migrations_table(self.folder)
        self._conn: Any = None
        #: The server session of the connection (``connect``), and one given up without
        #: the server taking its close (``close``), which ``connect`` ends.
        self._session: Session | None = None
        self._left: Session | None = None

    def _migrations_table(self, folder: str) -> str:
        return f"{quote_ident(self.schema)}.{quote_ident(f'{self.table}_{folder}_migrations')}"

    def sql(self, name: str) -> str:
        return render(queries(self.folder)[name], self.names)

    async def connect(self) -> None:
        """Connect; first end the session of the connection given up last (``close`` not
        taken by the server) if the server still has it. Given up in a partition, the
        server never heard of it: it lived on until TCP keepalive ended it (over two hours
        with Linux's defaults), inside the transaction it was in ('idle in transaction': a
        commit with dead letters whose COMMIT was lost), its row locks held. The
        reconnected relay's statements on the same rows (registering its reader, moving its
        offset) waited for them, were cut at COMMAND_TIMEOUT, and the relay reconnected,
        for as long. The new session gets server-side TCP keepalives (``session_of``), so
        the server also ends it soon after this relay's host vanishes, instead of hours."""
        if self._conn is None:
            conn = await open_connection(self.url)
            try:
                if self._left is not None:
                    left, self._left = self._left, None
                    await end_session(conn, left, type(self).__name__)
                self._session = await session_of(conn, keepalive=True)
            except BaseException:
                await close_connection(conn)
                raise
            self._conn = conn

    async def close(self) -> None:
        if self._conn is not None:
            conn, self._conn = self._conn, None
            session, self._session = self._session, None
            if not await close_connection(conn):
                self._left = session

    @contextlib.asynccontextmanager
    async def schema_connection(self) -> AsyncIterator[Any]:
        """A connection of its own for a schema change, without the statement bound: an
        index built over the retained log (pglog migration 0002), a wait for another
        apply's schema lock or a slot's creation (it waits for the running transactions
        to end) take minutes, and cut at COMMAND_TIMEOUT they could never complete. The
        default table's schema changes run so too (PostgresStore._schema_connection).
        Keepalives on both ends (a round trip: once a migration): its locks (the schema's,
        a table's ACCESS EXCLUSIVE) must not outlive a vanished relay host by hours."""
        conn = await open_connection(self.url, bounded=False)
        try:
            await keep_asyncpg_alive(conn, COMMAND_TIMEOUT)
            yield conn
        finally:
            await close_connection(conn)

    @property
    def conn(self) -> Any:
        if self._conn is None:
            raise StoreError(f"{type(self).__name__} is not connected: call connect() first")
        return self._conn

    async def __aenter__(self) -> ModeSchema:
        await self.connect()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def schema_sql(self) -> str:
        """The mode's whole DDL, for teams that run their own migrations."""
        return (
            "\n\n".join(
                render(m.sql, self.names).strip()
                for folder in (self.folder, *self.also)
                for m in migrations(folder)
            )
            + "\n"
        )

    async def apply_schema(self) -> list[str]:
        """Create or upgrade the mode's objects; return the migrations applied now."""
        applied = []
        for folder in (self.folder, *self.also):
            applied += await self.apply_migrations(folder)
        return applied

    async def apply_migrations(self, folder: str) -> list[str]:
        """Apply the migrations of ``sql/<folder>`` not applied yet (recorded in a table of
        that folder's own); return those applied now."""
        from outboxer.stores.postgres import lock_schema

        await self.connect()  # the callers go on with self.conn
        applied: list[str] = []
        recorded = self._migrations_table(folder)
        # READ COMMITTED whatever the database's default: the versions recorded must be read
        # as the locks below find them. At REPEATABLE READ the lock's query took the snapshot
        # before its wait, and a second apply ran the first's migrations again (a table
        # "already exists").
        async with self.schema_connection() as conn, conn.transaction(isolation=ISOLATION):
            await conn.execute("SET LOCAL synchronous_commit = on")
            await lock_schema(conn, self.schema)  # the schema's shared objects (see there)
            await conn.execute(
                "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))",
                f"outboxer-schema:{self.schema}.{self.table}",
            )
            # Only if missing: IF NOT EXISTS asks for the CREATE privilege on the database
            # even when the schema exists (a role owning the schema its DBA made lacks it).
            if await conn.fetchval("SELECT to_regnamespace($1)", self.names["schema"]) is None:
                await conn.execute(f"CREATE SCHEMA {self.names['schema']}")
            await conn.execute(
                f"CREATE TABLE IF NOT EXISTS {recorded} "
                "(version integer PRIMARY KEY, name text NOT NULL, "
                "applied_at timestamptz NOT NULL DEFAULT now())"
            )
            done = {r["version"] for r in await conn.fetch(f"SELECT version FROM {recorded}")}
            for migration in migrations(folder):
                if migration.version in done:
                    continue
                await conn.execute(render(migration.sql, self.names))
                await conn.execute(
                    f"INSERT INTO {recorded} (version, name) VALUES ($1, $2)",
                    migration.version,
                    migration.name,
                )
                applied.append(migration.name)
        return applied


async def open_connection(url: str, *, bounded: bool = True) -> Any:
    """One asyncpg connection (StoreError if the database does not answer within
    CONNECT_TIMEOUT). Its statements give up after COMMAND_TIMEOUT unless a call says
    otherwise (``timeout=``); ``bounded=False``: no bound, for schema changes only.

    Its socket has TCP keepalives of about COMMAND_TIMEOUT, bounded or not (asyncpg sets
    none): a call without a bound (a schema change) whose database host vanished waited for
    ever, nothing left unacknowledged for a retransmission to give up on. They never cut a
    slow statement of a live server, whose kernel answers the probes. The server's end is
    the caller's (``server_keepalives_sql``), in a query it sends anyway."""
    from outboxer.stores.postgres import _asyncpg, asyncpg_dsn

    asyncpg = _asyncpg()
    try:
        conn = await asyncpg.connect(
            asyncpg_dsn(url),
            # Read at each call, not bound at import: tests shorten them.
            timeout=CONNECT_TIMEOUT,
            command_timeout=COMMAND_TIMEOUT if bounded else None,
            # No JIT, as the relay's pool (postgres.py): a low jit_above_cost compiled each
            # of its short statements, ~100 ms apiece.
            server_settings={"application_name": "outboxer-relay", "jit": "off"},
        )
    except TimeoutError as exc:  # asyncpg's says nothing: the server took the TCP connection
        raise StoreError(
            f"cannot connect to PostgreSQL: no answer within {CONNECT_TIMEOUT:g}s"
        ) from exc
    except (OSError, asyncpg.PostgresError) as exc:
        raise StoreError(f"cannot connect to PostgreSQL: {exc}") from exc
    set_asyncpg_keepalives(conn, COMMAND_TIMEOUT)
    return conn


async def close_connection(conn: Any, timeout: float | None = None) -> bool:
    """Close ``conn`` within ``timeout`` (CLOSE_TIMEOUT), else cut it: the server ends the
    session (and rolls back what it had begun) once it notices, which after a partition
    may be hours away. Whether the server took the close (False: cut, or lost before)."""
    if conn.is_closed():  # lost: whether the server's side went too is unknown
        return False
    try:
        await conn.close(timeout=CLOSE_TIMEOUT if timeout is None else timeout)
    except Exception:  # noqa: BLE001 -- a timeout or a broken connection: cut it
        conn.terminate()
        return False
    return True


#: A server session: its process id and backend start, which no other session shares.
Session = tuple[int, Any]


async def session_of(conn: Any, *, keepalive: bool = False) -> Session:
    """``conn``'s server session (``end_session`` ends it from another connection). With
    ``keepalive``, the same query gives its backend TCP keepalives of about COMMAND_TIMEOUT
    (``server_keepalives_sql``; in autocommit, so they stay): the server ends a session
    whose relay's host vanished within about that, and the locks it held with it."""
    extra = f", {server_keepalives_sql(COMMAND_TIMEOUT)}" if keepalive else ""
    started = await conn.fetchval(
        f"SELECT backend_start{extra} FROM pg_stat_activity WHERE pid = pg_backend_pid()"
    )
    return conn.get_server_pid(), started


async def end_session(conn: Any, session: Session, name: str) -> bool:
    """End ``session``, one this process gave up (see ModeSchema.connect, ReaderLock), if
    the server still has it; whether it did. Matched by process id and backend start, so
    never another session, another relay's, that took the process id since. A role not
    allowed to end it is logged, and the caller goes on (it then waits for TCP keepalive,
    as before)."""
    from outboxer.stores.postgres import _asyncpg

    pid, started = session
    try:
        ended = bool(
            await conn.fetchval(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE pid = $1 AND backend_start = $2 AND pid <> pg_backend_pid()",
                pid,
                started,
            )
        )
    except _asyncpg().PostgresError as exc:
        logger.warning(
            "%s: cannot end this relay's earlier session (process %d), given up but perhaps "
            "still at the server: %s",
            name,
            pid,
            exc,
        )
        return False
    if ended:
        logger.warning(
            "%s: ended this relay's earlier session (process %d): given up (a partition, a "
            "close cut short), it was still at the server, with what it held",
            name,
            pid,
        )
    return ended


#: What pg_stat_activity says of a process's statement (``backend_activity``).
#: Running it (or unknown: the server answered, and only 'idle…' says it is done).
WORKING = "working"
#: Done with it and blocked handing its answer over (wait_event ClientWrite): the
#: connection is not taking the answer (a middlebox that stopped reading it, a NAT that
#: forgot it), or takes it slowly. State 'active' still, it was taken for work going on.
SENDING = "sending"
#: Done with it ('idle…'), or the process is gone.
DONE = "done"


def _activity(row: Any) -> str:
    """``backend_activity`` of a pg_stat_activity row (None: no such process). With
    track_activities off the state is 'disabled': unknown, taken as working."""
    if row is None:
        return DONE
    state = row["state"]
    if state is not None and str(state).startswith("idle"):
        return DONE
    if row["wait_event"] == "ClientWrite":
        return SENDING
    return WORKING


async def backend_activity(conn: Any, pid: int) -> str:
    """WORKING, SENDING or DONE: what server process ``pid`` (another session of the same
    role) does with its statement, asked on ``conn`` within LOCK_CHECK_SECONDS
    (TimeoutError past it)."""
    row = await conn.fetchrow(
        "SELECT state, wait_event FROM pg_stat_activity WHERE pid = $1",
        pid,
        timeout=LOCK_CHECK_SECONDS,
    )
    return _activity(row)


#: Seconds between checks that the session holding a reader lock is still there.
LOCK_CHECK_SECONDS = 5.0


class ReaderLock:
    """The advisory lock that makes a stream (a log reader, a slot) one relay's, held by a
    session of its own for the relay's life.

    The session sits idle: ended by ``idle_session_timeout``, a proxy dropping idle
    connections or ``pg_terminate_backend``, it took the lock with it while the relay went
    on, and a second relay was no longer refused (both published everything). ``check``
    (every read) says so, a ``StoreError``: the relay reconnects and takes it again, or
    is refused while another relay has it.

    Idle, it also outlives a partition: the relay gives it up (its close cut after
    CLOSE_TIMEOUT) and the server never hears of it, nor finds out before TCP keepalive
    does, while it holds the lock. So ``acquire`` first ends the session that ``release``
    gave up without the server taking its close, if the server still has it (the same
    process and backend start: never another relay's), else every reconnect was refused
    "already being read by another relay" by the relay's own abandoned session. And the
    session's backend has TCP keepalives of about COMMAND_TIMEOUT (``acquire``): with the
    kernel's defaults a relay whose host vanished (powered off, partitioned away) kept the
    lock for over two hours, a standby relay on another host refused all that time.
    """

    def __init__(self, url: str, key: str, name: str) -> None:
        self.url = url
        self.key = key
        self.name = name
        self._conn: Any = None
        self._checked_at = 0.0
        #: The server session holding the lock, and one given up without the server
        #: taking its close (``release``), which ``acquire`` ends.
        self._session: Session | None = None
        self._last: Session | None = None

    @property
    def held(self) -> bool:
        """Whether this lock's session is open (the lock taken, not known lost)."""
        return self._conn is not None and not self._conn.is_closed()

    async def acquire(self) -> bool:
        """Take the lock (False: another session has it)."""
        await self.release()
        conn = await open_connection(self.url)
        try:
            # Idle by design: a server-wide idle_session_timeout must not end it (14+). Its
            # backend's keepalives in the same round trip (see the class).
            await conn.execute(
                f"SELECT {server_keepalives_sql(COMMAND_TIMEOUT)}, "
                "(SELECT set_config('idle_session_timeout', '0', false) "
                "WHERE current_setting('server_version_num')::int >= 140000)"
            )
            ended = await self._end_last(conn)
            held = await self._take(conn)
            # An ended session lets its lock go once its process has exited: moments.
            deadline = time.monotonic() + LOCK_CHECK_SECONDS
            while ended and not held and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
                held = await self._take(conn)
        except BaseException:
            await close_connection(conn)
            raise
        if not held:
            await close_connection(conn)
            return False
        self._conn = conn
        self._checked_at = time.monotonic()
        return True

    async def _take(self, conn: Any) -> bool:
        """Try the lock on ``conn``; taken, remember the session (``release``)."""
        row = await conn.fetchrow(
            "SELECT pg_try_advisory_lock(hashtextextended($1, 0)) AS held, backend_start "
            "FROM pg_stat_activity WHERE pid = pg_backend_pid()",
            self.key,
        )
        if row is None or not row["held"]:
            return False
        self._session = (conn.get_server_pid(), row["backend_start"])
        return True

    async def _end_last(self, conn: Any) -> bool:
        """End the session this lock gave up last if the server still has it (after a
        partition: see the class); whether one was ended."""
        if self._last is None:
            return False
        last, self._last = self._last, None
        return await end_session(conn, last, self.name)

    async def check(self) -> None:
        """StoreError if the lock's session is gone: closed (seen at once), or not
        answering a ping (every LOCK_CHECK_SECONDS, for a connection cut without a word)."""
        if self._conn is None or self._conn.is_closed():
            raise StoreError(f"{self.name}: the session holding the reader lock was lost")
        if time.monotonic() - self._checked_at < LOCK_CHECK_SECONDS:
            return
        try:
            await self._conn.fetchval("SELECT 1", timeout=LOCK_CHECK_SECONDS)
        except Exception as exc:  # the driver's error or a timeout: the session is lost
            raise StoreError(
                f"{self.name}: the session holding the reader lock does not answer: {exc}"
            ) from exc
        self._checked_at = time.monotonic()

    async def activity(self, pid: int) -> str:
        """What server process ``pid`` does with its statement (``backend_activity``),
        asked on the lock's session; StoreError if that session is gone or does not answer
        within LOCK_CHECK_SECONDS: the database is out for both."""
        if not self.held:
            raise StoreError(f"{self.name}: the session holding the reader lock was lost")
        try:
            activity = await backend_activity(self._conn, pid)
        except Exception as exc:  # the driver's error or a timeout: the session is lost
            raise StoreError(
                f"{self.name}: the session holding the reader lock does not answer: "
                f"{str(exc) or type(exc).__name__}"
            ) from exc
        self._checked_at = time.monotonic()
        return activity

    async def release(self) -> None:
        if self._conn is not None:
            conn, self._conn = self._conn, None
            session, self._session = self._session, None
            # Ends the session, and with it the lock; bounded: a cut connection's close
            # would wait for an answer that never comes. Not taken by the server, the
            # session may live on there, lock held: the next acquire ends it.
            if not await close_connection(conn, LOCK_CHECK_SECONDS):
                self._last = session
