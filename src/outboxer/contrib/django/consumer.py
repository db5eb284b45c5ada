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
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from django.db import connections, transaction

from outboxer.consumer_db import (
    _SERVER_STATUS_IN_TRANS,
    AbortedTransaction,
    DaemonThreadPool,
    SyncSession,
    is_async_handler,
)
from outboxer.enqueue import _pyformat
from outboxer.errors import ConfigError

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
        self.conn = await self._call(self._connect)

    def _connect(self) -> Any:
        connection = connections[self.alias]
        connection.ensure_connection()
        return connection

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

    def _cursor_sql(self, sql: str) -> str:
        return _pyformat(sql)  # Django's cursors take %(name)s, SQLite's included

    def _transaction(self, work: Callable[[], T]) -> T:
        committed = database_error = False
        raw: Any = None

        def mark_committed() -> None:
            nonlocal committed
            committed = True

        try:
            # durable: the outermost block, whatever the handler opens inside it.
            with transaction.atomic(using=self.alias, durable=True):
                raw = self.conn.connection  # the driver's connection the batch runs on
                # First of the on_commit callbacks: the handler's run after it, before the ack.
                transaction.on_commit(mark_committed, using=self.alias)
                try:
                    if self.dialect == "sqlite":  # the write lock first: see consumer.sql
                        self._execute("write_lock", {})
                    result = work()
                finally:
                    # Read before the rollback, which clears it.
                    database_error = bool(self.conn.errors_occurred)
                self._refuse_aborted()
        except Exception:
            if not committed:
                self._lost = self._lost_during(raw, database_error)
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
        if _gone(raw) or raw is not self.conn.connection:
            return True
        return database_error and not self.conn.is_usable()

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
