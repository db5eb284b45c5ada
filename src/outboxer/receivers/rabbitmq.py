"""``amqp://`` and ``amqps://``: a consumer group is a durable queue bound to the outbox exchange.

The queue (``queue``, default the group's name) is declared durable and bound to the
exchange the relay publishes to (the URL's ``exchange``, default ``outboxer``, declared as
the relay declares it) once per topic pattern (``orders.*``, ``#``); every consumer process
of the group consumes from it, with manual acks and a prefetch of the runner's ``prefetch``.
A message is acked once the transaction that applied it committed; unacknowledged messages
go back to the queue when the channel closes (a crash, a shutdown) and RabbitMQ delivers
them again.

The URL is the relay's: its exchange options and everything it hands to aio-pika (TLS
files, heartbeat, connection name) are read by :class:`RabbitMQPublisher`. The receiver's
own options: ``queue``, ``queue_type`` (``classic`` or ``quorum``), and
``single_active_consumer`` (true: one consumer of the group at a time gets the queue's
messages, so a key's messages are applied in order across several processes too; the
others stand by).

A consumer RabbitMQ cancels (its queue was deleted) counts as a lost connection: the
reconnect declares the queue again. ``prefetch`` is at most 65535 (``basic.qos``).

Decoding: ``message_id`` is the id, ``content_type`` the content type, the headers carry the
rest of the envelope (``outboxer-topic``, ``outboxer-key``, ``outboxer-created-at``).
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable, Sequence
from typing import Any

import aiormq
import pamqp.decode
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractIncomingMessage

from outboxer.brokers.base import describe, option_bool
from outboxer.brokers.rabbitmq import CONSUMER_OPTIONS, RabbitMQPublisher, connect_amqp
from outboxer.errors import ConfigError, PublishError
from outboxer.receivers.base import Incoming, Receiver, decode, take
from outboxer.redact import get_logger

logger = get_logger("outboxer.receiver")

_QUEUE_TYPES = ("classic", "quorum")
_PREFETCH_MAX = 65535


_Decoder = Callable[[bytes], tuple[int, Any]]


def _lenient_short_str(value: bytes) -> tuple[int, str]:
    """pamqp's short string, with bytes that are not UTF-8 replaced instead of raised on."""
    length = value[0]
    return length + 1, value[1 : length + 1].decode("utf-8", "replace")


def _lenient_field_table(value: bytes) -> tuple[int, dict[str, Any]]:
    """pamqp's field table, with names that are not UTF-8 replaced instead of raised on
    (values: pamqp's own, which already hands over a long string that is not UTF-8 as
    bytes, and nested tables through the lenient decoder again)."""
    try:
        (length,) = struct.unpack_from(">I", value)
        end = 4 + length
        if end > len(value):
            raise ValueError("Field table length exceeds available data")
        offset, table = 4, {}
        while offset < end:
            key_length = value[offset]
            offset += 1
            if offset + key_length > end:
                raise ValueError("Field table key length exceeds data")
            key = value[offset : offset + key_length].decode("utf-8", "replace")
            offset += key_length
            consumed, table[key] = pamqp.decode.embedded_value(value[offset:])
            offset += consumed
    except (struct.error, IndexError, TypeError) as exc:  # as pamqp reports a bad table
        raise ValueError("Could not unpack data") from exc
    return end, table


def _falling_back(strict: _Decoder, lenient: _Decoder) -> _Decoder:
    def decode(value: bytes) -> tuple[int, Any]:
        try:
            return strict(value)
        except UnicodeDecodeError:
            return lenient(value)

    decode.outboxer_lenient = True  # type: ignore[attr-defined]
    return decode


def _tolerate_bytes_not_utf8() -> None:
    """Let pamqp decode frames whose short strings or table names are not UTF-8.

    pamqp raises on them inside aiormq's connection reader, which then drops the
    connection: the message goes back to the head of the queue and the same happens after
    every reconnect, so one message from a foreign producer (a ``message_id``, content type
    or header name that is not UTF-8) would stop the consumer for good. Decoded with
    U+FFFD for what is not UTF-8, it arrives, and is dead-lettered (its id is no UUID) or
    applied. Frames pamqp decodes today decode exactly as before: the lenient decoders
    only run where pamqp raised. Process-wide, as pamqp's decoder tables are; idempotent.
    """
    methods: dict[str, Any] = pamqp.decode.METHODS
    table: dict[bytes, Any] = pamqp.decode.TABLE_MAPPING
    if getattr(methods.get("shortstr"), "outboxer_lenient", False):
        return
    methods["shortstr"] = _falling_back(methods["shortstr"], _lenient_short_str)
    methods["table"] = _falling_back(methods["table"], _lenient_field_table)
    table[b"F"] = _falling_back(table[b"F"], _lenient_field_table)


def _text(value: Any) -> str:
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode("utf-8", "replace")
    return str(value)


class RabbitMQReceiver(Receiver):
    """Consumes the group's durable queue, bound to the outbox exchange by topic pattern."""

    schemes = ("amqp", "amqps")
    options = CONSUMER_OPTIONS
    publisher_class = RabbitMQPublisher
    all_topics = "#"
    max_prefetch = _PREFETCH_MAX

    def __init__(self, url: str, **options: Any) -> None:
        super().__init__(url, **options)
        if self.prefetch > _PREFETCH_MAX:
            # basic.qos would fail on every connect, which reads as an unreachable broker.
            raise ConfigError(
                f"prefetch must be at most {_PREFETCH_MAX} for RabbitMQ (basic.qos "
                f"prefetch-count is 16 bits), not {self.prefetch}"
            )
        self.queue: str = str(self.settings.get("queue") or self.group)
        if self.queue.startswith("amq.") or len(self.queue.encode()) > 255:
            # RabbitMQ refuses the declare at every connect, which read as an outage
            # retried for ever.
            raise ConfigError(
                f"RabbitMQ queue {self.queue!r:.300} (the group's name unless option queue "
                "names it) must not begin with 'amq.' and holds at most 255 bytes of UTF-8"
            )
        self.queue_type = str(self.settings.get("queue_type") or "classic").lower()
        if self.queue_type not in _QUEUE_TYPES:
            raise ConfigError(f"queue_type must be classic or quorum, not {self.queue_type!r}")
        self.single_active_consumer = option_bool(
            {k: str(v) for k, v in self.settings.items()},
            "single_active_consumer",
            None,
            False,
        )
        self._connection: AbstractConnection | None = None
        self._arrived: asyncio.Queue[AbstractIncomingMessage] = asyncio.Queue()
        self._lost = asyncio.Event()
        #: A declare or bind was refused and the operator's setup used as it is: logged once.
        self._refusal_logged = False
        #: The steps RabbitMQ refused (403), with the refusal: "exchange", "queue", and a
        #: bind's pattern. Later connects check those passively or skip them instead of
        #: being refused again, each refusal closing a channel.
        self._refused_steps: dict[str, BaseException] = {}
        #: The passive declare ``lag`` waits for (it may outlive a call that gave up on it).
        self._lag_query: asyncio.Future[int] | None = None
        #: The channel ``lag`` declares the queue passively on (see ``_open_lag_channel``).
        self._lag_channel: aiormq.abc.AbstractChannel | None = None
        #: RabbitMQ refused a second channel (the user's ``max-channels``): no lag channel.
        self._lag_refused = False

    @property
    def _rabbit(self) -> RabbitMQPublisher:
        assert isinstance(self.publisher, RabbitMQPublisher)
        return self.publisher

    def parse(self, url: str, **options: Any) -> RabbitMQPublisher:
        return RabbitMQPublisher(url, **options)

    async def _connect(self) -> None:
        for pause in (0.1, 0.3, 0.6):
            try:
                await self._connect_once()
                return
            except aiormq.exceptions.ConnectionNotAllowed as exc:
                # A connect after one RabbitMQ closed for a channel of ours over the user's
                # max-channels (see _open_lag_channel, _declare): RabbitMQ untracks the old
                # connection's channels a moment after its close, and until then the new
                # connection's first channel is over the limit too.
                if "channel" not in str(exc) or not (self._lag_refused or self._refused_steps):
                    raise
                await self._close()
                await asyncio.sleep(pause)
        await self._connect_once()

    async def _connect_once(self) -> None:
        await self._close()
        self._lost = asyncio.Event()
        self._arrived = asyncio.Queue()
        publisher = self._rabbit
        _tolerate_bytes_not_utf8()
        connection = await connect_amqp(publisher._driver_url, publisher.connect_timeout)
        self._connection = connection
        connection.close_callbacks.add(self._on_close)
        known = len(self._refused_steps)
        try:
            await self._declare(connection)
        except aiormq.exceptions.ConnectionNotAllowed as exc:
            # RabbitMQ still counted a channel its refusal closed when the next one opened
            # (a user's max-channels 1: it untracks channels a moment later). The refusals
            # are remembered: connected again, the steps refused go passively, no channel
            # closed by a refusal (again while this connect learned one: a step each).
            if len(self._refused_steps) == known or "channel" not in str(exc):
                raise
            connection.close_callbacks.discard(self._on_close)
            await self._connect_once()
            return
        channel = await connection.channel()
        if not await self._open_lag_channel(connection):
            # The refusal closed the connection: again, without a lag channel.
            connection.close_callbacks.discard(self._on_close)
            await self._connect_once()
            return
        channel.close_callbacks.add(self._on_close)
        await channel.set_qos(prefetch_count=self.prefetch)
        queue = await channel.get_queue(self.queue, ensure=False)
        # RabbitMQ cancels the consumer, leaving channel and connection open, when the queue
        # is deleted: nothing would ever arrive again. Taken as a lost connection: the reconnect declares the
        # queue anew and consumes it. (aiormq releases without these callbacks only log it.)
        underlay = await channel.get_underlay_channel()
        cancelled: Any = getattr(underlay, "on_consumer_cancel_callbacks", None)
        if cancelled is not None:
            cancelled.add(self._on_close)
        await queue.consume(self._arrived.put, no_ack=False)

    async def _declare(self, connection: AbstractConnection) -> None:
        """Declare the exchange and the queue and bind them, on a channel of their own.

        A step RabbitMQ refuses with 403 ACCESS_REFUSED (the user lacks the ``configure``
        permission on the exchange or queue, or ``write`` on the queue for a bind: an
        operations team that provisions them itself grants only ``read``) closes that
        channel; it used to fail the connect, read as an outage, for ever. What exists is
        now used as it is (a passive declare needs no permission), with one warning; a
        refused exchange or queue that does not exist is a ConfigError."""
        publisher = self._rabbit
        refused: list[str] = []
        channel = await connection.channel()
        try:
            exchange = publisher.exchange
            if "exchange" in self._refused_steps:
                try:
                    await publisher._check_exists(
                        channel, exchange, self._refused_steps["exchange"]
                    )
                except PublishError as missing:
                    raise ConfigError(str(missing)) from missing
            elif publisher.declare_exchange and exchange and not exchange.startswith("amq."):
                try:
                    await channel.declare_exchange(exchange, publisher.exchange_type, durable=True)
                except aiormq.exceptions.ChannelPreconditionFailed as exc:
                    # As the relay refuses it: retried, it read as an outage for ever.
                    raise ConfigError(
                        f"exchange {exchange!r} exists with other settings than a durable "
                        f"{publisher.exchange_type} exchange ({exc.args[0] if exc.args else exc}); "
                        "set exchange_type to match it or declare_exchange=false"
                    ) from exc
                except aiormq.exceptions.ChannelAccessRefused as exc:
                    self._refused_steps["exchange"] = exc
                    try:
                        await publisher.exchange_exists(connection, exchange, exc)
                    except PublishError as missing:
                        raise ConfigError(str(missing)) from exc
                    refused.append(f"declare exchange {exchange!r}")
                    channel = await _reopened(connection, channel)
            arguments: dict[str, Any] = {}
            if self.queue_type == "quorum":
                arguments["x-queue-type"] = "quorum"
            if self.single_active_consumer:
                arguments["x-single-active-consumer"] = True
            refusal = self._refused_steps.get("queue")
            try:
                if refusal is None:  # else straight to the passive declare
                    await channel.declare_queue(self.queue, durable=True, arguments=arguments)
            except aiormq.exceptions.ChannelPreconditionFailed as exc:
                raise ConfigError(
                    f"queue {self.queue!r} exists with other settings "
                    f"({exc.args[0] if exc.args else exc}); set queue_type and "
                    "single_active_consumer to match it, or name another queue"
                ) from exc
            except aiormq.exceptions.ChannelAccessRefused as exc:
                refusal = self._refused_steps["queue"] = exc
                channel = await _reopened(connection, channel)
            if refusal is not None:
                try:
                    await channel.declare_queue(self.queue, passive=True)
                except aiormq.exceptions.ChannelNotFoundEntity:
                    raise ConfigError(
                        f"RabbitMQ refused to declare queue {self.queue!r} "
                        f"({refusal.args[0] if refusal.args else refusal}) and it does not "
                        "exist: have it declared, or grant the user the configure permission "
                        "on it"
                    ) from refusal
                refused.append(
                    f"declare queue {self.queue!r} (its queue_type and "
                    "single_active_consumer are not checked)"
                )
            if exchange:  # the default exchange routes by queue name: nothing to bind
                for pattern in self.topics:
                    if f"bind {pattern}" in self._refused_steps:
                        continue  # refused at an earlier connect: the operator's binding
                    queue = await channel.get_queue(self.queue, ensure=False)
                    try:
                        await queue.bind(exchange, routing_key=pattern)
                    except aiormq.exceptions.ChannelAccessRefused as exc:
                        # Bindings cannot be looked up over AMQP: the operator's to make.
                        self._refused_steps[f"bind {pattern}"] = exc
                        refused.append(f"bind it to {exchange!r} for {pattern!r}")
                        channel = await _reopened(connection, channel)
        finally:
            await RabbitMQPublisher._quietly(channel.close())
        if refused and not self._refusal_logged:
            self._refusal_logged = True
            logger.warning(
                "%s: RabbitMQ refused to %s (403 ACCESS_REFUSED: the user lacks the "
                "configure or write permission); consuming queue %r as the operator set it up",
                self.safe_url,
                "; to ".join(refused),
                self.queue,
            )

    async def _open_lag_channel(self, connection: AbstractConnection) -> bool:
        """Open the channel ``lag`` reads the queue's depth on, kept for the connection's
        life; False if RabbitMQ closed the connection for it (530 NOT_ALLOWED: the user's
        ``max-channels`` leaves room for the consuming channel only), which is remembered.

        Opened at each ``lag`` call instead, it was a channel over such a limit every
        metrics tick (5 s): RabbitMQ closed the consumer's connection each time, every
        prefetched message going back to the queue (delivered again, counted against a
        quorum queue's ``delivery-limit``). Opened here, nothing is held yet, and a later
        channel opened by another connection of the user cannot make this one a refusal."""
        self._lag_channel = None
        transport = connection.transport
        if self._lag_refused or transport is None:
            return True
        try:
            # aiormq's own channel: none of the receiver's close callbacks hears of its end.
            self._lag_channel = await transport.connection.channel(publisher_confirms=False)
        except aiormq.exceptions.ConnectionNotAllowed as exc:
            if "channel" not in str(exc):
                raise
            self._lag_refused = True
            logger.warning(
                "%s: RabbitMQ allows this consumer's user one channel (%s); the queue depth "
                "(lag) is not measured, as a second channel would close the connection",
                self.safe_url,
                exc.args[0] if exc.args else exc,
            )
            return False
        return True

    def _on_close(self, *_: object) -> None:
        self._lost.set()

    async def _close(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            # Closing hands every unacknowledged message back to the queue.
            await RabbitMQPublisher._quietly(connection.close())

    async def _receive(self, limit: int, timeout: float) -> list[Incoming]:
        messages = await take(self._arrived, self._lost, limit, timeout, "RabbitMQ")
        return [self._incoming(message) for message in messages]

    @staticmethod
    def _incoming(message: AbstractIncomingMessage) -> Incoming:
        headers = {name: _text(value) for name, value in (message.headers or {}).items()}
        incoming = decode(
            headers,
            message.body,
            message_id=message.message_id,
            content_type=message.content_type,
            fallback_topic=message.routing_key or "",
        )
        incoming.token = message
        # Set on every delivery after the first (a channel closed with it unacknowledged:
        # a crash, a lost connection, a shutdown handing it back).
        incoming.redelivered = bool(message.redelivered)
        return incoming

    async def _ack(self, incomings: Sequence[Incoming]) -> None:
        for incoming in incomings:
            await incoming.token.ack()

    async def lag(self, timeout: float = 5.0) -> int | None:
        """The queue's ready messages (``message_count`` of a passive declare): the group's
        whole backlog, the same from every member; delivered and unacknowledged ones are
        not counted."""
        connection = self._connection
        if not self._connected or connection is None or connection.is_closed:
            return None
        if self._lag_refused:
            return None  # no second channel (see _open_lag_channel)
        query = self._lag_query
        if query is None or query.done():
            query = self._lag_query = asyncio.ensure_future(self._ready())
            query.add_done_callback(_retrieved)
        # Waited for, never cancelled: aiormq closes a channel whose request is cancelled,
        # with a warning each time. One query at a time: a broker slow to answer gets no
        # pile of them; the next calls wait for the same one.
        await asyncio.wait((query,), timeout=timeout)
        if not query.done():
            logger.debug("%s: no queue depth within %.1f s", self.safe_url, timeout)
            return None
        problem = asyncio.CancelledError() if query.cancelled() else query.exception()
        if problem is not None:
            logger.debug(
                "%s: no queue depth for %r: %s", self.safe_url, self.queue, describe(problem)
            )
            return None
        return query.result()

    async def _ready(self) -> int:
        # A channel of its own: a passive declare of a queue that is gone (deleted by an
        # operator) closes its channel with a 404, and on the consuming channel that would
        # drop the messages held and read as a lost connection. Closed so, another is
        # opened in its place (a second channel was allowed at the connect).
        channel = self._lag_channel
        if channel is None or channel.is_closed:
            connection = self._connection
            if connection is not None:
                await self._open_lag_channel(connection)
            channel = self._lag_channel
            if channel is None:
                raise ConnectionError("no channel to read the queue's depth on")
        declared = await channel.queue_declare(self.queue, passive=True)
        return int(declared.message_count or 0)


async def _reopened(connection: AbstractConnection, channel: AbstractChannel) -> AbstractChannel:
    """A new channel in place of one RabbitMQ closed for a refusal (the connection lives on)."""
    await RabbitMQPublisher._quietly(channel.close())
    return await connection.channel()


def _retrieved(query: asyncio.Future[int]) -> None:
    """Take a lag query's exception, which ``lag`` may have stopped waiting for."""
    if not query.cancelled():
        query.exception()


__all__ = ["RabbitMQReceiver"]
