"""FastStream inbox middleware: each message applied once, in the consumer's own transaction.

For teams that consume with FastStream rather than ``outboxer consume``::

    from faststream.rabbit import RabbitBroker, RabbitRouter
    from outboxer.contrib.faststream import InboxConnection, InboxMiddleware

    router = RabbitRouter(middlewares=[InboxMiddleware("shipping", engine.begin)])

    @router.subscriber("shipping")
    async def ship(order: dict, conn: InboxConnection) -> None:
        await conn.execute(insert(shipments).values(order_id=order["id"]))

    broker = RabbitBroker(url)
    broker.include_router(router)

Per message, around the handler: the middleware reads the outbox id (header
``outboxer-id``, set by the relay on every broker), opens a transaction from the
``transaction`` factory, claims the id in the inbox for ``consumer`` and calls the handler
with that transaction's connection (``InboxConnection``, or ``Context("outboxer_connection")``).
The handler's writes and the claim commit together when the handler returns, before
FastStream acknowledges; if the handler raises, both roll back and FastStream's ack policy
decides (``AckPolicy.NACK_ON_ERROR`` redelivers at once and without limit: bound it with
a quorum queue's ``x-delivery-limit`` and a dead-letter exchange). ``AckPolicy.REJECT_ON_ERROR``,
FastStream's RabbitMQ default, rejects without requeueing: on a queue without a dead-letter
exchange RabbitMQ discards the failed message, and only FastStream's log line is left of it.
FastStream's ``AckMessage`` is the handler saying the message is done: its writes and the
claim commit, then FastStream acknowledges;
``NackMessage``, ``RejectMessage`` and ``SkipMessage`` roll back. A delivery whose id the inbox already
holds is acknowledged without calling the handler (nor its publishers). A message without
a valid id is rejected (not requeued: a dead-letter exchange, if any, keeps it) and raises
``PayloadError``, before any transaction: nothing could tell its copies apart.

Tested with FastStream 0.7 (its middleware API changed in 0.6): see the ``faststream`` extra.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Annotated, Any

from outboxer.errors import MissingDependencyError, PayloadError
from outboxer.inbox import Inbox
from outboxer.message import HEADER_ID
from outboxer.redact import SHOWN_VALUE_CHARS, get_logger, shown_value

try:
    from faststream import BaseMiddleware, Context, StreamMessage
    from faststream.exceptions import AckMessage, SkipMessage
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise MissingDependencyError("faststream", "faststream") from exc

__all__ = ["CONNECTION", "InboxConnection", "InboxMiddleware", "outboxer_message_id"]

logger = get_logger("outboxer.contrib.faststream")

#: The FastStream context key of the consumer transaction's connection.
CONNECTION = "outboxer_connection"

#: A handler argument annotated so receives the connection of the inbox's transaction.
InboxConnection = Annotated[Any, Context(CONNECTION)]

TransactionFactory = Callable[[], AbstractAsyncContextManager[Any]]

#: Characters of a message's id kept in an error or log line (a UUID needs 36): the name
#: stays for its importers, the bound is outboxer.redact's, shared with outboxer.inbox.
SHOWN_ID_CHARS = SHOWN_VALUE_CHARS


def outboxer_message_id(message: StreamMessage[Any]) -> str | None:
    """The outbox id the relay sent with ``message`` (header ``outboxer-id``), if any."""
    value = message.headers.get(HEADER_ID)
    return value if isinstance(value, str) else None


class InboxMiddleware:
    """A FastStream broker or router middleware that runs each handler through the inbox.

    ``consumer`` names this consumer in the inbox (each consumer applies a message once);
    ``transaction`` returns an async context manager that yields a connection inside a
    transaction and commits it on a clean exit, rolls it back on an error: SQLAlchemy's
    ``AsyncEngine.begin`` or ``async_sessionmaker.begin``, a psycopg ``AsyncConnection``,
    or your own ``asynccontextmanager`` around an asyncpg or aiomysql transaction. Any
    connection ``Inbox.claim_async`` takes will do. ``message_id`` reads a message's id
    (default: the relay's ``outboxer-id`` header).
    """

    def __init__(
        self,
        consumer: str,
        transaction: TransactionFactory,
        *,
        inbox: Inbox | None = None,
        message_id: Callable[[StreamMessage[Any]], object] = outboxer_message_id,
    ) -> None:
        if not isinstance(consumer, str) or not consumer or len(consumer) > 255:
            raise PayloadError("consumer must be a non-empty string of at most 255 characters")
        self.consumer = consumer
        self.transaction = transaction
        self.inbox = inbox or Inbox()
        self.message_id = message_id

    def __call__(self, msg: Any, /, *, context: Any) -> _InboxScope:
        """FastStream builds one middleware per message through this."""
        return _InboxScope(msg, context=context, owner=self)

    def claimed_id(self, message: StreamMessage[Any]) -> uuid.UUID:
        """The message's id as a UUID; PayloadError when it has none or a malformed one."""
        raw = self.message_id(message)
        if raw is None:
            raise PayloadError(
                f"message {shown_value(message.message_id)} carries no outbox id "
                f"(header {HEADER_ID!r}): the inbox cannot tell a redelivery from a new message; pass message_id="
            )
        try:
            return raw if isinstance(raw, uuid.UUID) else uuid.UUID(str(raw))
        except ValueError:
            raise PayloadError(f"message id {shown_value(raw)} is not a UUID") from None


class _InboxScope(BaseMiddleware[Any, Any]):
    def __init__(self, msg: Any, /, *, context: Any, owner: InboxMiddleware) -> None:
        super().__init__(msg, context=context)
        self.owner = owner

    async def consume_scope(
        self, call_next: Callable[[StreamMessage[Any]], Awaitable[Any]], msg: StreamMessage[Any]
    ) -> Any:
        owner = self.owner
        try:
            message_id = owner.claimed_id(msg)
        except PayloadError:
            # Never applicable safely, so never requeued (a dead-letter exchange keeps it),
            # whatever the ack policy; the error is logged by FastStream.
            await msg.reject()
            raise
        acked: AckMessage | None = None
        async with owner.transaction() as connection:
            # The claim waits on the inbox row of a concurrent delivery of the same id
            # until that transaction ends, then sees it: one of them applies the message.
            if await owner.inbox.claim_async(connection, owner.consumer, message_id):
                with self.context.scope(CONNECTION, connection):
                    try:
                        return await call_next(msg)
                    except AckMessage as exc:
                        # The handler said "done, acknowledge it": its writes and the claim
                        # commit, as on a return. Rolled back, the message was acknowledged
                        # unapplied and never delivered again. (NackMessage, RejectMessage
                        # and SkipMessage roll back: the message is not done.)
                        acked = exc
        if acked is not None:
            raise acked  # committed: FastStream's acknowledgement comes after this
        logger.info(
            "skipped message %s for consumer %s: the inbox has applied it already",
            message_id,
            owner.consumer,
        )
        # Acknowledged here whatever the ack policy (MANUAL included): nobody else will.
        # SkipMessage then ends the processing without the handler's publishers running.
        await msg.ack()
        raise SkipMessage
