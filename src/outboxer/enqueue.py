"""The write path: add messages to the outbox on the caller's connection.

``enqueue`` and friends run one INSERT inside the caller's transaction and never
commit: if the caller rolls back, the message never existed. The connection's
type picks the SQL dialect and the driver's parameter style.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from outboxer.errors import ConfigError, DuplicateMessageError
from outboxer.message import (
    DEFAULT_DESTINATION,
    Message,
    coerce_message_id,
    encode_payload,
    validate_envelope,
)
from outboxer.stores.base import check_identifier
from outboxer.stores.sqlfiles import queries, quote_ident, render, to_numbered, to_pyformat

SUPPORTED = (
    "sync: psycopg.Connection, sqlite3.Connection, SQLAlchemy Connection or Session; "
    "async: psycopg.AsyncConnection, asyncpg.Connection (or pool connection), "
    "SQLAlchemy AsyncConnection or AsyncSession"
)


@dataclass(frozen=True)
class _Row:
    """One message as INSERT parameters."""

    message: Message

    def params(self, dialect: str) -> dict[str, Any]:
        m = self.message
        return {
            "id": str(m.id) if dialect == "sqlite" else m.id,
            "destination": m.destination,
            "topic": m.topic,
            "key": m.key,
            "payload": m.payload,
            "content_type": m.content_type,
            "headers": json.dumps(dict(m.headers), separators=(",", ":"), ensure_ascii=False),
        }


@dataclass(frozen=True)
class Outbox:
    """An outbox table: its names and the destinations each message is recorded for.

    ``outboxer.enqueue`` uses ``Outbox()``; make your own to use other names or
    several destinations::

        outbox = Outbox(schema="billing", destinations=("internal", "partner"))
        outbox.enqueue(conn, "invoice.paid", {"id": 7}, key="invoice-7")
    """

    schema: str = "outboxer"
    table: str = "outbox"
    destinations: tuple[str, ...] = (DEFAULT_DESTINATION,)
    _cache: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        check_identifier("schema", self.schema)
        check_identifier("table", self.table)
        if not self.destinations:
            raise ConfigError("an Outbox needs at least one destination")

    # ----- building rows ------------------------------------------------------------------

    def build(self, topic: str, payload: object, *, key: str | None = None,
              headers: Mapping[str, str] | None = None, message_id: object = None,
              content_type: str | None = None,
              destinations: Sequence[str] | None = None) -> list[Message]:
        """Validate and encode one message, one copy per destination. Raises PayloadError."""
        topic, key, clean_headers = validate_envelope(topic, key, headers)
        body, kind = encode_payload(payload, content_type)
        identifier = coerce_message_id(message_id)
        targets = tuple(destinations) if destinations is not None else self.destinations
        if not targets or not all(isinstance(d, str) and d for d in targets):
            raise ConfigError("destinations must be a non-empty list of destination names")
        return [
            Message(id=identifier, topic=topic, payload=body, key=key, headers=clean_headers,
                    content_type=kind, destination=destination)
            for destination in targets
        ]

    # ----- SQL per dialect and driver -----------------------------------------------------

    def _sql(self, dialect: str, name: str) -> str:
        cache_key = f"{dialect}:{name}"
        if cache_key not in self._cache:
            if dialect == "sqlite":
                tokens = {"outbox": quote_ident(self.table)}
            else:
                tokens = {"outbox": f"{quote_ident(self.schema)}.{quote_ident(self.table)}"}
            self._cache[cache_key] = render(queries(dialect)[name], tokens)
        sql: str = self._cache[cache_key]
        return sql

    # ----- sync --------------------------------------------------------------------------

    def enqueue(self, conn: Any, topic: str, payload: object, *, key: str | None = None,
                headers: Mapping[str, str] | None = None, message_id: object = None,
                content_type: str | None = None,
                destinations: Sequence[str] | None = None) -> Message:
        """Add one message in the caller's transaction; return it (with its id)."""
        messages = self.build(topic, payload, key=key, headers=headers, message_id=message_id,
                              content_type=content_type, destinations=destinations)
        self._write(conn, messages)
        return messages[0]

    def enqueue_many(self, conn: Any, items: Iterable[Mapping[str, Any]]) -> list[Message]:
        """Add several messages (each a mapping of ``enqueue``'s arguments) in one round trip."""
        built = [self.build(**dict(item)) for item in items]
        self._write(conn, [m for copies in built for m in copies])
        return [copies[0] for copies in built]

    def _write(self, conn: Any, messages: Sequence[Message]) -> None:
        driver = detect(conn)
        if driver.is_async:
            raise TypeError(f"{driver.name} is an async connection: use `await enqueue_async(...)`")
        if not messages:
            return
        try:
            driver.write(self, conn, messages)
        except Exception as exc:
            _raise_duplicate(exc, messages)
            raise

    # ----- async -------------------------------------------------------------------------

    async def enqueue_async(self, conn: Any, topic: str, payload: object, *, key: str | None = None,
                            headers: Mapping[str, str] | None = None, message_id: object = None,
                            content_type: str | None = None,
                            destinations: Sequence[str] | None = None) -> Message:
        messages = self.build(topic, payload, key=key, headers=headers, message_id=message_id,
                              content_type=content_type, destinations=destinations)
        await self._write_async(conn, messages)
        return messages[0]

    async def enqueue_many_async(self, conn: Any, items: Iterable[Mapping[str, Any]]) -> list[Message]:
        built = [self.build(**dict(item)) for item in items]
        await self._write_async(conn, [m for copies in built for m in copies])
        return [copies[0] for copies in built]

    async def _write_async(self, conn: Any, messages: Sequence[Message]) -> None:
        driver = detect(conn)
        if not driver.is_async:
            raise TypeError(f"{driver.name} is a sync connection: use `enqueue(...)`")
        if not messages:
            return
        try:
            await driver.write_async(self, conn, messages)
        except Exception as exc:
            _raise_duplicate(exc, messages)
            raise


def _raise_duplicate(exc: BaseException, messages: Sequence[Message]) -> None:
    """Turn a driver's unique violation on (id, destination) into DuplicateMessageError."""
    seen: BaseException | None = exc
    while seen is not None:  # SQLAlchemy wraps the driver's error
        name = type(seen).__name__
        text = str(seen)
        if name in ("UniqueViolation", "UniqueViolationError") or (
            name == "IntegrityError" and "UNIQUE" in text and ".id" in text
        ):
            ids = ", ".join(sorted({str(m.id) for m in messages}))
            raise DuplicateMessageError(f"a message with id {ids} is already in the outbox") from exc
        seen = seen.__cause__ or getattr(seen, "orig", None)


# ----- drivers ------------------------------------------------------------------------------


def _many_params(messages: Sequence[Message]) -> dict[str, list[Any]]:
    rows = [_Row(m).params("postgres") for m in messages]
    return {
        "ids": [r["id"] for r in rows], "destinations": [r["destination"] for r in rows],
        "topics": [r["topic"] for r in rows], "keys": [r["key"] for r in rows],
        "payloads": [r["payload"] for r in rows], "content_types": [r["content_type"] for r in rows],
        "headers": [r["headers"] for r in rows],
    }


class _Driver:
    """Runs ``:name``-style SQL on one kind of connection; returns affected rows."""

    name = "?"
    is_async = False

    def dialect(self, conn: Any) -> str:
        return "postgres"

    def execute(self, conn: Any, sql: str, params: dict[str, Any]) -> int:
        raise NotImplementedError

    async def execute_async(self, conn: Any, sql: str, params: dict[str, Any]) -> int:
        raise NotImplementedError

    def insert(self, outbox: Outbox, conn: Any, messages: Sequence[Message]) -> tuple[str, dict[str, Any]]:
        """The statement and parameters that insert ``messages`` (one round trip)."""
        dialect = self.dialect(conn)
        if len(messages) == 1:
            return outbox._sql(dialect, "insert"), _Row(messages[0]).params(dialect)
        if dialect != "postgres":
            raise AssertionError("multi-row inserts go through executemany on this dialect")
        return outbox._sql(dialect, "insert_many"), _many_params(messages)

    def write(self, outbox: Outbox, conn: Any, messages: Sequence[Message]) -> None:
        if self.dialect(conn) == "sqlite":  # no arrays: one statement per row, same transaction
            for message in messages:
                self.execute(conn, *self.insert(outbox, conn, [message]))
            return
        self.execute(conn, *self.insert(outbox, conn, messages))

    async def write_async(self, outbox: Outbox, conn: Any, messages: Sequence[Message]) -> None:
        if self.dialect(conn) == "sqlite":
            for message in messages:
                await self.execute_async(conn, *self.insert(outbox, conn, [message]))
            return
        await self.execute_async(conn, *self.insert(outbox, conn, messages))


class _Psycopg(_Driver):
    name = "psycopg.Connection"

    def execute(self, conn: Any, sql: str, params: dict[str, Any]) -> int:
        return int(conn.execute(_pyformat(sql), params).rowcount)


class _PsycopgAsync(_Driver):
    name = "psycopg.AsyncConnection"
    is_async = True

    async def execute_async(self, conn: Any, sql: str, params: dict[str, Any]) -> int:
        return int((await conn.execute(_pyformat(sql), params)).rowcount)


class _Asyncpg(_Driver):
    name = "asyncpg.Connection"
    is_async = True

    async def execute_async(self, conn: Any, sql: str, params: dict[str, Any]) -> int:
        numbered, names = _numbered(sql)
        tag = await conn.execute(numbered, *(params[name] for name in names))
        return int(str(tag).rsplit(" ", 1)[-1])


class _Sqlite(_Driver):
    name = "sqlite3.Connection"

    def dialect(self, conn: Any) -> str:
        return "sqlite"

    def execute(self, conn: Any, sql: str, params: dict[str, Any]) -> int:
        if conn.isolation_level is None and not conn.in_transaction:
            # Autocommit would commit each statement on its own; outboxer never commits for you.
            raise TypeError("sqlite3 connection is in autocommit mode and no transaction is open: "
                            "run BEGIN first, or use the default isolation_level")
        return int(conn.execute(sql, params).rowcount)


class _SqlAlchemy(_Driver):
    """Connection or Session; SQL goes through ``text()`` so the dialect's driver binds it."""

    def __init__(self, name: str, is_async: bool) -> None:
        self.name = name
        self.is_async = is_async

    def dialect(self, conn: Any) -> str:
        bind = conn.get_bind() if hasattr(conn, "get_bind") else conn
        name = str(bind.dialect.name)
        if name == "postgresql":
            return "postgres"
        if name == "sqlite":
            return "sqlite"
        raise TypeError(f"SQLAlchemy dialect {name!r} is not supported by outboxer yet")

    def execute(self, conn: Any, sql: str, params: dict[str, Any]) -> int:
        from sqlalchemy import text

        return int(conn.execute(text(sql), params).rowcount)

    async def execute_async(self, conn: Any, sql: str, params: dict[str, Any]) -> int:
        from sqlalchemy import text

        return int((await conn.execute(text(sql), params)).rowcount)


@functools.cache
def _pyformat(sql: str) -> str:
    return to_pyformat(sql)


@functools.cache
def _numbered(sql: str) -> tuple[str, tuple[str, ...]]:
    return to_numbered(sql)


def detect(conn: Any) -> _Driver:
    """Which driver ``conn`` belongs to, by its class (no driver is imported for this)."""
    kind = type(conn)
    driver = _DRIVERS.get(kind)
    if driver is None:  # once per connection class, not once per enqueue (the write path)
        driver = _DRIVERS[kind] = _driver_for(kind)
    return driver


_DRIVERS: dict[type, _Driver] = {}


def _driver_for(kind: type) -> _Driver:
    for cls in kind.__mro__:
        module, name = cls.__module__, cls.__qualname__
        root = module.split(".", 1)[0]
        if root == "psycopg":
            if name == "Connection":
                return _Psycopg()
            if name == "AsyncConnection":
                return _PsycopgAsync()
        elif root == "asyncpg" and name in ("Connection", "PoolConnectionProxy"):
            return _Asyncpg()
        elif root == "sqlite3" and name == "Connection":
            return _Sqlite()
        elif root == "sqlalchemy":
            if name in ("Connection", "Session"):
                return _SqlAlchemy(f"sqlalchemy {name}", is_async=False)
            if name in ("AsyncConnection", "AsyncSession"):
                return _SqlAlchemy(f"sqlalchemy {name}", is_async=True)
    raise TypeError(f"unsupported connection type {kind.__module__}.{kind.__qualname__}; "
                    f"outboxer supports {SUPPORTED}")


DEFAULT_OUTBOX = Outbox()


def configure(*, schema: str = "outboxer", table: str = "outbox",
              destinations: Sequence[str] = (DEFAULT_DESTINATION,)) -> Outbox:
    """Set the names and destinations that the module-level ``enqueue`` functions use."""
    global DEFAULT_OUTBOX
    DEFAULT_OUTBOX = Outbox(schema=schema, table=table, destinations=tuple(destinations))
    return DEFAULT_OUTBOX


def enqueue(conn: Any, topic: str, payload: object, *, key: str | None = None,
            headers: Mapping[str, str] | None = None, message_id: object = None,
            content_type: str | None = None, destinations: Sequence[str] | None = None) -> Message:
    """Add a message to the default outbox in the caller's transaction (never commits)."""
    return DEFAULT_OUTBOX.enqueue(conn, topic, payload, key=key, headers=headers,
                                  message_id=message_id, content_type=content_type,
                                  destinations=destinations)


async def enqueue_async(conn: Any, topic: str, payload: object, *, key: str | None = None,
                        headers: Mapping[str, str] | None = None, message_id: object = None,
                        content_type: str | None = None,
                        destinations: Sequence[str] | None = None) -> Message:
    """Async twin of :func:`enqueue` for asyncpg, psycopg async and SQLAlchemy async."""
    return await DEFAULT_OUTBOX.enqueue_async(conn, topic, payload, key=key, headers=headers,
                                              message_id=message_id, content_type=content_type,
                                              destinations=destinations)


def enqueue_many(conn: Any, items: Iterable[Mapping[str, Any]]) -> list[Message]:
    return DEFAULT_OUTBOX.enqueue_many(conn, items)


async def enqueue_many_async(conn: Any, items: Iterable[Mapping[str, Any]]) -> list[Message]:
    return await DEFAULT_OUTBOX.enqueue_many_async(conn, items)
