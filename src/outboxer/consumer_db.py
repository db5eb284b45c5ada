"""The consumer's database: a connection per worker of the runner, the transaction that
applies a batch of messages (the inbox claim, then each message's handler), and the
dead-letter table.

Which connection a handler gets follows the handler: a plain function gets a sync
connection (psycopg for PostgreSQL, sqlite3, PyMySQL for MySQL/MariaDB), run in a thread of
the consumer's own pool; a coroutine function gets an async one (asyncpg, or psycopg's
``AsyncConnection`` with ``async_driver="psycopg"``) on the event loop, and so does an
object whose ``__call__`` is a coroutine function. Either way the handler writes on that
connection and never commits: the runner does, once per batch. A handler that commits or
rolls back all the same fails (``HandlerEndedTransaction``, or psycopg's ProgrammingError in
its transaction block): a batch's inbox claims must never commit apart from the handlers'
writes, so where the driver cannot refuse the call (sqlite3, PyMySQL) each message is
claimed just before its handler instead of the batch at once.

One transaction, several messages. A batch holds messages of different keys (never two of
one key), sorted by message id so that two consumers claiming the same redelivered messages
lock inbox rows in one order and cannot deadlock on them. On PostgreSQL one statement
claims the whole batch (``inbox_claim_many``); elsewhere one per message. A handler's exception rolls the
whole batch back (``BatchFailed`` names the culprit); the runner applies the others again
at once, without counting an attempt for them.

A database that stops answering. Each round trip of the runner's own (the connect and its
backend-id read, BEGIN, the inbox claim, the dead-letter statements, COMMIT, ROLLBACK) gives
up after ``Session.statement_timeout`` (``STATEMENT_TIMEOUT``, a minute, the relay's bound
on MySQL): a watchdog on the event loop cuts the connection off from outside the call (its
socket shut down, asyncpg's transport aborted, SQLite interrupted), so the blocked driver
call fails at once and its thread is free again, and the call raises NoAnswerError: an
outage (``Session.lost``), never the message's failure. The handler's own statements are not
bounded by it (the round trip is disarmed while the handler runs): ``handler_timeout`` is
their bound, and a long statement of the handler is no outage.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import errno
import functools
import inspect
import json
import logging
import math
import os
import queue
import re
import socket
import sqlite3
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, TypeVar
from urllib.parse import urlsplit

from outboxer.brokers.base import describe
from outboxer.enqueue import _numbered, _pyformat, mysql_errno  # the same conversions, cached once
from outboxer.errors import ConfigError, MissingDependencyError
from outboxer.inbox import Inbox
from outboxer.keepalive import (
    libpq_keepalives,
    server_keepalives_sql,
    set_asyncpg_keepalives,
    set_keepalives,
)
from outboxer.message import MAX_KEY_LENGTH
from outboxer.receivers.base import Delivery, decode_payload
from outboxer.redact import redact_text

# The relay's bound on a MySQL round trip and its error, for the consumer's own round trips.
from outboxer.stores.mysql import ER_READ_ONLY, STATEMENT_TIMEOUT, NoAnswerError
from outboxer.stores.sqlfiles import queries, render, table_name

logger = logging.getLogger("outboxer.consumer")
T = TypeVar("T")
SyncHandler = Callable[[Delivery, Any], object]
AsyncHandler = Callable[[Delivery, Any], Awaitable[object]]


class Result(StrEnum):
    APPLIED = "applied"
    #: The inbox already had it: applied earlier (a redelivery), the handler did not run.
    DUPLICATE = "duplicate"
    #: Not applied: an earlier message of its key is a dead letter (abandoned_blocks_key).
    HELD = "held"


class BatchFailed(Exception):
    """A batch's transaction failed and was rolled back.

    ``stage`` says where: ``handler`` (message ``index``'s handler raised: its own failure),
    ``statement`` (one of the consumer's statements before the handlers: the inbox claim,
    the dead-letter check) or ``commit`` (which no single message can be blamed for when
    the batch holds several).
    """

    def __init__(self, stage: str, cause: BaseException, index: int | None = None) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.stage = stage
        self.cause = cause
        self.index = index


@functools.cache
def _sql(dialect: str, schema: str, name: str) -> str:
    tokens = {
        "dead_letters": table_name(dialect, schema, "dead_letters"),
        "inbox": table_name(dialect, schema, "inbox"),
        "inbox_suspects": table_name(dialect, schema, "inbox_suspects"),
    }
    return render(queries(dialect, "consumer.sql")[name], tokens)


def _claimable(
    deliveries: Sequence[Delivery], held: Sequence[bool]
) -> tuple[list[int], list[Result | None]]:
    """Indexes of the messages to claim (not held), and the results so far."""
    results: list[Result | None] = [Result.HELD if h else None for h in held]
    return [i for i, h in enumerate(held) if not h], results


def _finish(results: list[Result | None]) -> list[Result]:
    return [result or Result.APPLIED for result in results]


#: What stands for a character a column cannot hold (a NUL in PostgreSQL, a lone surrogate).
REPLACEMENT = "\ufffd"
#: The dead-letter table's VARCHAR(255) columns (MySQL); the same bound everywhere.
_COLUMN_LENGTH = 255
#: PostgreSQL's SQLSTATEs for a server that is shutting down or not yet accepting connections
#: (class 08, connection exceptions, is tested by its prefix).
_PG_GONE = frozenset({"57P01", "57P02", "57P03"})
#: MySQL's CR_SERVER_LOST: a connection lost while reading (the handshake's greeting too).
_CR_SERVER_LOST = 2013
#: MySQL/MariaDB error numbers of a connection that is gone: CR_CONN_HOST_ERROR,
#: CR_SERVER_GONE_ERROR, CR_SERVER_LOST, CR_SERVER_LOST_EXTENDED, ER_SERVER_SHUTDOWN,
#: ER_CONNECTION_KILLED (MariaDB), ER_CLIENT_INTERACTION_TIMEOUT (MySQL 8).
_MYSQL_GONE = frozenset({2003, 2006, 2013, 2055, 1053, 1927, 4031})
#: SQLSTATEs of a lock wait that ran out (lock_timeout: lock_not_available) and of a
#: deadlock's victim (deadlock_detected).
_PG_LOCK_WAITS = frozenset({"55P03", "40P01"})
#: MySQL/MariaDB: ER_LOCK_WAIT_TIMEOUT (innodb_lock_wait_timeout), ER_LOCK_DEADLOCK.
_MYSQL_LOCK_WAITS = frozenset({1205, 1213})
#: PostgreSQL's SQLSTATE disk_full ("could not extend file ...: No space left on device").
_PG_DISK_FULL = "53100"
#: MySQL/MariaDB: ER_DISK_FULL, ER_RECORD_FILE_FULL ("The table ... is full": InnoDB's
#: tablespace that cannot grow), and the storage engine's or a write's errno 28 (ENOSPC):
#: ER_GET_ERRNO, ER_ERROR_ON_WRITE.
_MYSQL_FULL = frozenset({1021, 1114})
_MYSQL_ERRNO = frozenset({1030, 1026})
#: The errno of those two as their text gives it: MariaDB's ``Got error 28 "No space left
#: on device" from storage engine`` and ``Error writing file '...' (errno: 28 "No space
#: left ...")``, MySQL 8's ``Got error 28 - '...'`` and ``(errno: 28 - ...)``. Not any 28 in
#: the text: ``Got error 128 "Out of memory in engine"``, a file name with 28 in it.
_MYSQL_ENOSPC = re.compile(rf"(?:\berror|\berrno:) {errno.ENOSPC}\b", re.IGNORECASE)
_SQLITE_FULL = sqlite3.SQLITE_FULL
#: Exceptions looked at in a chain (``__cause__`` and ``__context__``, breadth first).
_CHAIN = 8


def _disk_full_answer(exc: BaseException) -> BaseException | None:
    """The database's answer that it has no space left that ``exc`` is, or that it was
    raised from or while handling (a handler's wrapper: its own, SQLAlchemy's, Django's;
    ``raise X from None`` and a ``raise`` in an ``except`` block without ``from`` alike:
    the attempt met a full database, which fails it whatever its message holds):
    PostgreSQL's disk_full (either driver, psycopg2's pgcode too), SQLite's SQLITE_FULL
    ("database or disk is full"), MySQL's disk or table full;
    None if neither (``Session.database_full``)."""
    todo: list[BaseException] = [exc]
    seen: set[int] = set()
    while todo and len(seen) < _CHAIN:
        found = todo.pop(0)
        if id(found) in seen:
            continue
        seen.add(id(found))
        if _PG_DISK_FULL in (getattr(found, "sqlstate", None), getattr(found, "pgcode", None)):
            return found
        code = getattr(found, "sqlite_errorcode", None)
        if (
            isinstance(found, sqlite3.Error)
            and isinstance(code, int)
            and code & 0xFF == _SQLITE_FULL
        ):
            return found
        number = mysql_errno(found)
        if number in _MYSQL_FULL or (
            number in _MYSQL_ERRNO
            and bool(found.args)
            and _MYSQL_ENOSPC.search(str(found.args[-1])) is not None
        ):
            return found
        todo.extend(e for e in (found.__cause__, found.__context__) if e is not None)
    return None


def _read_only_answer(exc: BaseException) -> BaseException | None:
    """MySQL's read-only refusal (``ER_READ_ONLY``) that ``exc`` is, or that it was raised
    from (a handler's wrapper: its own, SQLAlchemy's, Django's); None if neither."""
    seen: BaseException | None = exc
    for _ in range(5):
        if seen is None:
            return None
        if mysql_errno(seen) in ER_READ_ONLY:
            return seen
        seen = seen.__cause__
    return None


#: A PostgreSQL connection's backend as its session opened it: its pid and when it began;
#: and whether its server refuses writes (``transaction_read_only``: a hot standby, or a
#: default of read-only, the fence of a demoted primary), for ``Session._refuse_read_only``.
_PG_BACKEND = (
    "SELECT pid, backend_start, current_setting('transaction_read_only') = 'on' AS read_only "
    "FROM pg_stat_activity WHERE pid = pg_backend_pid()"
)


def _pg_backend(bound: float | None) -> str:
    """``_PG_BACKEND``, which a new connection sends anyway, also giving its backend TCP
    keepalives of about ``bound`` (``server_keepalives_sql``; none without a bound): a
    consumer whose host vanished (powered off, partitioned away) mid-batch kept its inbox
    claims in its open transaction for as long as the server took to notice, over two hours
    with the kernel's defaults, and the broker's redelivery of those messages to the
    group's other consumers waited on them (cut at their bound, tried again, for ever), the
    messages of the same keys behind them.

    Its caller runs it in autocommit, the orphan's end after it too, psycopg's sessions
    leaving autocommit only for the runner's first transaction: a rollback undoes the
    setting, and in one transaction committed at the end an orphan's end that failed
    (``_orphan_left``: logged, the open goes on) aborted it, so the COMMIT was a silent
    ROLLBACK and the server back at two hours. No BEGIN or COMMIT either: two round trips
    fewer per psycopg connect."""
    if bound is None:
        return _PG_BACKEND
    return _PG_BACKEND.replace(" FROM ", f", {server_keepalives_sql(bound)} AS keepalives FROM ", 1)


#: Ends an abandoned session's backend (``end_abandoned``), in psycopg's parameters. A pid
#: alone may name another backend by now (the abandoned one gone, its pid reused): only the
#: backend that also began when the abandoned session opened it is terminated.
_PG_TERMINATE = (
    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE pid = %s AND backend_start = %s"
)
_PG_TERMINATE_NUMBERED = _PG_TERMINATE.replace("%s", "$1", 1).replace("%s", "$2")  # asyncpg's


def storable(value: str, dialect: str) -> str:
    """``value`` as the database can store it: a lone surrogate (which no driver can encode
    as UTF-8) and, on PostgreSQL (whose text and jsonb refuse it), a NUL become U+FFFD.

    Only the dead-letter bookkeeping needs this: a message from another producer than
    outboxer (which refuses such text at enqueue) may carry them, and a record the database
    refuses would be tried again and again."""
    if value.isascii() and "\x00" not in value:
        return value
    text = value.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
    return text.replace("\x00", REPLACEMENT) if dialect == "postgres" else text


def _created_at_param(created: datetime | None, dialect: str) -> Any:
    """``created`` as the dialect's column takes it, or None if it cannot be converted: it
    is informative only, and a date next to the calendar's ends (0001-01-01T00:00:00+14:00)
    overflows when moved to UTC."""
    if created is None:
        return None
    try:
        if dialect == "sqlite":
            return created.timestamp()
        utc = created.astimezone(UTC) if created.tzinfo is not None else created
        # MySQL's DATETIME has no time zone: naive UTC. asyncpg converts to UTC itself, and
        # would overflow where this did not check.
        return utc.replace(tzinfo=None) if dialect == "mysql" else utc
    except (OverflowError, ValueError, OSError) as exc:
        logger.warning("created_at %s cannot be stored (%s): recorded as unknown", created, exc)
        return None


def is_async_handler(handler: object) -> bool:
    """Whether calling ``handler`` gives a coroutine to await: a coroutine function, an
    object whose class's ``__call__`` is one, or a ``functools.partial`` of either.

    ``inspect.iscoroutinefunction`` alone misses the callable objects: their handler would
    run on the sync path, and the coroutine it returned would never be awaited."""
    while isinstance(handler, functools.partial):
        handler = handler.func
    if inspect.iscoroutinefunction(handler):
        return True
    if inspect.isroutine(handler) or inspect.isclass(handler):
        return False
    # The class's __call__, not callable(): that it is a coroutine function is the question.
    call = getattr(type(handler), "__call__", None)  # noqa: B004
    return inspect.iscoroutinefunction(call)


def call_sync_handler(handler: Callable[..., Any], delivery: Delivery, conn: Any) -> Any:
    """``handler(delivery, conn)``; HandlerReturnedAwaitable if that gives an awaitable (a
    plain decorator around a coroutine function, say): what the handler meant to write never
    ran, and its transaction must not commit as if the message were applied."""
    result = handler(delivery, conn)
    if inspect.isawaitable(result):
        if inspect.iscoroutine(result):
            result.close()  # never to run: closed, Python does not warn it was never awaited
        raise HandlerReturnedAwaitable(handler, result)
    return result


class HandlerReturnedAwaitable(TypeError):
    """A handler called as a plain function returned an awaitable: a failure of the message
    (rolled back, retried, dead-lettered), never an applied one."""

    def __init__(self, handler: object, result: object) -> None:
        name = getattr(handler, "__qualname__", None) or type(handler).__qualname__
        super().__init__(
            f"handler {name} returned {type(result).__name__} instead of running: it is "
            "asynchronous but does not look it (a plain function wrapping a coroutine "
            "function?), so it ran on the sync path and nothing awaited it; make it an "
            "`async def` function, or an object whose __call__ is one, to run it on an async "
            "connection"
        )


class _RoundTrip:
    """Where the runner's own work on a session's connection is: in a round trip since
    ``started`` (None: between them, or in the handler), doing ``what`` (the MySQL store's
    ``_RoundTrips``). A sync session arms it in its thread and the watchdog reads it on the
    loop: under ``lock``, so that a connection is cut off only while its round trip still
    runs, never after its thread went on (and perhaps closed it, its descriptor reused)."""

    __slots__ = ("lock", "started", "what")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.started: float | None = None
        self.what = ""

    def arm(self, what: str) -> None:
        with self.lock:
            self.what = what
            self.started = time.monotonic()

    def disarm(self) -> None:
        with self.lock:
            self.started = None


class Session(ABC):
    """One connection of the consumer's database, used by one worker at a time."""

    dialect: str
    is_async: bool
    #: Seconds one round trip of the runner's own may take before its connection is cut off
    #: and the call raises NoAnswerError (an outage): a connect, BEGIN, a statement, COMMIT,
    #: ROLLBACK; not the handler's statements (``handler_timeout``). None: no bound. The
    #: runner sets it from ``Consumer.statement_timeout``; tests lower it.
    statement_timeout: float | None = STATEMENT_TIMEOUT
    #: Whether ``_cut`` can cut this driver's connection off from outside its call; a
    #: session of the caller's own kind (Django's connection) is not watched.
    _cuttable = False
    #: PostgreSQL: this connection's backend, pid and backend_start, read when it opened
    #: (_PG_BACKEND); None elsewhere.
    _backend: tuple[Any, Any] | None = None
    #: The last connection was given up for a read-only answer (``lost``): the next one
    #: must reach a server that takes writes (``_refuse_read_only``).
    _read_only_lost = False

    def __init__(self, url: str, schema: str) -> None:
        self.url = url
        self.schema = schema
        self.inbox = Inbox(schema=schema)
        self.conn: Any = None
        #: Set by the runner when it gave up on this session's batch at shutdown (its handler
        #: did not return): if the handler returns after all, the batch rolls back, for its
        #: messages were handed back to the broker.
        self.abandoned = False
        #: Called when a call of this session ends in a thread of its own (SyncSession),
        #: from that thread: the runner's shutdown waits for such calls (see ``busy``).
        self.on_return: Callable[[], None] | None = None
        self._trip = _RoundTrip()
        #: The round trip the bound cut this connection off in (None: not cut): every
        #: failure on it since is an outage, until ``open`` makes a new one.
        self._unanswered: str | None = None
        #: A connection being opened (its backend id read), not yet ``conn``: cut off alike.
        self._opening: Any = None
        #: The server's side of the connection the bound cut off (PostgreSQL's ``_backend``),
        #: which may go on there: a backend waiting for a lock (the inbox claim of a message
        #: another consumer of the group holds) does not see its client gone until it gets
        #: the lock. The next connection ``open`` makes ends it (_PG_TERMINATE), or each
        #: retry after the outage left one more behind, a connection slot and its claims.
        self._orphan: tuple[Any, Any] | None = None
        self._watchdog: asyncio.TimerHandle | None = None
        self._watch_loop: asyncio.AbstractEventLoop | None = None

    def busy(self) -> bool:
        """Whether a call of this session still runs in a thread after its task ended (a
        cancelled ``run_in_executor`` does not stop the thread): it is inside the session's
        transaction, so the connection must be neither closed nor used meanwhile."""
        return False

    # ----- the bound on the runner's own round trips ---------------------------------------

    def _arm(self, what: str) -> None:
        """A round trip of the runner's own begins (``_RoundTrip.arm``)."""
        self._trip.arm(what)

    def _cut(self, conn: Any) -> bool:
        """Cut ``conn`` off from outside the call using it, so that the driver's blocked
        round trip fails at once; whether it could. Drivers that can say how."""
        return False

    def _watching(self) -> bool:
        """Whether the watchdog has a call to watch (drivers say)."""
        return False

    def _watch_interval(self) -> float:
        assert self.statement_timeout is not None
        return min(1.0, self.statement_timeout / 4)

    def _ensure_watch(self) -> None:
        """Have the watchdog run while ``_watching`` (on the loop): one timer a session,
        again every ``_watch_interval``, where a timer a round trip cost each statement."""
        if not self._cuttable or self.statement_timeout is None:
            return
        loop = asyncio.get_running_loop()
        if self._watchdog is not None and self._watch_loop is loop:
            return
        self._watch_loop = loop
        self._watchdog = loop.call_later(self._watch_interval(), self._watch)

    def _watch(self) -> None:
        self._watchdog = None
        self._expire()
        if self._watching():
            self._ensure_watch()

    def _expire(self) -> None:
        """Cut the connection off if its round trip has run ``statement_timeout``."""
        bound = self.statement_timeout
        trip = self._trip
        with trip.lock:
            started = trip.started
            if bound is None or started is None or time.monotonic() - started < bound:
                return
            trip.started = None  # once a round trip
            conn = self.conn if self.conn is not None else self._opening
            if conn is None or not self._cut(conn):
                return
            self._unanswered = trip.what
            if conn is self.conn and self._backend is not None:
                self._orphan = self._backend
        logger.debug("no answer within %gs (%s): connection cut off", bound, trip.what)

    def _orphan_left(self, exc: Exception) -> None:
        """Ending ``_orphan`` failed for another reason than the new connection's loss
        (which fails the open, to be tried again): not tried again, for a connection that
        cannot open is worse than a backend left waiting."""
        if self.disconnected(exc):
            raise exc
        logger.warning(
            "ending the server's side of a consumer connection cut off after %gs failed (%s): "
            "it stays until what it waits for ends",
            self.statement_timeout,
            describe(exc),
        )

    def _no_answer(self, exc: BaseException) -> BaseException:
        """What a call whose connection the bound cut off raises instead of ``exc`` (the
        driver's error of a closed connection): NoAnswerError, as a BatchFailed of the
        consumer's own stage if ``exc`` is one (the handler's too: a handler whose statement
        met the cut connection failed for the outage, not for itself)."""
        what = self._unanswered
        error = NoAnswerError(
            f"the consumer's database did not answer within {self.statement_timeout:g}s "
            f"({what}): given up, the connection closed"
            + ("; the COMMIT may have been applied all the same" if what == "COMMIT" else "")
        )
        if isinstance(exc, BatchFailed):
            return BatchFailed("commit" if what == "COMMIT" else "statement", error)
        return error

    @contextlib.contextmanager
    def _answered(self) -> Iterator[None]:
        """Around a call of the runner's: once the bound cut its connection off, its failure
        is the NoAnswerError of ``_no_answer``."""
        try:
            yield
        except Exception as exc:
            if self._unanswered is None:
                raise
            raise self._no_answer(exc) from exc

    # ----- what each driver provides -----------------------------------------------------

    @abstractmethod
    async def open(self) -> None: ...

    @abstractmethod
    async def close(self) -> None: ...

    @abstractmethod
    def broken(self) -> bool:
        """Whether the connection is gone (the runner opens a new one)."""

    def lost(self, exc: BaseException) -> bool:
        """Whether ``exc`` (a BatchFailed, or what one of the session's own calls raised)
        means the connection is gone: an outage, not the message's fault, no attempt counted.

        What the handler raised says nothing of the connection: a FileNotFoundError, a
        timeout or a ``requests`` error of its own is its failure, counted, or the message
        would be retried at once and for ever. So for the handler's exceptions only the
        connection's state counts, read after the rollback (which a dead connection fails,
        and the driver then marks it closed). The consumer's own statements only talk to the
        database: there the driver's errors of a lost connection count as well. So does a
        round trip of the runner's own that got no answer within ``statement_timeout``."""
        if self._unanswered is not None:
            return True  # cut off by the bound: whatever failed on it since, the outage's
        if isinstance(exc, BatchFailed):
            if exc.stage == "handler":
                return self.broken()
            exc = exc.cause
        if self.read_only_answer(exc):
            self._read_only_lost = True
            return True
        return isinstance(exc, NoAnswerError) or self.broken() or self.disconnected(exc)

    def read_only_answer(self, exc: BaseException) -> bool:
        """Whether ``exc``, raised by one of the session's own database calls, is the
        server refusing a write because it is read-only (drivers say): the connection
        reached a server that is no longer the writable one (a failover that left the old
        primary up, fenced read-only), lost as a connection is (``lost``): the runner
        connects anew, where the URL's hosts or a DNS name lead to the new primary."""
        return False

    def _refuse_read_only(self, read_only: bool) -> None:
        """At a connect after a read-only answer (``_read_only_lost``): ReadOnlyDatabase if
        the new connection's server refuses writes too (``read_only``), so that the
        runner's reopen fails and backs off, as for a database it cannot reach. Handed
        out, the connection failed each lane's next apply, and each reconnected at once, on
        a server left read-only (a replica's URL, a fence before the promotion): a
        connect and a warning per message every few tenths of a second, 170 a second with
        200 keys in flight. Checked only then: a read-only command (``dead-letters list``
        on a replica) meets no read-only answer."""
        if not self._read_only_lost:
            return
        if read_only:
            raise ReadOnlyDatabase(
                "the database still refuses writes (read-only): no writable primary reached "
                "yet (a failover under way, or a URL naming a replica?)"
            )
        self._read_only_lost = False

    def disconnected(self, exc: BaseException) -> bool:
        """Whether ``exc``, raised by one of the session's own database calls, is the
        driver's word that the connection is gone (drivers add theirs to the socket's)."""
        return isinstance(exc, ConnectionError | OSError)

    def lock_waited(self, failure: BatchFailed) -> bool:
        """Whether the batch failed waiting for a lock in one of the consumer's own
        statements (the inbox claim, BEGIN IMMEDIATE, the commit), not in a handler: another
        consumer of the group holds the message (a redelivery while its transaction is still
        open) or the database's write lock. Not the message's fault, no attempt counted: the
        holder commits (the claim then finds a duplicate) or rolls back (then it applies)."""
        return failure.stage != "handler" and self.lock_timeout(failure.cause)

    def lock_timeout(self, exc: BaseException) -> bool:
        """Whether ``exc`` is the driver's error of a lock wait that ran out (or a deadlock,
        whose victim waited too); drivers say."""
        return False

    def database_full(self, exc: BaseException) -> bool:
        """Whether ``exc`` (a BatchFailed, or what one of the session's own calls raised)
        is the database's answer that its disk is full (``_disk_full_answer``), wherever it
        struck: the inbox claim, the commit, a dead letter, or a handler's own write, which
        on a full database fails whatever its message holds (as the failover's read-only
        answer, a state of the database, not of the message). An outage, no attempt
        counted, never dead-lettered for it: before, each message of an hour of a full disk
        was charged its attempts (the inbox claim's refusal taken for its own failure),
        then dead-lettered once space came back, never applied. A message that alone needs
        more space than there is waits, its key with it, until an operator makes room; a
        handler's write to another database that is full waits likewise."""
        return _disk_full_answer(exc.cause if isinstance(exc, BatchFailed) else exc) is not None

    def close_after(self, task: asyncio.Task[Any]) -> None:
        """Close the connection of a session the runner abandoned at shutdown (its handler
        or its thread still ran) once ``task``, the worker running its batch, has ended:
        never under that call, and not left open until garbage collection, a connection per
        hung batch of each ``run_async``. Async sessions: from the task's done callback, on
        the loop, without awaiting (the loop may be ending)."""
        task.add_done_callback(lambda _: self.discard())

    def discard(self) -> None:
        """Close the connection at once without awaiting (``close_after``); drivers say how.
        A session of the caller's own kind (``sessions=``) keeps its connection here."""
        return None

    def when_idle(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once the call this session runs in a thread of its own has
        ended (from that thread), at once if none runs (async sessions: none ever does)."""
        callback()

    async def end_abandoned(self, other: Session) -> bool:
        """Roll back the open transaction of ``other``, a session of the same database that
        the runner abandoned under a handler that did not end (``handler_timeout``: a sync
        handler's thread, an async handler that ignored its cancellation), from this
        session's connection: its locks (the inbox claims of its batch, SQLite's write lock)
        would otherwise hold back every later attempt at those messages for as long as the
        handler hangs. The handler, if it ever returns, finds its connection gone. Whether
        it could (False: drivers that cannot, such as a framework's session)."""
        return False

    @abstractmethod
    async def apply(
        self,
        group: str,
        deliveries: Sequence[Delivery],
        handler: Callable[..., Any],
        *,
        hold_keys: bool,
        replaying: bool = False,
        suspect: bool = False,
    ) -> list[Result]:
        """Apply ``deliveries`` in one transaction and commit; BatchFailed (rolled back) if not.

        With ``hold_keys``, a keyed message whose key has a dead letter is recorded as held
        instead. With ``replaying``, each message applied leaves the dead-letter table in
        the same transaction. With ``suspect``, each message's row of the suspects table
        (``suspect_attempt``) goes in the same transaction, whatever its result.
        """

    @abstractmethod
    async def run(self, name: str, params: Mapping[str, Any]) -> int:
        """One dead-letter statement in a transaction of its own; the rows it changed."""

    async def suspect_attempt(self, group: str, message_id: uuid.UUID) -> int:
        """Record an attempt at a redelivered message before its handler runs, committed in
        a transaction of its own; the deaths before it: recorded attempts that never ended
        (the process died under them), which no in-process count survives."""
        rows = await self.fetch("suspect_attempt", self.id_params(group, message_id))
        return int(rows[0]["deaths"])

    async def suspect_done(self, group: str, message_id: uuid.UUID) -> None:
        """The attempt ended without the apply's transaction (a handler's exception, a dead
        letter): its suspect row goes, in a transaction of its own."""
        await self.run("suspect_delete", self.id_params(group, message_id))

    @abstractmethod
    async def fetch(self, name: str, params: Mapping[str, Any]) -> list[dict[str, Any]]: ...

    # ----- shared ------------------------------------------------------------------------

    def _in_transaction(self) -> bool:
        """Whether the runner's transaction is still open after a handler, where the driver
        tells without a round trip (True where it cannot be ended, or cannot be told)."""
        return True

    def released(self, group: str, ids: Sequence[uuid.UUID]) -> tuple[str, dict[str, Any]]:
        """The statement that deletes the inbox claims ``ids`` of a batch whose transaction
        a handler ended: where the batch is claimed at once (PostgreSQL's inbox_claim_many),
        a handler's COMMIT committed the claims of the later messages, whose handlers never
        ran. Left there, every redelivery of them is a duplicate: never applied."""
        return "inbox_release_many", _many(group, ids)

    #: The id of the batch's transaction, as its inbox claim read it (PostgreSQL, whose
    #: claim of the batch at once returns it); None where it is not tracked.
    _xid: Any = None

    def _made_read_only(self, exc: BaseException) -> bool:
        """Whether ``exc``, raised by one of the consumer's own statements after the
        handlers, is the database refusing a write because the batch's transaction is
        read-only now, which on this database only a handler can have done (drivers say)."""
        return False

    def _after_handlers(self, exc: Exception, ran: Sequence[int]) -> BatchFailed:
        """The batch's failure when one of the consumer's own statements after the handlers
        ``ran`` (indexes) failed with ``exc``: the replay's dead-letter deletion, the
        suspect's row. A statement's failure (``statement``: a lost connection is an outage,
        anything else the message's), unless a handler made the transaction read-only
        (``_made_read_only``): that is the handler's failure, charged to it as
        HandlerMadeReadOnly (PostgreSQL's read-only answer alone is taken for a failover,
        no attempt counted, for ever: see _pg_read_only)."""
        if not ran or not self._made_read_only(exc):
            return BatchFailed("statement", exc)
        cause = HandlerMadeReadOnly(describe(exc))
        cause.__cause__ = exc
        if len(ran) == 1:
            return BatchFailed("handler", cause, ran[0])
        return BatchFailed("commit", cause)  # which of them is not known: each alone

    def _ended(self, ran: Sequence[int]) -> BatchFailed:
        """The batch's failure when its transaction id changed under the handlers that ran
        (indexes ``ran``): the attempt of the one handler that ran, or with several (which
        of them ran COMMIT is not known: one check a batch, not one a message) no index,
        and the runner applies each alone, where it is known."""
        if len(ran) == 1:
            return BatchFailed("handler", HandlerEndedTransaction(), ran[0])
        return BatchFailed("commit", HandlerEndedTransaction())

    @staticmethod
    def _stuck(claimed: Sequence[uuid.UUID], ran: Sequence[uuid.UUID]) -> list[uuid.UUID]:
        """The claims to release when a handler's own COMMIT committed the batch's claims
        (all made before the first handler), and which handler did is not known. The first
        handler's claim committed exactly when its writes did (they came before that COMMIT,
        or its own COMMIT took both): kept. Every later claim committed with it, their
        writes perhaps not: released, so that those messages are applied again (at worst
        twice) rather than skipped for ever as duplicates."""
        return [i for i in claimed if not ran or i != ran[0]]

    def committed_early(self, group: str, ids: Sequence[uuid.UUID]) -> None:
        if not ids:
            return  # the one handler's own failure says it (HandlerEndedTransaction)
        logger.error(
            "consumer %s: a handler committed the batch's transaction itself (a COMMIT "
            "statement), and with it the inbox claims of the whole batch; the batch failed, "
            "the claims of the messages after the first released to be applied again: %s",
            group,
            ", ".join(str(i) for i in ids),
        )

    def release_failed(self, group: str, ids: Sequence[uuid.UUID], exc: BaseException) -> None:
        logger.error(
            "consumer %s: a handler ended the batch's transaction, and deleting the inbox "
            "claims it committed for messages whose handlers never ran failed (%s): their "
            "redeliveries will be skipped as duplicates; delete them from the inbox to have "
            "them applied: %s",
            group,
            describe(exc),
            ", ".join(str(i) for i in ids),
        )

    def sql(self, name: str) -> str:
        return _sql(self.dialect, self.schema, name)

    def text(self, value: str) -> str:
        """``value`` as this database can store it (see :func:`storable`)."""
        return storable(value, self.dialect)

    def stored_key(self, key: str | None) -> str | None:
        """A message key as the dead-letter table holds it, and as ``key_blocked`` looks it
        up: storable, and cut to the column's length (MySQL's VARCHAR(255), an index entry
        in PostgreSQL), which outboxer's own keys never exceed."""
        return None if key is None else self.text(key)[:MAX_KEY_LENGTH]

    def held_query(self, group: str, delivery: Delivery) -> dict[str, Any]:
        return {"consumer": group, "key": self.stored_key(delivery.key)}

    def dead_letter_params(
        self, group: str, delivery: Delivery, error: str, attempts: int, held: bool = False
    ) -> dict[str, Any]:
        # As it arrived: an encrypted message stays encrypted at rest here too (a replay
        # decrypts it again), a claim-checked one keeps its reference.
        stored = delivery.received or delivery
        headers = {self.text(name): self.text(value) for name, value in stored.headers.items()}
        return {
            "consumer": group,
            "message_id": delivery.id if self.dialect == "postgres" else str(delivery.id),
            "topic": self.text(delivery.topic)[:_COLUMN_LENGTH],
            "key": self.stored_key(delivery.key),
            "headers": json.dumps(headers, ensure_ascii=False),
            "content_type": self.text(stored.content_type)[:_COLUMN_LENGTH],
            "payload": stored.body,
            "created_at": _created_at_param(delivery.created_at, self.dialect),
            # Shown by `dead-letters list` and the admin: masked as log lines are.
            "error": self.text(redact_text(error))[:4000],
            "attempts": attempts,
            "held": held,
        }

    def held_params(self, group: str, delivery: Delivery) -> dict[str, Any]:
        error = f"held back: an earlier message of key {delivery.key!r} is a dead letter"
        return self.dead_letter_params(group, delivery, error, 0, held=True)

    def id_params(self, group: str, message_id: uuid.UUID) -> dict[str, Any]:
        return {
            "consumer": group,
            "message_id": message_id if self.dialect == "postgres" else str(message_id),
        }

    async def record_dead_letter(
        self, group: str, delivery: Delivery, error: str, attempts: int
    ) -> None:
        """Write the dead letter. If the database refuses it for what the message holds (a
        value it cannot store that :meth:`dead_letter_params` did not foresee), write it
        without its key, headers and creation time, the refusal in its error: a dead
        letter that can never be written would stop its worker for good. A lost connection,
        a full disk, or a second refusal (the table itself is at fault then), is raised."""
        try:
            await self.run("insert", self.dead_letter_params(group, delivery, error, attempts))
            return
        except Exception as exc:
            if self.lost(exc) or self.database_full(exc):  # an outage: the runner waits
                raise
            refusal = describe(exc)
        logger.error(
            "consumer %s: the database refuses the dead letter of message %s (%s); recording "
            "it without its key, headers and created_at",
            group,
            delivery.id,
            refusal,
        )
        bare = dataclasses.replace(
            delivery.received or delivery, key=None, headers={}, created_at=None
        )
        note = f"[recorded without key, headers and created_at: {refusal[:500]}] {error}"
        await self.run("insert", self.dead_letter_params(group, bare, note, attempts))

    async def dead_letters(self, group: str | None, limit: int) -> list[DeadLetter]:
        rows = await self.fetch("list", {"consumer": group, "limit": limit})
        return [DeadLetter(row) for row in rows]

    async def dead_letters_after(self, group: str, after: int, limit: int) -> list[DeadLetter]:
        """The group's next ``limit`` dead letters after seq ``after``, in arrival order."""
        rows = await self.fetch("page_after", {"consumer": group, "after": after, "limit": limit})
        return [DeadLetter(row) for row in rows]

    async def dead_letter_seq(self, group: str, message_id: uuid.UUID) -> int | None:
        """Where the dead letter of ``message_id`` stands in arrival order; None: not here."""
        rows = await self.fetch("seq_of", self.id_params(group, message_id))
        return int(rows[0]["seq"]) if rows else None

    async def dead_letter(self, group: str, message_id: uuid.UUID) -> DeadLetter | None:
        rows = await self.fetch("one", self.id_params(group, message_id))
        return DeadLetter(rows[0]) if rows else None

    async def key_blocked_before(self, group: str, key: str, seq: int) -> bool:
        """Whether a dead letter of ``key`` that came before seq ``seq`` is still here (``key``
        as the table holds it: a dead letter's own)."""
        params = {"consumer": group, "key": key, "seq": seq}
        return bool(await self.fetch("key_blocked_before", params))


class DeadLetter:
    """A row of the dead-letter table, and the delivery a replay hands the handler."""

    def __init__(self, row: Mapping[str, Any]) -> None:
        self.seq = int(row["seq"])
        self.consumer = str(row["consumer"])
        self.error = str(row["error"])
        self.attempts = int(row["attempts"])
        self.held = bool(row["held"])
        self.failed_at = _time(row["failed_at"])
        headers = row["headers"]
        content_type = str(row["content_type"])
        body = bytes(row["payload"])
        try:
            payload = decode_payload(body, content_type)
        except ValueError:
            payload = body  # a malformed message: the handler would have to read the bytes
        self.delivery = Delivery(
            id=uuid.UUID(str(row["message_id"])),
            topic=str(row["topic"]),
            key=row["key"],
            headers=json.loads(headers) if isinstance(headers, str | bytes) else dict(headers),
            payload=payload,
            body=body,
            content_type=content_type,
            created_at=_time(row["created_at"]),
        )

    def as_dict(self) -> dict[str, Any]:
        d = self.delivery
        return {
            "seq": self.seq,
            "consumer": self.consumer,
            "message_id": str(d.id),
            "topic": d.topic,
            "key": d.key,
            "headers": dict(d.headers),
            "content_type": d.content_type,
            "payload": d.body.decode("utf-8", "replace")
            if not isinstance(d.payload, bytes)
            else d.body.hex(),
            "created_at": d.created_at.isoformat() if d.created_at else None,
            "error": self.error,
            "attempts": self.attempts,
            "held": self.held,
            "failed_at": self.failed_at.isoformat() if self.failed_at else None,
        }


def _time(value: Any) -> datetime | None:
    """A timestamp column as an aware UTC datetime (SQLite stores Unix seconds, MySQL naive UTC)."""
    if value is None:
        return None
    if isinstance(value, int | float):
        return datetime.fromtimestamp(value, UTC)
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=UTC)
    return None


# ----- sync connections, run in the consumer's threads --------------------------------------


#: A call queued for DaemonThreadPool's threads: its future, the function, its arguments.
_Call = tuple["concurrent.futures.Future[Any]", Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class DaemonThreadPool(ThreadPoolExecutor):
    """A ThreadPoolExecutor whose threads are daemon threads, for the consumer's sessions.

    ``ThreadPoolExecutor``'s threads are joined when the interpreter exits (its own atexit
    hook, ``threading._register_atexit``): a sync handler stuck for ever in one (a network
    call with no timeout) kept a program that called ``Consumer.run()`` from exiting after
    the consumer had abandoned its batch at shutdown, until SIGKILL. These threads are not
    waited for: such a thread is left behind, and when the process exits its connection goes
    with it, which rolls its transaction back (the database's doing; SQLite's journal on the
    next open). Up to ``max_workers`` threads, started on the first calls and kept: no
    thread per call. ``submit`` and ``shutdown`` are this class's own (ThreadPoolExecutor's
    attributes are not used); the type stays a ThreadPoolExecutor for session factories.
    """

    def __init__(self, max_workers: int, thread_name_prefix: str = "") -> None:
        super().__init__(max_workers, thread_name_prefix=thread_name_prefix)  # starts none
        self._size = max_workers
        self._prefix = thread_name_prefix or "outboxer"
        self._calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._guard = threading.Lock()
        self._started: list[threading.Thread] = []
        self._ended = False

    def submit(
        self, fn: Callable[..., T], /, *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._guard:
            if self._ended:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._calls.put((future, fn, args, kwargs))
            if len(self._started) < self._size:
                thread = threading.Thread(
                    target=self._serve,
                    name=f"{self._prefix}_{len(self._started)}",
                    daemon=True,
                )
                thread.start()
                self._started.append(thread)
        return future

    def grow(self) -> None:
        """One thread more, in place of one that a call abandoned by its caller holds (a
        hung handler): the pool's other callers keep as many threads as before."""
        with self._guard:
            self._size += 1

    def shrink(self) -> None:
        """``grow`` undone once the abandoned call ended: its thread serves again (threads
        never end before ``shutdown``: only no new one is started)."""
        with self._guard:
            self._size -= 1

    def _serve(self) -> None:
        while True:
            call = self._calls.get()
            if call is None:
                self._calls.put(None)  # the next thread's end too
                return
            future, fn, args, kwargs = call
            del call
            if future.set_running_or_notify_cancel():
                try:
                    result = fn(*args, **kwargs)
                except BaseException as exc:  # noqa: BLE001 -- handed to the future's owner
                    future.set_exception(exc)
                else:
                    future.set_result(result)
            del future, fn, args, kwargs  # not kept alive while waiting for the next call

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._guard:
            self._ended = True
            started = list(self._started)
        if cancel_futures:
            while True:
                try:
                    call = self._calls.get_nowait()
                except queue.Empty:
                    break
                if call is not None:
                    call[0].cancel()
        self._calls.put(None)
        if wait:
            for thread in started:
                if thread is not threading.current_thread():
                    thread.join()


class SyncSession(Session):
    """A DB-API connection; every call runs in a thread of ``executor``, one call a batch."""

    is_async = False

    def __init__(self, url: str, schema: str, executor: ThreadPoolExecutor) -> None:
        super().__init__(url, schema)
        self.executor = executor
        #: The last call's future: running in a thread until done (see Session.busy).
        self._future: concurrent.futures.Future[Any] | None = None

    def busy(self) -> bool:
        # Not done: running, or still queued (a cancelled queued call is done at once). The
        # executor moves a call to running atomically: no window in which it is neither.
        future = self._future
        return future is not None and not future.done()

    async def _call(self, work: Callable[..., T], *args: Any) -> T:
        future = self.executor.submit(self._disarmed_after, work, *args)
        self._future = future
        on_return = self.on_return
        if on_return is not None:
            future.add_done_callback(lambda _: on_return())
        # Watched as long as the thread runs the call, not only while this task awaits it:
        # a call abandoned (shutdown, handler_timeout) still rolls back on the connection.
        self._ensure_watch()
        with self._answered():
            return await asyncio.wrap_future(future)

    def _disarmed_after(self, work: Callable[..., T], *args: Any) -> T:
        """``work(*args)`` in the session's thread; between calls the connection idles."""
        try:
            return work(*args)
        finally:
            self._trip.disarm()

    def _watching(self) -> bool:
        return self.busy()

    @abstractmethod
    def _connect(self) -> Any: ...

    def _begin(self) -> None:
        return None  # psycopg and PyMySQL begin with the first statement

    def _commit(self) -> None:
        self.conn.commit()

    def _rollback(self) -> None:
        self.conn.rollback()

    @abstractmethod
    def _cursor_sql(self, sql: str) -> str:
        """The driver's form of ``:name`` parameters."""

    def _execute(self, name: str, params: Mapping[str, Any]) -> int:
        self._arm(f"the {name} statement")
        cursor = self.conn.cursor()
        try:
            cursor.execute(self._cursor_sql(self.sql(name)), dict(params))
            return int(cursor.rowcount)
        finally:
            cursor.close()

    def _fetch(self, name: str, params: Mapping[str, Any]) -> list[dict[str, Any]]:
        self._arm(f"the {name} statement")
        cursor = self.conn.cursor()
        try:
            cursor.execute(self._cursor_sql(self.sql(name)), dict(params))
            names = [column[0] for column in cursor.description]
            return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]
        finally:
            cursor.close()

    def _hold(self, group: str, delivery: Delivery) -> bool:
        """Record a keyed message as held if its key has a dead letter; whether it did."""
        if delivery.key is None or not self._fetch("key_blocked", self.held_query(group, delivery)):
            return False
        self._execute("insert", self.held_params(group, delivery))
        return True

    def close_after(self, task: asyncio.Task[Any]) -> None:
        # The task of a cancelled sync batch ends at once, its call in the thread does not:
        # closed when both have, from whichever ends last (the thread's done callback runs in
        # that thread, after the call returned: never under it). Once.
        lock = threading.Lock()
        closed = False

        def close_if_ended(_: object) -> None:
            nonlocal closed
            future = self._future
            if not task.done() or (future is not None and not future.done()):
                return
            with lock:
                if closed:
                    return
                closed = True
            self.discard()

        task.add_done_callback(close_if_ended)
        if self._future is not None:
            self._future.add_done_callback(close_if_ended)

    def discard(self) -> None:
        conn, self.conn = self.conn, None
        if conn is not None:
            _close_quietly(conn)

    def when_idle(self, callback: Callable[[], None]) -> None:
        future = self._future
        if future is None:
            callback()
        else:
            future.add_done_callback(lambda _: callback())

    #: Ends another connection's session on the server, given its ``_backend_id`` as the
    #: parameters (None: the driver has no such statement).
    _terminate_sql: str | None = None

    def _backend_id(self) -> tuple[Any, ...] | None:
        """The server's id of this session's connection, read without a round trip."""
        return None

    async def end_abandoned(self, other: Session) -> bool:
        if type(other) is not type(self) or self.conn is None:
            return False
        assert isinstance(other, SyncSession)
        if self._terminate_sql is None or (backend := other._backend_id()) is None:
            return False
        sql = self._terminate_sql

        def terminate() -> None:
            self._arm("ending an abandoned session")
            cursor = self.conn.cursor()
            try:
                cursor.execute(sql, backend)
            finally:
                cursor.close()

        await self._call(self._transaction, terminate)
        return True

    async def open(self) -> None:
        self._unanswered = None
        try:
            self.conn = await self._call(self._connect)
        finally:
            self._opening = None

    async def close(self) -> None:
        conn, self.conn = self.conn, None
        if conn is not None:
            await self._call(_close_quietly, conn)

    def _transaction(self, work: Callable[[], T]) -> T:
        self._arm("BEGIN")
        self._begin()
        try:
            result = work()
            self._arm("COMMIT")
            self._commit()
            return result
        except BaseException:
            if not self.broken():
                self._arm("ROLLBACK")
                self._rollback()
            raise

    #: Claim each message right before its handler, not the batch's at once: where the driver
    #: cannot stop a handler from committing the runner's transaction, that commit must not
    #: take the inbox claims of the batch's later messages along (see _apply).
    claims_each = False

    def _rolled_back(self, group: str, message_id: uuid.UUID) -> bool:
        """Whether the transaction whose first claim was ``message_id`` was rolled back while
        the handlers ran, unseen by ``_in_transaction`` (PyMySQLSession: a deadlock that a
        handler caught and went on from)."""
        return False

    def _claim(self, group: str, ids: Sequence[uuid.UUID]) -> set[uuid.UUID]:
        """The ids of ``ids`` claimed now (first deliveries); one statement a message here."""
        claimed = set()
        for i in ids:
            self._arm("the inbox claim")
            if self.inbox.claim(self.conn, group, i):
                claimed.add(i)
        return claimed

    def _moved(self) -> bool:
        """Whether the transaction id differs from ``_xid``, the batch's at its claim."""
        return bool(self._fetch("transaction_id", {})[0]["xid"] != self._xid)

    def _committed_early(self) -> bool:
        """After a failed batch's rollback: whether its transaction committed all the same (a
        handler's COMMIT); False if that cannot be read (the connection is gone)."""
        if self.broken():
            return False
        try:
            rows = self._transaction(
                functools.partial(self._fetch, "transaction_committed", {"xid": self._xid})
            )
        except Exception as exc:  # noqa: BLE001 -- the batch's own failure is what counts
            logger.warning("reading whether a failed batch committed early failed: %s", exc)
            return False
        return bool(rows and rows[0]["committed"])

    def _apply(
        self,
        group: str,
        deliveries: Sequence[Delivery],
        handler: SyncHandler,
        hold_keys: bool,
        replaying: bool,
        suspect: bool = False,
    ) -> list[Result]:
        release: list[uuid.UUID] = []  # see _release
        claims: list[uuid.UUID] = []  # made at once for the batch, before its handlers
        ran: list[int] = []  # the indexes of the messages whose handlers were called
        #: The handler seen ending the transaction right after it returned: then what to
        #: release is known (``release``, perhaps nothing), not guessed (``_stuck``).
        ended: list[int] = []
        self._xid = None

        def work() -> list[Result]:
            try:
                held = [hold_keys and self._hold(group, d) for d in deliveries]
                todo, results = _claimable(deliveries, held)
                claimed = (
                    None
                    if self.claims_each
                    else self._claim(group, [deliveries[i].id for i in todo])
                )
                claims.extend(claimed or ())
            except Exception as exc:
                raise BatchFailed("statement", exc) from exc
            kept: uuid.UUID | None = None  # the transaction's first claim
            for index in todo:
                message_id = deliveries[index].id
                try:
                    first = self._claim(group, [message_id]) if claimed is None else claimed
                except Exception as exc:
                    raise BatchFailed("statement", exc) from exc
                if message_id not in first:
                    results[index] = Result.DUPLICATE
                    continue
                # Not after shutdown gave up on the batch (its thread waited on a lock, in
                # the claim or BEGIN, or an earlier handler was slow): the message is the
                # broker's again, perhaps applied by another consumer meanwhile, and what a
                # handler does outside this transaction would not roll back with it.
                _refuse_abandoned(self)
                kept = kept or message_id
                ran.append(index)
                self._trip.disarm()  # the handler's statements are handler_timeout's
                try:
                    call_sync_handler(handler, deliveries[index], self.conn)
                except Exception as exc:
                    raise BatchFailed("handler", exc, index) from exc
                if not self._in_transaction():
                    # The handler committed or rolled back the runner's transaction. Claimed
                    # one by one, no later message's claim went with it: a commit kept this
                    # and the earlier messages whole (their redeliveries are duplicates), a
                    # rollback undid them, and failing here has them applied again. Claimed
                    # at once (PostgreSQL), the later messages' claims went with a commit.
                    release.extend(_unhandled(deliveries, todo, claimed, index))
                    ended.append(index)
                    raise BatchFailed("handler", HandlerEndedTransaction(), index)
            try:
                # After the handlers, not before: a handler's COMMIT would have committed
                # the dead letter's removal, and a failed replay lost it.
                for i in todo if replaying else ():
                    self._execute("delete", self.id_params(group, deliveries[i].id))
                # Held and duplicate ones too: their attempt ends with this commit as well.
                for delivery in deliveries if suspect else ():
                    self._execute("suspect_delete", self.id_params(group, delivery.id))
                rolled_back = kept is not None and self._rolled_back(group, kept)
                moved = bool(ran) and self._xid is not None and self._moved()
            except Exception as exc:
                raise self._after_handlers(exc, ran) from exc
            if rolled_back:
                raise BatchFailed("commit", AbortedTransaction(_ROLLED_BACK_UNDER_HANDLERS))
            if moved:
                raise self._ended(ran)
            _refuse_abandoned(self)
            return _finish(results)

        try:
            return self._transaction(work)
        except BatchFailed:
            # Not when the handler that ended it is known: its COMMIT took its own claim
            # with its writes, which releasing (as _stuck does for all but the first handler's)
            # would have applied again on the redelivery.
            if not ended and ran and self._xid is not None and self._committed_early():
                release = self._stuck(claims, [deliveries[i].id for i in ran])
                self.committed_early(group, release)
            if release:
                self._release(group, release)
            raise
        except Exception as exc:  # the commit (or the rollback) failed
            raise BatchFailed("commit", exc) from exc

    def _release(self, group: str, ids: Sequence[uuid.UUID]) -> None:
        """Delete the inbox claims ``ids``, made for the batch before its handlers, that a
        handler's COMMIT committed before their own handlers ran (see Session.released)."""
        try:
            self._transaction(functools.partial(self._execute, *self.released(group, ids)))
        except Exception as exc:  # noqa: BLE001 -- the batch's own failure is what the runner sees
            self.release_failed(group, ids, exc)

    async def apply(
        self,
        group: str,
        deliveries: Sequence[Delivery],
        handler: Callable[..., Any],
        *,
        hold_keys: bool,
        replaying: bool = False,
        suspect: bool = False,
    ) -> list[Result]:
        return await self._call(
            self._apply, group, deliveries, handler, hold_keys, replaying, suspect
        )

    def _suspect_attempt(self, params: Mapping[str, Any]) -> int:
        if self.dialect == "mysql":  # no RETURNING: the upsert, then the row it locked
            self._execute("suspect_attempt", params)
            rows = self._fetch("suspect_deaths", params)
        else:
            rows = self._fetch("suspect_attempt", params)
        return int(rows[0]["deaths"])

    async def suspect_attempt(self, group: str, message_id: uuid.UUID) -> int:
        work = functools.partial(self._suspect_attempt, self.id_params(group, message_id))
        return await self._call(self._transaction, work)

    async def run(self, name: str, params: Mapping[str, Any]) -> int:
        return await self._call(self._transaction, functools.partial(self._execute, name, params))

    async def fetch(self, name: str, params: Mapping[str, Any]) -> list[dict[str, Any]]:
        return await self._call(self._transaction, functools.partial(self._fetch, name, params))


def _close_quietly(conn: Any) -> None:
    try:
        conn.close()
    except Exception as exc:  # noqa: BLE001 -- a broken connection has nothing left to close
        logger.debug("closing a consumer connection failed: %s", exc)


#: PyMySQL's own connect_timeout (the TCP connect only), kept where it is below the bound.
_PYMYSQL_CONNECT_TIMEOUT = 10.0


def _shut(fd: int) -> bool:
    """Shut the socket of descriptor ``fd`` down both ways, from any thread, without closing
    the descriptor (its driver still owns it): a call blocked reading it returns at once
    (end of stream), as when the server closes; the driver then sees its connection gone."""
    if fd < 0:  # PyMySQL between closing its socket and dropping it
        return False
    try:
        sock = socket.socket(fileno=fd)
    except OSError:  # closed already, or no socket
        return False
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        return False
    finally:
        sock.detach()
    return True


def _shut_psycopg(conn: Any) -> bool:
    """``_shut`` for a psycopg connection, sync or async. Not ``pgconn.finish()``: an async
    connection's reader is registered with the loop on that descriptor."""
    try:
        fd = conn.pgconn.socket
    except Exception:  # noqa: BLE001 -- psycopg's OperationalError: no socket left to cut
        return False
    return _shut(int(fd))


def _libpq_bounds(conninfo: str, bound: float | None) -> dict[str, Any]:
    """psycopg's connect arguments bounding a connection, where ``conninfo`` does not set
    them (connect_timeout: PGCONNECT_TIMEOUT's value where it is set).

    ``connect_timeout``: libpq's whole connect, the login included, in whole seconds (2 at
    least, libpq's floor). TCP keepalives: the kernel gives up a connection whose peer
    stopped answering its probes (a host gone, a black-holed network) within about the
    bound, on every statement, the handler's too. They tell a dead peer, never a slow
    statement: a probe goes only when nothing is in flight, and an alive server's kernel
    answers it however long the statement runs. Not ``tcp_user_timeout``: it also gives up
    data left unsent because the server's receive window stays closed, as it does while
    the server waits (a handler's COPY whose row waits for another transaction's lock), so
    it cut slow statements of a live server. A peer that keeps TCP alive and never answers
    (a stalled proxy) the keepalives cannot tell: the watchdog bounds the runner's own round
    trips, ``handler_timeout`` the handler."""
    if bound is None:
        return {}
    from psycopg import conninfo as libpq_conninfo

    given = libpq_conninfo.conninfo_to_dict(conninfo)
    wanted: dict[str, Any] = {
        "connect_timeout": max(2, math.ceil(bound)),
        **libpq_keepalives(bound),
    }
    if environment := os.environ.get("PGCONNECT_TIMEOUT"):
        # The user's, passed on rather than left out: psycopg drives libpq without blocking,
        # where libpq enforces no connect timeout, and psycopg 3.1.0 enforces only the
        # connect_timeout of the conninfo (its connect waited for ever with the variable
        # set). The URL's own still wins, as in libpq.
        wanted["connect_timeout"] = environment
    return {name: value for name, value in wanted.items() if name not in given}


def _no_answer_at_connect(session: Session, connect: Callable[[], T]) -> T:
    """``connect()``; NoAnswerError where the driver gave the connect up for want of an
    answer (its connect timeout, or the handshake's read timeout)."""
    try:
        return connect()
    except Exception as exc:
        if session.statement_timeout is None or not _timed_out(exc):
            raise
        raise _connect_unanswered(session) from exc


async def _no_answer_at_connect_async(session: Session, connect: Awaitable[T]) -> T:
    """``_no_answer_at_connect`` for an async driver's connect."""
    try:
        return await connect
    except Exception as exc:
        if session.statement_timeout is None or not _timed_out(exc):
            raise
        raise _connect_unanswered(session) from exc


def _connect_unanswered(session: Session) -> NoAnswerError:
    return NoAnswerError(
        "cannot connect to the consumer's database: no answer within "
        f"{session.statement_timeout:g}s (or the URL's connect_timeout, or PGCONNECT_TIMEOUT)"
    )


def _timed_out(exc: BaseException) -> bool:
    """Whether ``exc``, or what it was raised from, is a timeout (a socket's, asyncpg's,
    psycopg's ConnectionTimeout, or a C driver's that says so in its text)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if (
            isinstance(current, TimeoutError)
            or type(current).__name__ == "ConnectionTimeout"
            or _libpq_timed_out(current)
            or _mysql_handshake_timed_out(current)
        ):
            return True
        current = current.__cause__ or current.__context__
    return False


def _libpq_timed_out(exc: BaseException) -> bool:
    """libpq's own connect_timeout, as psycopg2 raises it: a plain OperationalError with no
    SQLSTATE whose text ends "timeout expired" (after "connection to server at … failed:"
    in libpq 14 and later), with no Python exception under it to tell."""
    return (
        type(exc).__module__.split(".", 1)[0] == "psycopg2"
        and type(exc).__name__ == "OperationalError"
        and getattr(exc, "pgcode", None) is None
        and str(exc).rstrip().endswith("timeout expired")
    )


def _mysql_handshake_timed_out(exc: BaseException) -> bool:
    """mysqlclient's (libmysqlclient's) connect_timeout or read_timeout run out while it
    waited for the server's greeting: error 2013 ("Lost connection to server at 'handshake:
    reading initial communication packet', system error: 110", ETIMEDOUT), raised from C
    with no TimeoutError under it. Not every 2013: a server that closes the connection at
    once gives 2013 too, with another system error (or, from PyMySQL, no "timed out"),
    and that is no silence. PyMySQL's own 2013 of a read timeout carries its TimeoutError
    (``__context__``), seen by the caller's walk."""
    if mysql_errno(exc) != _CR_SERVER_LOST:
        return False
    text = str(exc.args[1]).rstrip() if len(exc.args) > 1 else ""
    return text.endswith(f"system error: {errno.ETIMEDOUT}") or "timed out" in text


def _psycopg_disconnected(exc: BaseException) -> bool:
    """psycopg's errors of a lost connection: InterfaceError ("the connection is closed"), or
    an OperationalError from libpq itself (no SQLSTATE), of class 08, or of a server that is
    going down. Not the other OperationalErrors: a statement timeout, a lock not available."""
    import psycopg

    if isinstance(exc, psycopg.InterfaceError):
        return True
    if not isinstance(exc, psycopg.OperationalError):
        return False
    state = exc.sqlstate
    return state is None or state.startswith("08") or state in _PG_GONE


#: SQLSTATE read_only_sql_transaction (``_pg_read_only``).
_PG_READ_ONLY = "25006"


def _pg_read_only(exc: BaseException) -> bool:
    """Whether PostgreSQL refused one of the consumer's own statements as read-only (SQLSTATE
    25006, either driver): a hot standby, or a primary demoted by a failover that stays up
    (fenced with default_transaction_read_only by Patroni or pg_auto_failover; Aurora's old
    writer turned reader), keeping the sessions it had. The consumer never makes its
    transactions read-only: the connection reached a server that is no longer the writable
    one, and counts as lost (``Session.lost``): the batch not acked, no attempt charged, the
    connection replaced (a URL naming every host with target_session_attrs=read-write, or a
    DNS name once moved, reaches the new primary). Before, the inbox claim's refusal was
    charged to each message of the batch as its failure, and its dead letter, refused by the
    same server, was tried again on the same connection for ever: nothing applied again.

    Not looked for in a handler's failure: the batch's inbox claim (a write, before any
    handler) meets it first, and a transaction that began writable stays so whatever the
    server's fence. Hence one of the consumer's statements after the handlers (a replayed
    dead letter's removal, a suspect's row) refused so met a handler's ``SET TRANSACTION
    READ ONLY``: the handler's failure (``Session._after_handlers``), where taken for a
    lost connection the message was applied again with no attempt counted, for ever,
    never dead-lettered, its key held back."""
    return getattr(exc, "sqlstate", None) == _PG_READ_ONLY


def _psycopg_in_transaction(conn: Any) -> bool:
    """libpq's transaction status of the last answer, no round trip: IDLE after a handler
    means it ran COMMIT or ROLLBACK itself (psycopg's transaction block refuses only its own
    commit() and rollback()). Not seen: a handler that went on writing after it, in a
    transaction psycopg began anew (the batch's transaction id shows it: transaction_id in
    consumer.sql). A broken connection counts as open: the runner's own checks of a lost
    one apply."""
    return bool(conn.closed or conn.broken or conn.info.transaction_status != _IDLE)


def _refuse_aborted(conn: Any) -> None:
    """psycopg commits an aborted transaction without a word (PostgreSQL rolls it back)."""
    from psycopg.pq import TransactionStatus

    if conn.info.transaction_status == TransactionStatus.INERROR:
        raise AbortedTransaction


_ROLLED_BACK_UNDER_HANDLERS = (
    "the transaction was rolled back while the handlers ran (a deadlock a handler caught and "
    "went on?), and what followed ran in a new one: rolled back too"
)
#: MySQL's SERVER_STATUS_IN_TRANS flag (pymysql.constants.SERVER_STATUS).
_SERVER_STATUS_IN_TRANS = 1
#: libpq's transaction status IDLE (psycopg.pq.TransactionStatus), not imported at module level.
_IDLE = 0


class PsycopgSession(SyncSession):
    dialect = "postgres"
    _cuttable = True

    def _connect(self) -> Any:
        psycopg = _require("psycopg", "psycopg")
        url = _libpq_url(self.url)
        # In autocommit until the runner's first transaction (see _pg_backend).
        conn = _no_answer_at_connect(
            self,
            lambda: psycopg.connect(
                url, autocommit=True, **_libpq_bounds(url, self.statement_timeout)
            ),
        )
        self._opening = conn
        try:
            self._arm("reading the new connection's backend id")
            row = conn.execute(_pg_backend(self.statement_timeout)).fetchone()
            if (orphan := self._orphan) is not None:
                self._arm("ending the connection cut off before")
                try:
                    conn.execute(_PG_TERMINATE, orphan)
                except Exception as exc:  # noqa: BLE001 -- _orphan_left sorts it
                    self._orphan_left(exc)
            self._refuse_read_only(row is not None and bool(row[2]))
            conn.autocommit = False  # no round trip: the runner's transactions BEGIN
        except BaseException:
            _close_quietly(conn)
            raise
        self._orphan = None
        self._backend = (row[0], row[1]) if row is not None else None
        return conn

    def _cut(self, conn: Any) -> bool:
        return _shut_psycopg(conn)

    def _transaction(self, work: Callable[[], T]) -> T:
        # In psycopg's transaction block, so that a handler's conn.commit() or rollback() is
        # a ProgrammingError (its failure) instead of ending the batch's transaction: a
        # commit would make the inbox claims of the batch's later messages stick whatever
        # their handlers do (a failed one then skipped as a duplicate for ever), a rollback
        # would undo earlier messages that are then acked as applied.
        if self.conn.info.transaction_status != _IDLE:
            self._arm("ROLLBACK")
            self.conn.rollback()  # a block entered mid-transaction would be a mere savepoint
        self._arm("BEGIN")
        with self.conn.transaction():
            try:
                result = work()
                _refuse_aborted(self.conn)
            except BaseException:
                self._arm("ROLLBACK")  # the block's end, as it leaves
                raise
            self._arm("COMMIT")
            return result

    def _claim(self, group: str, ids: Sequence[uuid.UUID]) -> set[uuid.UUID]:
        if not ids:
            return set()
        rows = self._fetch("inbox_claim_many", _many(group, ids))
        self._xid = rows[0]["xid"] if rows else None
        return {row["message_id"] for row in rows}

    def _in_transaction(self) -> bool:
        return _psycopg_in_transaction(self.conn)

    def _cursor_sql(self, sql: str) -> str:
        return _pyformat(sql)

    def broken(self) -> bool:
        return self.conn is None or bool(self.conn.closed) or bool(self.conn.broken)

    def disconnected(self, exc: BaseException) -> bool:
        return super().disconnected(exc) or _psycopg_disconnected(exc)

    def read_only_answer(self, exc: BaseException) -> bool:
        return _pg_read_only(exc)

    def _made_read_only(self, exc: BaseException) -> bool:
        return _pg_read_only(exc)

    def lock_timeout(self, exc: BaseException) -> bool:
        return getattr(exc, "sqlstate", None) in _PG_LOCK_WAITS

    # The server rolls the backend's transaction back and closes its socket: a handler
    # blocked in a statement gets an error, one blocked elsewhere finds it gone later.
    _terminate_sql = _PG_TERMINATE

    def _backend_id(self) -> tuple[Any, ...] | None:
        return None if self.conn is None or self.conn.closed else self._backend


class SqliteSession(SyncSession):
    dialect = "sqlite"
    _cuttable = True

    def _cut(self, conn: Any) -> bool:
        # No socket: a statement still running is interrupted (busy_timeout, 30 s, ends a
        # lock wait first). A read blocked in the kernel (a hung network file system) is
        # not: its thread stays until the read returns.
        try:
            conn.interrupt()
        except sqlite3.ProgrammingError:  # closed already
            return False
        return True

    def _connect(self) -> Any:
        from outboxer.stores.sqlite import open_connection, sqlite_path

        return open_connection(sqlite_path(self.url))

    def _begin(self) -> None:
        # IMMEDIATE: the write lock now, not half-way through the batch (where waiting for
        # it could fail with "database is locked" instead of waiting busy_timeout).
        self.conn.execute("BEGIN IMMEDIATE")

    def _commit(self) -> None:
        self.conn.execute("COMMIT")

    def _rollback(self) -> None:
        if self.conn.in_transaction:
            self.conn.execute("ROLLBACK")

    claims_each = True

    def _in_transaction(self) -> bool:
        return bool(self.conn.in_transaction)

    def _cursor_sql(self, sql: str) -> str:
        return sql  # sqlite3 binds :name itself

    def broken(self) -> bool:
        # A connection the handler closed: every later call fails (ProgrammingError), the
        # dead letter's too, so that the worker retried for ever; a new one is opened instead.
        # sqlite3 has no `closed`: reading an attribute of a closed connection raises.
        if self.conn is None:
            return True
        try:
            self.conn.total_changes  # noqa: B018 -- read for whether it raises
        except sqlite3.ProgrammingError:
            return True
        return False

    def lock_timeout(self, exc: BaseException) -> bool:
        # busy_timeout ran out: "database is locked" (SQLITE_BUSY, or SQLITE_LOCKED), at
        # BEGIN IMMEDIATE most of the time, another connection holding the write lock.
        code = getattr(exc, "sqlite_errorcode", None)
        return (
            isinstance(exc, sqlite3.OperationalError)
            and code is not None
            and (code & 0xFF in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED))
        )

    async def end_abandoned(self, other: Session) -> bool:
        # No server to ask: the abandoned connection itself is interrupted (sqlite3's
        # interrupt() is meant to be called from another thread) and closed, which rolls its
        # transaction back and releases the write lock (check_same_thread=False, and
        # SQLite's serialized mode guards the call). In this session's thread, not the
        # loop's: a close waits for a statement still running on it.
        if not isinstance(other, SqliteSession) or other.conn is None:
            return False
        conn = other.conn

        def close() -> None:
            with contextlib.suppress(sqlite3.ProgrammingError):  # closed already
                conn.interrupt()
            _close_quietly(conn)

        await self._call(close)
        return True


class PyMySQLSession(SyncSession):
    dialect = "mysql"
    _cuttable = True

    def _connect(self) -> Any:
        _require("pymysql", "mysql")
        from outboxer.stores.mysql import mysql_connect_args
        from outboxer.stores.mysql_tls import connect_pymysql

        args = mysql_connect_args(self.url)
        bound = self.statement_timeout
        if bound is not None:
            # connect_timeout covers the TCP connect only (PyMySQL's default, 10 s, unless
            # the URL says); the handshake's reads and writes wait read_timeout and
            # write_timeout, which the connection keeps for every read after: not the
            # handler's statements, so they are unset once it is open (the watchdog bounds
            # the runner's own).
            args.setdefault("connect_timeout", min(_PYMYSQL_CONNECT_TIMEOUT, bound))
            args["read_timeout"] = args["write_timeout"] = bound
        conn = _no_answer_at_connect(self, lambda: connect_pymysql(args))
        conn._read_timeout = conn._write_timeout = None
        set_keepalives(conn._sock, bound)
        if self._read_only_lost:  # a round trip only then (Session._refuse_read_only)
            self._opening = conn
            try:
                self._arm("the read-only check")
                with conn.cursor() as cursor:
                    cursor.execute("SELECT @@global.read_only")
                    (value,) = cursor.fetchone()
                conn.rollback()
                self._refuse_read_only(bool(int(value)))
            except BaseException:
                _close_quietly(conn)
                raise
        return conn

    def _cut(self, conn: Any) -> bool:
        sock = conn._sock  # None once PyMySQL closed it
        # By its descriptor: an SSLSocket's own shutdown() unwraps it under the reading thread.
        return sock is not None and _shut(sock.fileno())

    def _begin(self) -> None:
        self.conn.begin()

    def _transaction(self, work: Callable[[], T]) -> T:
        try:
            return super()._transaction(work)
        except BatchFailed as failure:
            # MariaDB and MySQL fence the transactions already open too: SET GLOBAL
            # read_only between a message's inbox claim and its handler's write fails that
            # write (and would fail the COMMIT). Not the handler's failure, no attempt: the
            # database's, if this connection's server is read-only now (a handler's own
            # read-only database elsewhere leaves it the handler's).
            # The driver's refusal itself as the cause, not the handler's error it may lie
            # under: the runner judges a commit's failure by its cause (``lost``), and a
            # handler's own error from it (``raise ... from exc``) was no lost connection,
            # so it was charged to the message all the same.
            answer = _read_only_answer(failure.cause) if failure.stage == "handler" else None
            if answer is not None and self._server_read_only():
                raise BatchFailed("commit", answer) from failure
            raise

    def _server_read_only(self) -> bool:
        """Whether this connection's server refuses writes now; False if that cannot be
        read (a broken connection is an outage of its own)."""
        if self.broken():
            return False
        self._arm("the read-only check")
        try:
            with self.conn.cursor() as cursor:
                cursor.execute("SELECT @@global.read_only")
                (value,) = cursor.fetchone()
            self.conn.rollback()
        except Exception as exc:  # noqa: BLE001 -- the handler's failure stands
            logger.debug("reading whether the server is read-only failed: %s", exc)
            return False
        return bool(int(value))

    claims_each = True

    def _in_transaction(self) -> bool:
        # The server's status flag of the last answer. A handler that commits and then writes
        # again has begun a new transaction: not seen, but its claim committed with its
        # earlier writes, so no other message's claim is lost with it.
        return bool(self.conn.server_status & _SERVER_STATUS_IN_TRANS)

    def _rolled_back(self, group: str, message_id: uuid.UUID) -> bool:
        # A deadlock rolls back the whole transaction and the next statement begins a new
        # one: a handler that caught it and went on ("retry the statement") leaves the
        # server's in-transaction flag set, and committing would ack the batch's messages
        # whose writes and claims are gone. Their first claim is gone with them.
        return not self._fetch("inbox_kept", self.id_params(group, message_id))

    def _cursor_sql(self, sql: str) -> str:
        return _pyformat(sql)

    def broken(self) -> bool:
        return self.conn is None or not self.conn.open

    def disconnected(self, exc: BaseException) -> bool:
        import pymysql

        # MariaDB answers KILL with an error and leaves the socket to close after it: the
        # connection still looks open when the error arrives.
        return (
            super().disconnected(exc)
            or isinstance(exc, pymysql.err.InterfaceError)
            or (isinstance(exc, pymysql.err.OperationalError) and mysql_errno(exc) in _MYSQL_GONE)
        )

    def read_only_answer(self, exc: BaseException) -> bool:
        # ER_READ_ONLY: this server is no primary (a failover left it up, fenced read-only).
        # Gone as well: the runner reconnects, where a proxy or DNS now leads to the
        # primary, and counts no attempt. Taken for the message's failure, each message was
        # charged its attempts on the old server and then dead-lettered (or the dead
        # letter, refused too, retried there for ever) with its handler never run.
        return mysql_errno(exc) in ER_READ_ONLY

    def lock_timeout(self, exc: BaseException) -> bool:
        import pymysql

        return isinstance(exc, pymysql.err.MySQLError) and mysql_errno(exc) in _MYSQL_LOCK_WAITS

    # MySQL's connection ids are not reused until the counter wraps (2^32 at least).
    _terminate_sql = "KILL CONNECTION %s"

    def _backend_id(self) -> tuple[Any, ...] | None:
        conn = self.conn
        return None if conn is None or not conn.open else (conn.thread_id(),)


# ----- async connections, on the event loop -------------------------------------------------


class AsyncSession(Session):
    is_async = True
    #: The task running this session's last ``apply``: the worker's own, or one of its own
    #: that the runner watches (``handler_timeout``) and may abandon under a handler that
    #: ignores its cancellation, still running on this connection after the worker moved on.
    _applying: asyncio.Task[Any] | None = None

    def busy(self) -> bool:
        task = self._applying
        return task is not None and not task.done()

    def _arm(self, what: str) -> None:
        # On the loop, as the watchdog: it runs while a round trip is armed.
        self._trip.arm(what)
        self._ensure_watch()

    def _watching(self) -> bool:
        return self._trip.started is not None

    @contextlib.contextmanager
    def _answered(self) -> Iterator[None]:
        # Disarmed at the end, however the call ends (a cancellation too): between calls
        # the connection idles, unbounded.
        try:
            with super()._answered():
                yield
        finally:
            self._trip.disarm()

    def when_idle(self, callback: Callable[[], None]) -> None:
        task = self._applying
        if task is None or task.done():
            callback()
        else:
            task.add_done_callback(lambda _: callback())

    def close_after(self, task: asyncio.Task[Any]) -> None:
        # Once both ``task`` (a worker) and the task running the batch have ended: the
        # handler may go on in the latter after the worker was cancelled or moved on.
        applying = self._applying

        def close_if_ended(_: object) -> None:
            if task.done() and (applying is None or applying.done()):
                self.discard()  # once: it leaves no connection to close again

        task.add_done_callback(close_if_ended)
        if applying is not None and applying is not task:
            applying.add_done_callback(close_if_ended)

    async def end_abandoned(self, other: Session) -> bool:
        # From this fresh connection, as PsycopgSession does: the abandoned handler's task
        # still holds the other one, maybe mid-statement (a lock wait, a slow query), which
        # closing the socket would not stop on the server until it ended.
        if type(other) is not type(self) or self.conn is None:
            return False
        assert isinstance(other, AsyncSession)
        backend = other._backend if other.conn is not None else None
        if backend is None:
            return False
        with self._answered():
            await self._transaction(functools.partial(self._terminate, backend))
        return True

    async def _terminate(self, backend: tuple[Any, Any]) -> None:
        """Run _PG_TERMINATE for ``backend`` (drivers with a server to ask say how)."""
        raise NotImplementedError

    @abstractmethod
    async def _begin(self) -> Any: ...

    @abstractmethod
    async def _execute(self, name: str, params: Mapping[str, Any]) -> int: ...

    @abstractmethod
    async def _fetch(self, name: str, params: Mapping[str, Any]) -> list[dict[str, Any]]: ...

    async def _hold(self, group: str, delivery: Delivery) -> bool:
        """Record a keyed message as held if its key has a dead letter; whether it did."""
        if delivery.key is None or not await self._fetch(
            "key_blocked", self.held_query(group, delivery)
        ):
            return False
        await self._execute("insert", self.held_params(group, delivery))
        return True

    async def _transaction(self, work: Callable[[], Awaitable[T]]) -> T:
        self._arm("BEGIN")
        transaction = await self._begin()
        try:
            result = await work()
            self._arm("COMMIT")
            await transaction.commit()
            return result
        except BaseException:
            if not self.broken():
                self._arm("ROLLBACK")
                await transaction.rollback()
            raise

    async def _claim(self, group: str, ids: Sequence[uuid.UUID]) -> set[uuid.UUID]:
        """The ids of ``ids`` claimed now (first deliveries)."""
        claimed = set()
        for i in ids:
            self._arm("the inbox claim")
            if await self.inbox.claim_async(self.conn, group, i):
                claimed.add(i)
        return claimed

    async def _claim_many(self, group: str, ids: Sequence[uuid.UUID]) -> set[uuid.UUID]:
        """PostgreSQL's claim of the batch at once, which reads the transaction's id too."""
        if not ids:
            return set()
        rows = await self._fetch("inbox_claim_many", _many(group, ids))
        self._xid = rows[0]["xid"] if rows else None
        return {row["message_id"] for row in rows}

    async def _moved(self) -> bool:
        """Whether the transaction id differs from ``_xid`` (SyncSession._moved)."""
        return bool((await self._fetch("transaction_id", {}))[0]["xid"] != self._xid)

    async def _committed_early(self) -> bool:
        """After a failed batch's rollback: whether its transaction committed all the same
        (SyncSession._committed_early)."""
        if self.broken():
            return False
        try:
            rows = await self.fetch("transaction_committed", {"xid": self._xid})
        except Exception as exc:  # noqa: BLE001 -- the batch's own failure is what counts
            logger.warning("reading whether a failed batch committed early failed: %s", exc)
            return False
        return bool(rows and rows[0]["committed"])

    async def apply(
        self,
        group: str,
        deliveries: Sequence[Delivery],
        handler: Callable[..., Any],
        *,
        hold_keys: bool,
        replaying: bool = False,
        suspect: bool = False,
    ) -> list[Result]:
        self._applying = asyncio.current_task()

        async def work() -> list[Result]:
            try:
                held = [hold_keys and await self._hold(group, d) for d in deliveries]
                todo, results = _claimable(deliveries, held)
                claimed = await self._claim(group, [deliveries[i].id for i in todo])
                claims.extend(claimed)
            except Exception as exc:
                raise BatchFailed("statement", exc) from exc
            for index in todo:
                if deliveries[index].id not in claimed:
                    results[index] = Result.DUPLICATE
                    continue
                _refuse_abandoned(self)  # an earlier handler ignored its cancellation
                ran.append(index)
                self._trip.disarm()  # the handler's statements are handler_timeout's
                try:
                    await handler(deliveries[index], self.conn)
                except Exception as exc:
                    raise BatchFailed("handler", exc, index) from exc
                if not self._in_transaction():
                    # A COMMIT or ROLLBACK statement of the handler (asyncpg then runs what
                    # follows in autocommit, where no failure rolls anything back): its
                    # failure, the later messages' claims released (SyncSession._apply).
                    release.extend(_unhandled(deliveries, todo, claimed, index))
                    ended.append(index)
                    raise BatchFailed("handler", HandlerEndedTransaction(), index)
            try:
                # After the handlers (SyncSession._apply says why).
                for i in todo if replaying else ():
                    await self._execute("delete", self.id_params(group, deliveries[i].id))
                for delivery in deliveries if suspect else ():  # SyncSession._apply's
                    await self._execute("suspect_delete", self.id_params(group, delivery.id))
                moved = bool(ran) and self._xid is not None and await self._moved()
            except Exception as exc:
                raise self._after_handlers(exc, ran) from exc
            if moved:
                raise self._ended(ran)
            _refuse_abandoned(self)
            return _finish(results)

        release: list[uuid.UUID] = []
        claims: list[uuid.UUID] = []  # made at once for the batch, before its handlers
        ran: list[int] = []  # the indexes of the messages whose handlers were called
        ended: list[int] = []  # SyncSession._apply's
        self._xid = None
        with self._answered():
            try:
                return await self._transaction(work)
            except BatchFailed:
                if not ended and ran and self._xid is not None and await self._committed_early():
                    release = self._stuck(claims, [deliveries[i].id for i in ran])
                    self.committed_early(group, release)
                if release:
                    try:
                        await self.run(*self.released(group, release))
                    except Exception as exc:  # noqa: BLE001 -- the batch's failure is what counts
                        self.release_failed(group, release, exc)
                raise
            except Exception as exc:  # the commit (or the rollback) failed
                raise BatchFailed("commit", exc) from exc

    async def run(self, name: str, params: Mapping[str, Any]) -> int:
        with self._answered():
            return await self._transaction(functools.partial(self._execute, name, params))

    async def fetch(self, name: str, params: Mapping[str, Any]) -> list[dict[str, Any]]:
        with self._answered():
            return await self._transaction(functools.partial(self._fetch, name, params))


def _refuse_abandoned(session: Session) -> None:
    """Before each handler and the commit: a batch the runner gave up on at shutdown runs no
    further handler and never commits (its messages are the broker's again); raised inside
    the transaction, which rolls back."""
    if session.abandoned:
        raise BatchFailed(
            "commit",
            AbortedTransaction("the consumer stopped without waiting for this batch: rolled back"),
        )


class HandlerEndedTransaction(RuntimeError):
    """The handler committed or rolled back the runner's transaction itself: a failure of
    the message (the runner commits, once per batch, after every handler returned)."""

    def __init__(self) -> None:
        super().__init__(
            "the handler ended the consumer's transaction (commit(), rollback(), a COMMIT or "
            "ROLLBACK statement, autocommit): a handler must not end it, the consumer commits "
            "once per batch after every handler returned; rolled back and retried"
        )


class ReadOnlyDatabase(ConnectionError):
    """A connection made after a read-only answer reached a server that refuses writes too
    (``Session._refuse_read_only``): no writable primary yet, an outage."""


class HandlerMadeReadOnly(RuntimeError):
    """A handler made the consumer's transaction read-only (``SET TRANSACTION READ ONLY``,
    ``SET transaction_read_only``): the consumer's own writes after it (a replayed dead
    letter's removal, a suspect's row) were refused. A failure of the message."""

    def __init__(self, refusal: str) -> None:
        super().__init__(
            "the handler made the consumer's transaction read-only (SET TRANSACTION READ "
            f"ONLY): the consumer's own writes after it were refused ({refusal}); a handler "
            "must leave the transaction writable; rolled back and retried"
        )


class AbortedTransaction(RuntimeError):
    """A transaction that was rolled back where the runner would have committed it: COMMIT of
    a transaction an earlier statement aborted (PostgreSQL rolls it back), or a framework's
    block marked for rollback (Django's ``atomic()``). The batch failed: never acked."""

    def __init__(self, reason: str | None = None) -> None:
        super().__init__(
            reason
            or "the transaction was aborted by a failed statement (did the handler catch a "
            "database error and go on?); it was rolled back"
        )


class _AsyncpgTransaction:
    """asyncpg's own transaction, so that a handler's ``async with conn.transaction()`` is a
    savepoint in it (in one begun by hand asyncpg refuses the block, InterfaceError: every
    message of such a handler became a dead letter). COMMIT of a transaction a failed
    statement aborted is a ROLLBACK in PostgreSQL, and asyncpg's commit does not look:
    a statement first tells (InFailedSQLTransactionError)."""

    def __init__(self, conn: Any, transaction: Any) -> None:
        self.conn = conn
        self.transaction = transaction
        self.committing = False
        #: A statement ran after the handlers already (the transaction id's): no SELECT 1.
        self.checked = False

    async def commit(self) -> None:
        from asyncpg.exceptions import InFailedSQLTransactionError

        try:
            if not self.checked:
                await self.conn.execute("SELECT 1")
        except InFailedSQLTransactionError:
            raise AbortedTransaction from None
        self.committing = True
        await self.transaction.commit()

    async def rollback(self) -> None:
        # Not after COMMIT failed: that ended the transaction (asyncpg's too), and asyncpg
        # would refuse with an InterfaceError, read as a lost connection. Otherwise always,
        # even if a handler ended it by hand: asyncpg forgets it only when it ends it.
        if not self.committing:
            await self.transaction.rollback()


class AsyncpgSession(AsyncSession):
    dialect = "postgres"
    _current: _AsyncpgTransaction
    _cuttable = True

    async def open(self) -> None:
        asyncpg = _require("asyncpg", "postgres")
        from outboxer.stores.postgres import asyncpg_dsn

        self._unanswered = None
        bound = self.statement_timeout
        dsn = asyncpg_dsn(self.url)
        with self._answered():
            try:
                # asyncpg's timeout covers the whole connect, the login included (its
                # default, 60 s, when there is no bound).
                conn = await _no_answer_at_connect_async(
                    self, asyncpg.connect(dsn, **({} if bound is None else {"timeout": bound}))
                )
                self._opening = conn
                try:
                    set_asyncpg_keepalives(conn, bound)
                    self._arm("reading the new connection's backend id")
                    # In autocommit: the backend's keepalives stay (_pg_backend).
                    row = await conn.fetchrow(_pg_backend(bound))
                    if (orphan := self._orphan) is not None:
                        self._arm("ending the connection cut off before")
                        try:
                            await conn.fetch(_PG_TERMINATE_NUMBERED, *orphan)
                        except Exception as exc:  # noqa: BLE001 -- _orphan_left sorts it
                            self._orphan_left(exc)
                    self._refuse_read_only(row is not None and bool(row[2]))
                except BaseException:
                    conn.terminate()
                    raise
            finally:
                self._opening = None
        self._orphan = None
        self._backend = (row[0], row[1]) if row is not None else None
        self.conn = conn

    def _cut(self, conn: Any) -> bool:
        # On the loop, as asyncpg: the call awaiting an answer fails at once (connection
        # closed), and asyncpg sends no cancel request that would wait on the same network.
        conn.terminate()
        return True

    async def close(self) -> None:
        conn, self.conn = self.conn, None
        if conn is not None and not conn.is_closed():
            try:
                await conn.close(timeout=5)
            except Exception as exc:  # noqa: BLE001 -- mid-operation when the server went away
                logger.debug("closing an asyncpg connection failed (%s): terminated", exc)
                conn.terminate()

    def broken(self) -> bool:
        return self.conn is None or bool(self.conn.is_closed())

    def disconnected(self, exc: BaseException) -> bool:
        from asyncpg import exceptions as pg

        # After the server ended it mid-statement, asyncpg may report a confused protocol
        # state (InternalClientError) before it marks the connection closed.
        gone = (
            pg.PostgresConnectionError,
            pg.InterfaceError,
            pg.InternalClientError,
            pg.AdminShutdownError,
            pg.CrashShutdownError,
            pg.CannotConnectNowError,
        )
        return super().disconnected(exc) or isinstance(exc, gone)

    def read_only_answer(self, exc: BaseException) -> bool:
        return _pg_read_only(exc)

    def _made_read_only(self, exc: BaseException) -> bool:
        return _pg_read_only(exc)

    def lock_timeout(self, exc: BaseException) -> bool:
        return getattr(exc, "sqlstate", None) in _PG_LOCK_WAITS

    def discard(self) -> None:
        conn, self.conn = self.conn, None
        if conn is not None and not conn.is_closed():
            conn.terminate()  # no await: the server rolls the open transaction back

    async def _terminate(self, backend: tuple[Any, Any]) -> None:
        self._arm("ending an abandoned session")
        await self.conn.fetch(_PG_TERMINATE_NUMBERED, *backend)

    def _in_transaction(self) -> bool:
        # The protocol's transaction status of the last answer: no round trip.
        return self.conn is None or self.conn.is_closed() or bool(self.conn.is_in_transaction())

    async def _begin(self) -> Any:
        transaction = self.conn.transaction()
        await transaction.start()
        self._current = _AsyncpgTransaction(self.conn, transaction)
        return self._current

    async def _moved(self) -> bool:
        # The statement that tells an aborted transaction before the commit, as its SELECT 1
        # would: one round trip for both.
        from asyncpg.exceptions import InFailedSQLTransactionError

        try:
            moved = await super()._moved()
        except InFailedSQLTransactionError:
            raise AbortedTransaction from None
        self._current.checked = True
        return moved

    async def _execute(self, name: str, params: Mapping[str, Any]) -> int:
        sql, names = _numbered(self.sql(name))
        self._arm(f"the {name} statement")
        tag = await self.conn.execute(sql, *(params[n] for n in names))
        return int(str(tag).rsplit(" ", 1)[-1])

    async def _fetch(self, name: str, params: Mapping[str, Any]) -> list[dict[str, Any]]:
        sql, names = _numbered(self.sql(name))
        self._arm(f"the {name} statement")
        return [dict(row) for row in await self.conn.fetch(sql, *(params[n] for n in names))]

    async def _claim(self, group: str, ids: Sequence[uuid.UUID]) -> set[uuid.UUID]:
        return await self._claim_many(group, ids)


class _PsycopgTransaction:
    """psycopg's async connection begins with its first statement: commit or roll back."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    async def commit(self) -> None:
        _refuse_aborted(self.conn)
        await self.conn.commit()

    async def rollback(self) -> None:
        await self.conn.rollback()


class PsycopgAsyncSession(AsyncSession):
    dialect = "postgres"
    _cuttable = True

    async def open(self) -> None:
        psycopg = _require("psycopg", "psycopg")
        self._unanswered = None
        url = _libpq_url(self.url)
        bounds = _libpq_bounds(url, self.statement_timeout)
        with self._answered():
            try:
                # In autocommit until the runner's first transaction (see _pg_backend).
                conn = await _no_answer_at_connect_async(
                    self, psycopg.AsyncConnection.connect(url, autocommit=True, **bounds)
                )
                self._opening = conn
                try:
                    self._arm("reading the new connection's backend id")
                    row = await (await conn.execute(_pg_backend(self.statement_timeout))).fetchone()
                    if (orphan := self._orphan) is not None:
                        self._arm("ending the connection cut off before")
                        try:
                            await conn.execute(_PG_TERMINATE, orphan)
                        except Exception as exc:  # noqa: BLE001 -- _orphan_left sorts it
                            self._orphan_left(exc)
                    self._refuse_read_only(row is not None and bool(row[2]))
                    await conn.set_autocommit(False)  # no round trip, as PsycopgSession's
                except BaseException:
                    conn.pgconn.finish()
                    raise
            finally:
                self._opening = None
        self._orphan = None
        self._backend = (row[0], row[1]) if row is not None else None
        self.conn = conn

    def _cut(self, conn: Any) -> bool:
        return _shut_psycopg(conn)

    async def close(self) -> None:
        conn, self.conn = self.conn, None
        if conn is not None:
            await conn.close()

    def broken(self) -> bool:
        return self.conn is None or bool(self.conn.closed) or bool(self.conn.broken)

    def disconnected(self, exc: BaseException) -> bool:
        return super().disconnected(exc) or _psycopg_disconnected(exc)

    def read_only_answer(self, exc: BaseException) -> bool:
        return _pg_read_only(exc)

    def _made_read_only(self, exc: BaseException) -> bool:
        return _pg_read_only(exc)

    def lock_timeout(self, exc: BaseException) -> bool:
        return getattr(exc, "sqlstate", None) in _PG_LOCK_WAITS

    def discard(self) -> None:
        conn = self.conn
        if conn is not None and conn.lock.locked():
            # A statement of an abandoned handler waits on the socket, its reader registered
            # with the loop: closing the descriptor under it would leave that registration to
            # whichever socket gets the number next. Left to close_after (its task's end).
            return
        self.conn = None
        if conn is not None and not conn.closed:
            conn.pgconn.finish()  # what AsyncConnection.close() does, without awaiting

    async def _terminate(self, backend: tuple[Any, Any]) -> None:
        self._arm("ending an abandoned session")
        await self.conn.execute(_PG_TERMINATE, backend)

    async def _begin(self) -> Any:
        return _PsycopgTransaction(self.conn)

    def _in_transaction(self) -> bool:
        # None: discarded under an abandoned handler (the runner's checks then raise).
        return self.conn is None or _psycopg_in_transaction(self.conn)

    async def _transaction(self, work: Callable[[], Awaitable[T]]) -> T:
        # psycopg's transaction block: a handler's commit() or rollback() fails the handler
        # instead of ending the batch's transaction (PsycopgSession._transaction says why).
        if self.conn.info.transaction_status != _IDLE:
            self._arm("ROLLBACK")
            await self.conn.rollback()  # a block entered mid-transaction would be a savepoint
        self._arm("BEGIN")
        async with self.conn.transaction():
            try:
                result = await work()
                _refuse_aborted(self.conn)
            except BaseException:
                self._arm("ROLLBACK")  # the block's end, as it leaves
                raise
            self._arm("COMMIT")
            return result

    async def _execute(self, name: str, params: Mapping[str, Any]) -> int:
        self._arm(f"the {name} statement")
        cursor = await self.conn.execute(_pyformat(self.sql(name)), dict(params))
        return int(cursor.rowcount)

    async def _fetch(self, name: str, params: Mapping[str, Any]) -> list[dict[str, Any]]:
        self._arm(f"the {name} statement")
        cursor = await self.conn.execute(_pyformat(self.sql(name)), dict(params))
        names = [column.name for column in cursor.description]
        return [dict(zip(names, row, strict=True)) for row in await cursor.fetchall()]

    async def _claim(self, group: str, ids: Sequence[uuid.UUID]) -> set[uuid.UUID]:
        return await self._claim_many(group, ids)


# ----- choosing one -------------------------------------------------------------------------


def dialect_of(url: str) -> str:
    scheme = urlsplit(url).scheme.lower()
    if scheme.startswith(("postgresql", "postgres")):
        return "postgres"
    if scheme.startswith("sqlite"):
        return "sqlite"
    if scheme.startswith(("mysql", "mariadb")):
        return "mysql"
    raise ConfigError(
        f"unknown database URL scheme {scheme!r} in {url!r}; the consumer supports "
        "postgresql://, sqlite:/// and mysql://"
    )


def session_factory(
    url: str, schema: str, *, is_async: bool, async_driver: str | None
) -> Callable[[ThreadPoolExecutor], Session]:
    """What makes a worker's session (sync ones run in the executor given), for the
    handler's kind; ConfigError if none fits."""
    dialect = dialect_of(url)
    if not is_async:
        kinds: dict[str, type[SyncSession]] = {
            "postgres": PsycopgSession,
            "sqlite": SqliteSession,
            "mysql": PyMySQLSession,
        }
        return functools.partial(kinds[dialect], url, schema)
    if dialect != "postgres":
        raise ConfigError(
            f"async handlers run on PostgreSQL (asyncpg or psycopg); for {dialect} write a "
            "plain (sync) handler: it gets a sqlite3 or PyMySQL connection"
        )
    driver = async_driver or "asyncpg"
    if driver not in ("asyncpg", "psycopg"):
        raise ConfigError(f"async_driver must be asyncpg or psycopg, not {driver!r}")
    session = AsyncpgSession if driver == "asyncpg" else PsycopgAsyncSession

    def make(executor: ThreadPoolExecutor) -> Session:
        return session(url, schema)  # on the event loop: no threads

    return make


def _unhandled(
    deliveries: Sequence[Delivery],
    todo: Sequence[int],
    claimed: set[uuid.UUID] | None,
    index: int,
) -> list[uuid.UUID]:
    """The ids claimed for the batch at once whose handlers come after ``index``'s."""
    if claimed is None:
        return []  # claimed each just before its handler: none made ahead
    return [deliveries[i].id for i in todo if i > index and deliveries[i].id in claimed]


def _many(group: str, ids: Sequence[uuid.UUID]) -> dict[str, Any]:
    """PostgreSQL's batch claim: the ids sorted (one lock order for every consumer)."""
    return {"consumer": group, "message_ids": sorted(ids)}


def _require(module: str, extra: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingDependencyError(module, extra) from exc


def _libpq_url(url: str) -> str:
    from outboxer.stores.postgres import asyncpg_dsn

    return asyncpg_dsn(url)  # plain postgresql://, which libpq takes as well


__all__ = [
    "STATEMENT_TIMEOUT",
    "AbortedTransaction",
    "AsyncSession",
    "BatchFailed",
    "DeadLetter",
    "HandlerEndedTransaction",
    "HandlerMadeReadOnly",
    "HandlerReturnedAwaitable",
    "NoAnswerError",
    "ReadOnlyDatabase",
    "Result",
    "Session",
    "SyncSession",
    "call_sync_handler",
    "is_async_handler",
    "session_factory",
    "storable",
]
