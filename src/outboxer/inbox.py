"""The inbox: apply each message once in effect, on the consumer's side.

Brokers deliver at least once, so a consumer sees some messages twice. Call
``Inbox.claim`` in the transaction that applies the message: it records the
message id for this consumer and returns True the first time, False for every
later delivery. Because the record commits or rolls back with the consumer's own
writes, "applied" and "recorded" can never disagree::

    inbox = outboxer.Inbox()
    with conn.transaction():
        if inbox.claim(conn, "billing", message_id):
            apply(payload)           # runs once per message, whatever the broker does
"""

from __future__ import annotations

import functools
import uuid
from dataclasses import dataclass
from typing import Any

from outboxer.enqueue import detect, mysql_errno
from outboxer.errors import PayloadError
from outboxer.redact import shown_value
from outboxer.stores.base import check_identifier
from outboxer.stores.sqlfiles import queries, render, table_name

_ER_DUP_ENTRY = 1062


@functools.cache
def _claim_sql(schema: str, dialect: str) -> str:
    """The claim statement for one schema and dialect, rendered once (once per message otherwise)."""
    return render(queries(dialect)["inbox_claim"], {"inbox": table_name(dialect, schema, "inbox")})


def check_mysql_consumer(consumer: str) -> None:
    """Refuse a consumer name that ends in a space on MySQL: the inbox's key compares with
    trailing spaces ignored (utf8mb4_bin is PAD SPACE), so 'c' and 'c ' would share one
    inbox, and a message one applied would be skipped by the other as a redelivery."""
    if consumer.endswith(" "):
        raise PayloadError(
            f"consumer {consumer!r} ends in a space: MySQL and MariaDB take it for the "
            "same consumer without it, and it would share that one's inbox"
        )


def _seen_before(exc: BaseException, dialect: str) -> bool:
    """MySQL answers a second delivery with a duplicate key (it has no ON CONFLICT DO NOTHING)."""
    seen: BaseException | None = exc
    while dialect == "mysql" and seen is not None:
        if mysql_errno(seen) == _ER_DUP_ENTRY:
            return True
        # SQLAlchemy wraps the driver's error (orig); Django re-raises it as its own (cause).
        seen = getattr(seen, "orig", None) or seen.__cause__
    return False


@dataclass(frozen=True)
class Inbox:
    """The inbox table of a schema (``<schema>.inbox``; in SQLite and MySQL, ``inbox``)."""

    schema: str = "outboxer"

    def __post_init__(self) -> None:
        check_identifier("schema", self.schema)

    def _params(
        self, conn: Any, consumer: str, message_id: object
    ) -> tuple[Any, str, str, dict[str, Any]]:
        if not isinstance(consumer, str) or not consumer or len(consumer) > 255:
            raise PayloadError("consumer must be a non-empty string of at most 255 characters")
        try:
            identifier = (
                message_id if isinstance(message_id, uuid.UUID) else uuid.UUID(str(message_id))
            )
        except ValueError:
            # Cut and escaped: the id may come off the wire, megabytes long, with control
            # characters that would forge or garble the log line this error ends up in.
            raise PayloadError(f"message_id is not a UUID: {shown_value(message_id)}") from None
        driver = detect(conn)
        dialect = driver.dialect(conn)
        if dialect == "mysql":
            check_mysql_consumer(consumer)
        sql = _claim_sql(self.schema, dialect)
        value: object = identifier if dialect == "postgres" else str(identifier)
        return driver, dialect, sql, {"consumer": consumer, "message_id": value}

    def claim(self, conn: Any, consumer: str, message_id: object) -> bool:
        """Record ``message_id`` for ``consumer``; True on its first delivery only."""
        driver, dialect, sql, params = self._params(conn, consumer, message_id)
        if driver.is_async:
            raise TypeError(f"{driver.name} is an async connection: use `await claim_async(...)`")
        # In autocommit the record would commit at once, apart from the consumer's work: a
        # failed apply would leave the message recorded, and every redelivery skipped.
        driver.check_transaction(conn)
        try:
            return bool(driver.execute(conn, sql, params) == 1)
        except Exception as exc:
            if _seen_before(exc, dialect):
                return False
            raise

    async def claim_async(self, conn: Any, consumer: str, message_id: object) -> bool:
        driver, dialect, sql, params = self._params(conn, consumer, message_id)
        if not driver.is_async:
            raise TypeError(f"{driver.name} is a sync connection: use `claim(...)`")
        await driver.check_transaction_async(conn)
        try:
            return bool(await driver.execute_async(conn, sql, params) == 1)
        except Exception as exc:
            if _seen_before(exc, dialect):
                return False
            raise
