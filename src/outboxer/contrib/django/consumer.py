"""The consumer runner on Django's connection: the handler may use the ORM, and what it
writes commits in the transaction that claims the message in the inbox.

``outboxer.Consumer`` opens connections of its own by default (psycopg, PyMySQL, sqlite3),
which the ORM knows nothing of: a handler's ``Model.objects.create()`` would run on Django's
connection, in a transaction apart from the inbox claim. Here each worker of the runner is a
thread of its own, and its session is that thread's Django connection of the outbox's alias
(``OUTBOXER["database"]``): the inbox claim, the dead-letter statements and the handler all
run on it, inside one ``transaction.atomic(durable=True)``, and the broker's ack follows the
commit. So the ORM rows a handler writes and the inbox row of the message commit together
or not at all; a redelivery finds the inbox row and the handler does not run again.

The handler is a plain function ``handler(message, connection)``: ``connection`` is Django's
(``connections[alias]``, for raw SQL through ``connection.cursor()``), and the ORM writes to
the same one as long as the models it writes are routed to that alias. Django's ORM is
synchronous: a coroutine handler is refused.

A database that stops answering. The runner's own round trips on that connection (the
connect, BEGIN, the inbox claim and the checks around the handlers, COMMIT, ROLLBACK, the
dead-letter statements) give up after ``statement_timeout``, as on the runner's own
connections (``consumer_db``): the watchdog cuts the driver's connection under Django's
(``connections[alias].connection``) off from outside the call: psycopg 3's and psycopg2's,
mysqlclient's and PyMySQL's socket shut down, SQLite interrupted. Django then drops a cut
socket's connection (its rollback fails) and is kept from connecting again in the same
call, so the thread is free at once and the batch is an outage, never acked; the runner's
reopen gives the session a new thread and with it a new connection.
"""

from __future__ import annotations

import logging
import math
import os
import sqlite3
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from django.db import connections, transaction

from outboxer.consumer_db import (
    _PG_READ_ONLY,
    _PG_TERMINATE,
    _PYMYSQL_CONNECT_TIMEOUT,
    _SERVER_STATUS_IN_TRANS,
    AbortedTransaction,
    BatchFailed,
    DaemonThreadPool,
    NoAnswerError,
    SyncSession,
    _no_answer_at_connect,
    _pg_backend,
    _read_only_answer,
    _shut,
    _shut_psycopg,
    is_async_handler,
)
from outboxer.enqueue import _pyformat, mysql_errno
from outboxer.errors import ConfigError
from outboxer.keepalive import libpq_keepalives, set_keepalives, set_keepalives_fd
from outboxer.stores.mysql import ER_READ_ONLY

if TYPE_CHECKING:
    from outboxer.config import Settings
    from outboxer.consume_cli import ConsumerSettings
    from outboxer.consumer import Consumer, SessionFactory

logger = logging.getLogger("outboxer.consumer")
T = TypeVar("T")

#: Why a batch whose atomic() block Django rolled back on its own did not count as applied.
_MARKED_FOR_ROLLBACK = (
    "the transaction was marked for rollback (transaction.set_rollback(True), or an "
    "exception caught from an inner atomic(savepoint=False) block) and Django rolled it back "
    "instead of committing"
)

#: libpq's PQTransactionStatus outside any transaction (psycopg 3's and psycopg2's alike).
_PG_IDLE = 0
#: libpq's PQTransactionStatus for a transaction a failed statement aborted (psycopg 3's
#: ``TransactionStatus.INERROR`` and psycopg2's ``TRANSACTION_STATUS_INERROR`` alike).
_PG_INERROR = 3


class DjangoSession(SyncSession):
    """One worker's session: a thread of its own and that thread's Django connection.

    Django keeps a connection per thread, so a thread per session is what makes "the
    session's connection" mean one connection: it is opened, checked and closed there.
    """

    _cuttable = True

    def __init__(self, alias: str, schema: str, dialect: str) -> None:
        super().__init__(f"django:{alias}", schema, executor=None)  # type: ignore[arg-type]
        self.alias = alias
        self.dialect = dialect
        self.executor: ThreadPoolExecutor | None = None  # type: ignore[assignment]
        #: The last batch's connection was lost: the runner opens the session again.
        self._lost = False
        #: MySQL commits before DDL (and on a handler's COMMIT): claimed each before its
        #: handler, as PyMySQLSession does, so that such a commit takes no later message's
        #: claim along (its redelivery would be skipped as a duplicate, never applied).
        #: SQLite too: one statement a message either way. PostgreSQL claims the batch at
        #: once and releases what a handler's COMMIT took along (SyncSession._release).
        self.claims_each = dialect in ("mysql", "sqlite")
        #: The driver's connection whose socket ``fileno()`` gives (psycopg2, mysqlclient),
        #: and that descriptor, read in the session's thread: mysqlclient refuses the call
        #: from another thread while one is in a query, which is when the watchdog needs it.
        self._descriptor: tuple[Any, int] | None = None

    async def _call(self, work: Callable[..., T], *args: Any) -> T:
        if self.executor is None:
            raise RuntimeError("the session is closed")
        return await super()._call(work, *args)

    async def open(self) -> None:
        if self.executor is None:
            # A daemon thread (DaemonThreadPool): a handler hung in it must not keep a
            # program that runs the Consumer as a library from exiting after run() returned.
            self.executor = DaemonThreadPool(1, thread_name_prefix=f"outboxer-{self.alias}")
        self._lost = False
        self._unanswered = None
        try:
            self.conn = await self._call(self._connect)
        finally:
            self._opening = None

    def _connect(self) -> Any:
        connection = connections[self.alias]
        added: dict[str, Any] = {}
        if connection.connection is None and self.statement_timeout is not None:
            added = _bound_connects(connection, self.statement_timeout)
            _keep_alive(connection, self.statement_timeout)
        self._refuse_reconnect_after_cut(connection)
        # The driver's connection appears half-way (Django's session setup follows, SET and
        # SELECT VERSION() on MySQL): from then on the watchdog can cut it off.
        self._opening = connection
        self._arm("the connect")
        _no_answer_at_connect(self, connection.ensure_connection)
        raw = connection.connection
        self._remember(raw)
        if self.dialect == "mysql":
            # No keepalive options in PyMySQL or mysqlclient: set on the socket, as
            # PyMySQLSession's (libpq's options do it on PostgreSQL: _keep_alive).
            if hasattr(raw, "_sock"):
                set_keepalives(raw._sock, self.statement_timeout)
            elif (known := self._descriptor) is not None and known[0] is raw:
                set_keepalives_fd(known[1], self.statement_timeout)
        for name in ("read_timeout", "write_timeout"):
            if name in added and hasattr(raw, f"_{name}"):
                # PyMySQL keeps them for every read and write after: the handshake's bound
                # only, not the handler's statements' (PyMySQLSession does the same).
                setattr(raw, f"_{name}", None)
        if self.dialect == "postgres":
            self._end_orphan(connection)
        elif self.dialect == "mysql" and self._read_only_lost:
            # A round trip only then (Session._refuse_read_only); in autocommit, as Django
            # connects.
            self._arm("the read-only check")
            with connection.cursor() as cursor:
                cursor.execute("SELECT @@global.read_only")
                row = cursor.fetchone()
            self._refuse_read_only(row is not None and bool(int(row[0])))
        return connection

    def _end_orphan(self, connection: Any) -> None:
        """PostgreSQL, as PsycopgSession's connect: read the new connection's backend id,
        and end the backend of the one the bound cut off before (``Session._orphan``: one
        waiting for a row lock does not see its client gone); the read gives the backend
        TCP keepalives too (``consumer_db._pg_backend``), on a connection of Django's psycopg
        pool as well (the server's end of it: no other thread's connect changes). In
        autocommit, as Django connects: no transaction left open, nor rolled back."""
        with connection.cursor() as cursor:
            self._arm("reading the new connection's backend id")
            cursor.execute(_pg_backend(self.statement_timeout))
            row = cursor.fetchone()
            if (orphan := self._orphan) is not None:
                self._arm("ending the connection cut off before")
                try:
                    cursor.execute(_PG_TERMINATE, orphan)
                except Exception as exc:
                    # Django's errors are not the driver's: a lost new connection is told
                    # by the connection itself (the open then fails, to be tried again).
                    if self._unanswered is not None or _gone(connection.connection):
                        raise
                    self._orphan_left(exc)
        self._orphan = None
        self._backend = (row[0], row[1]) if row is not None else None
        self._refuse_read_only(row is not None and bool(row[2]))

    def _refuse_reconnect_after_cut(self, connection: Any) -> None:
        """Have ``connection`` (this session's thread's) refuse to connect again once the
        bound cut it off, until ``open`` makes a new one (in a new thread).

        Django connects again by itself as ``atomic()`` ends: when its ROLLBACK (or the
        ROLLBACK after a failed COMMIT) fails, it closes the connection, and restoring
        autocommit then opens a new one, in the call the cut was to end. On a database that
        does not answer that connect waits in its turn (libpq's connect_timeout, 2 s at
        least), the outage reported only after it, and one that succeeds is of no use: the
        batch failed. The check takes the watchdog's lock: ``_expire`` cuts and records the
        cut under it, so the thread woken by the cut sees it recorded."""
        if getattr(connection, "_outboxer_guarded", False):
            return
        connect = connection.connect

        def connect_unless_cut() -> None:
            with self._trip.lock:
                cut = self._unanswered
            if cut is not None:
                raise NoAnswerError(
                    f"not reconnecting in the call whose round trip ({cut}) got no answer"
                )
            connect()

        connection.connect = connect_unless_cut
        connection._outboxer_guarded = True

    def _remember(self, raw: Any) -> None:
        """Read the socket's descriptor of ``raw`` where only ``fileno()`` gives it (see
        ``_descriptor``), in the session's thread, once a driver connection."""
        known = self._descriptor
        if raw is None or (known is not None and known[0] is raw):
            return
        descriptor = None
        if not (
            isinstance(raw, sqlite3.Connection) or hasattr(raw, "pgconn") or hasattr(raw, "_sock")
        ):
            try:
                descriptor = (raw, int(raw.fileno()))
            except Exception as exc:  # noqa: BLE001 -- a driver without one: not cut off
                logger.debug("no socket to cut off on %s: %s", type(raw).__name__, exc)
        self._descriptor = descriptor  # one assignment: the watchdog reads it from its thread

    def _cut(self, conn: Any) -> bool:
        # ``conn`` is Django's wrapper (``conn`` or ``_opening``); the driver's connection
        # under it, read from the loop's thread: an attribute, no use of the connection.
        raw = conn.connection
        if raw is None:
            return False
        known = self._descriptor
        return _cut_driver(raw, known[1] if known is not None and known[0] is raw else None)

    async def close(self) -> None:
        executor, self.conn = self.executor, None
        if executor is None:
            return
        try:
            await self._call(self._disconnect)
        finally:
            self.executor = None
            executor.shutdown(wait=False)  # its thread ends; a reopen starts another

    def _disconnect(self) -> None:
        try:
            connections[self.alias].close()
        except Exception as exc:  # noqa: BLE001 -- a broken connection has nothing left to close
            logger.debug("closing the consumer's Django connection failed: %s", exc)

    def broken(self) -> bool:
        # Read from the event loop's thread: attributes only, no statement (and no use of
        # the connection outside its thread, which Django refuses).
        return self._lost or _gone(self.conn.connection if self.conn is not None else None)

    def read_only_answer(self, exc: BaseException) -> bool:
        # As on the runner's own connections (consumer_db's _pg_read_only, PyMySQLSession):
        # lost, the batch applied again on a new connection (a new thread's), no attempt
        # counted. Before, Django's connection answered is_usable() there (reads succeed),
        # so each message was charged its attempts on the old server, then its dead letter
        # was refused by it too.
        return _refused_read_only(exc, self.dialect)

    def _made_read_only(self, exc: BaseException) -> bool:
        # PostgreSQL: a transaction that began writable stays so (consumer_db._pg_read_only).
        return self.dialect == "postgres" and _refused_read_only(exc, self.dialect)

    def _fenced(self, failure: BatchFailed) -> BaseException | None:
        """MySQL and MariaDB fence the transactions already open too (PyMySQLSession's
        _transaction): a handler's write that met ``SET GLOBAL read_only`` after its
        message's inbox claim is the database's failure, not the handler's, if this
        connection's server refuses writes now. The driver's refusal then, else None (also
        when that cannot be read: the handler's failure stands)."""
        if self.dialect != "mysql" or failure.stage != "handler" or self.broken():
            return None
        answer = _read_only_answer(failure.cause)
        if answer is None:
            return None
        self._arm("the read-only check")
        try:
            with self.conn.cursor() as cursor:
                cursor.execute("SELECT @@global.read_only")
                row = cursor.fetchone()
        except Exception as exc:  # noqa: BLE001 -- the handler's failure stands
            logger.debug("reading whether the server is read-only failed: %s", exc)
            return None
        return answer if row is not None and int(row[0]) else None

    def _cursor_sql(self, sql: str) -> str:
        return _pyformat(sql)  # Django's cursors take %(name)s, SQLite's included

    def _transaction(self, work: Callable[[], T]) -> T:
        committed = database_error = False
        raw: Any = None

        def mark_committed() -> None:
            nonlocal committed
            committed = True
            self._trip.disarm()  # the handler's on_commit callbacks are not the runner's

        try:
            # atomic()'s entry: autocommit off (a round trip on MySQL), BEGIN on SQLite.
            self._arm("BEGIN")
            # durable: the outermost block, whatever the handler opens inside it.
            with transaction.atomic(using=self.alias, durable=True):
                raw = self.conn.connection  # the driver's connection the batch runs on
                self._remember(raw)  # a new one if Django connected again meanwhile
                # First of the on_commit callbacks: the handler's run after it, before the ack.
                transaction.on_commit(mark_committed, using=self.alias)
                try:
                    try:
                        if self.dialect == "sqlite":  # the write lock first: see consumer.sql
                            self._execute("write_lock", {})
                        result = work()
                    finally:
                        # Read before the rollback, which clears it.
                        database_error = bool(self.conn.errors_occurred)
                    self._refuse_aborted()
                except BaseException:
                    self._arm("ROLLBACK")  # atomic()'s, as it leaves
                    raise
                # atomic()'s exit: COMMIT (or ROLLBACK, marked for it), autocommit restored
                # (a round trip on MySQL); mark_committed disarms it once they are done.
                self._arm("ROLLBACK" if transaction.get_rollback(self.alias) else "COMMIT")
        except Exception as exc:
            if not committed:
                self._lost = self._lost_during(raw, database_error)
                fenced = self._fenced(exc) if isinstance(exc, BatchFailed) else None
                if fenced is not None:
                    # The driver's refusal as the cause, which ``lost`` reads (a handler's
                    # or Django's error over it is no lost connection).
                    raise BatchFailed("commit", fenced) from exc
                raise
            # The commit happened; an on_commit callback of the handler raised after it.
            # Failing the batch now would only bring a redelivery the inbox skips.
            logger.exception("an on_commit callback failed after the consumer's commit")
        if not committed:
            # The outermost atomic() rolls back without raising when the block was marked
            # for rollback (or the connection closed in it): returning would have the batch
            # acked as applied with nothing of it in the database.
            self._lost = self._lost_during(raw, database_error)
            raise AbortedTransaction(_MARKED_FOR_ROLLBACK)
        return result

    def _lost_during(self, raw: Any, database_error: bool) -> bool:
        """Whether the batch's connection ``raw`` was lost, so that the runner counts no
        attempt. Django may have replaced it already (the rollback of a connection that
        died mid-statement can connect again), psycopg may not know yet (a backend
        terminated mid-statement leaves it looking idle): after a database error, ask the
        database, as Django does between requests (``is_usable``)."""
        if raw is None:
            return False  # the transaction did not begin: nothing of the batch ran
        if self._unanswered is not None or _gone(raw) or raw is not self.conn.connection:
            return True  # cut off by the bound, or gone
        if not database_error:
            return False
        self._arm("the connection check")  # is_usable(): a SELECT 1, or MySQL's ping
        return not self.conn.is_usable()

    def _refuse_aborted(self) -> None:
        """PostgreSQL answers COMMIT of an aborted transaction with a rollback, and neither
        psycopg nor Django says so: a handler that caught a database error and went on."""
        if self.dialect != "postgres" or self.conn is None or self.conn.connection is None:
            return
        info = getattr(self.conn.connection, "info", None)
        if info is not None and int(info.transaction_status) == _PG_INERROR:
            raise AbortedTransaction

    def _in_transaction(self) -> bool:
        # What the driver knows of the last answer, no round trip: a handler's COMMIT or
        # ROLLBACK statement (cursor.execute) ends the transaction under Django's atomic(),
        # which does not see it. PyMySQL's status flag, as PyMySQLSession reads it; libpq's
        # transaction status (psycopg 3, psycopg2); sqlite3's in_transaction. Unknown
        # (mysqlclient, which does not expose it): open.
        raw = self.conn.connection
        if raw is None or _gone(raw):
            return True  # lost: the runner's checks of a lost connection apply
        if self.dialect == "mysql":
            status = getattr(raw, "server_status", None)
            return True if status is None else bool(status & _SERVER_STATUS_IN_TRANS)
        if self.dialect == "sqlite":
            return bool(raw.in_transaction)
        info = getattr(raw, "info", None)  # psycopg 3
        state = info.transaction_status if info is not None else raw.get_transaction_status()
        return int(state) != _PG_IDLE

    def _rolled_back(self, group: str, message_id: uuid.UUID) -> bool:
        # MySQL, as PyMySQLSession: a deadlock rolls the whole transaction back and the next
        # statement begins a new one, which Django does not see (no atomic() block was left
        # by the exception): a handler that caught it and went on would have the new one
        # committed and the batch acked, its earlier writes and inbox claims gone.
        if self.dialect != "mysql" or transaction.get_rollback(using=self.alias):
            return False  # marked for rollback: Django refuses statements, _transaction fails it
        return not self._fetch("inbox_kept", self.id_params(group, message_id))

    def _claim(self, group: str, ids: Sequence[uuid.UUID]) -> set[uuid.UUID]:
        if self.dialect != "postgres":
            return super()._claim(group, ids)  # Inbox.claim on Django's connection
        if not ids:
            return set()
        # One statement for the batch, the ids sorted (one lock order for every consumer).
        params = {"consumer": group, "message_ids": sorted(ids)}
        rows = self._fetch("inbox_claim_many", params)
        return {uuid.UUID(str(row["message_id"])) for row in rows}


def _cut_driver(raw: Any, descriptor: int | None) -> bool:
    """Cut a driver's connection off from another thread, so that the call blocked on it
    returns at once with the driver's error of a lost connection; whether it could.

    By the socket's descriptor, shut down both ways and left open (the driver owns it, and
    closes it as it finds the connection gone): psycopg 3's (``pgconn.socket``), PyMySQL's
    (``_sock``), psycopg2's and mysqlclient's ``descriptor``, their ``fileno()`` read
    earlier in the session's thread (mysqlclient's the libmysqlclient connection's), used
    only while the connection is open (its number may be another socket's once closed).
    SQLite has no socket: its statement is interrupted."""
    if isinstance(raw, sqlite3.Connection):
        try:
            raw.interrupt()
        except sqlite3.ProgrammingError:  # closed already
            return False
        return True
    if hasattr(raw, "pgconn"):
        return _shut_psycopg(raw)
    if hasattr(raw, "_sock"):  # PyMySQL: None once it closed the socket
        sock = raw._sock
        fd = sock.fileno() if sock is not None else -1
    else:
        fd = -1 if descriptor is None or _gone(raw) else descriptor
    return fd >= 0 and _shut(fd)


def _bound_connects(connection: Any, bound: float) -> dict[str, Any]:
    """Bound the connects of ``connection`` (this thread's Django connection, not yet
    open) to about ``bound`` with the driver's own options, where the database's OPTIONS do
    not set them; the options added.

    The driver's connection is out of the watchdog's reach until its connect returns, so
    its own timeouts bound it: libpq's ``connect_timeout`` (psycopg 3 and psycopg2; the
    whole connect, whole seconds, 2 at least; PGCONNECT_TIMEOUT's where it is set),
    PyMySQL's ``connect_timeout`` (the TCP connect) with ``read_timeout`` and
    ``write_timeout`` for the handshake (unset once connected, see ``_connect``),
    mysqlclient's ``connect_timeout`` (the TCP connect and the server's greeting). Only this
    thread's copy of the settings changes: the other threads' connections keep theirs. Not
    with ``OPTIONS["pool"]``: that pool is shared by every thread."""
    if connection.vendor == "postgresql":
        # PGCONNECT_TIMEOUT's value where it is set, passed on (consumer_db._libpq_bounds:
        # psycopg 3.1.0 enforces only the connect_timeout it is given).
        seconds = os.environ.get("PGCONNECT_TIMEOUT") or max(2, math.ceil(bound))
        wanted: dict[str, Any] = {"connect_timeout": seconds}
    elif connection.vendor == "mysql":
        if getattr(connection.Database, "__name__", "").startswith("pymysql"):
            connect = min(_PYMYSQL_CONNECT_TIMEOUT, bound)
            wanted = {"connect_timeout": connect, "read_timeout": bound, "write_timeout": bound}
        else:
            wanted = {"connect_timeout": max(1, math.ceil(bound))}
    else:
        return {}
    return _add_options(connection, wanted)


def _keep_alive(connection: Any, bound: float) -> dict[str, Any]:
    """libpq's TCP keepalives on the connections of ``connection`` (this thread's Django
    connection, not yet open) where the database's OPTIONS do not set them, as on
    PsycopgSession's (``keepalive.libpq_keepalives``): the handler's statements are
    not the watchdog's, and one whose server's host vanished waited for ever. The options
    added; PyMySQL and mysqlclient have none (``_connect`` sets them on the socket)."""
    if connection.vendor != "postgresql":
        return {}
    return _add_options(connection, libpq_keepalives(bound))


def _add_options(connection: Any, wanted: dict[str, Any]) -> dict[str, Any]:
    """Those of ``wanted`` the OPTIONS of ``connection`` do not set, added to this thread's
    copy of its settings; the options added."""
    options = connection.settings_dict.get("OPTIONS") or {}
    if options.get("pool"):
        # Django's psycopg pool is one for the process (``_connection_pools``), made with
        # the connect arguments of the first thread to need it: the bound would become the
        # request threads' too. Its connects are the pool's, ``getconn`` bounded by its own
        # ``timeout``.
        return {}
    added = {name: value for name, value in wanted.items() if name not in options}
    if added:
        connection.settings_dict = {
            **connection.settings_dict,
            "OPTIONS": {**options, **added},
        }
    return added


def _refused_read_only(exc: BaseException, dialect: str) -> bool:
    """Whether ``exc``, Django's error (or the driver's under it), is the server refusing a
    write as read-only: PostgreSQL's SQLSTATE 25006 (psycopg 3's ``sqlstate``, psycopg2's
    ``pgcode``), MySQL's and MariaDB's ER_READ_ONLY (PyMySQL, mysqlclient)."""
    from django.db import Error

    driver = exc.__cause__ if isinstance(exc, Error) and exc.__cause__ is not None else exc
    if dialect == "postgres":
        code = getattr(driver, "sqlstate", None) or getattr(driver, "pgcode", None)
        return code == _PG_READ_ONLY
    if dialect == "mysql":
        return mysql_errno(driver) in ER_READ_ONLY
    return False


def _gone(raw: Any) -> bool:
    """Whether a driver's connection says it is closed or broken."""
    if raw is None:
        return True
    if getattr(raw, "closed", False) or getattr(raw, "broken", False):
        return True  # psycopg 3 (closed, broken), psycopg2 (closed)
    return not getattr(raw, "open", True)  # PyMySQL, mysqlclient


def django_sessions(alias: str, schema: str) -> SessionFactory:
    """The consumer's ``sessions``: a :class:`DjangoSession` per worker on ``alias``."""
    from outboxer.contrib.django import conf

    dialect = conf.dialect(alias)

    def make(executor: ThreadPoolExecutor) -> DjangoSession:
        return DjangoSession(alias, schema, dialect)  # its own thread, not the pool's

    return make


def django_consumer(
    settings: Settings, own: ConsumerSettings, alias: str, **overrides: Any
) -> Consumer:
    """The consumer ``settings`` and ``own`` describe, its handler run on Django's ``alias``
    connection; ``overrides`` replace the Consumer's arguments (``broker=None`` to replay)."""
    from outboxer.consume_cli import build_consumer
    from outboxer.consumer import load_handler

    handler = load_handler(own.require("handler"))
    if is_async_handler(handler):
        raise ConfigError(
            "a Django consumer's handler is a plain function (Django's ORM is synchronous); "
            f"{getattr(handler, '__qualname__', handler)!r} is a coroutine function (or an "
            "object whose __call__ is one)"
        )
    return build_consumer(
        settings,
        own,
        handler=handler,
        sessions=django_sessions(alias, settings.schema),
        **overrides,
    )


__all__ = ["DjangoSession", "django_consumer", "django_sessions"]
