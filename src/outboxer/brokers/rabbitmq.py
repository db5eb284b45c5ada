"""``amqp://`` and ``amqps://``: RabbitMQ through aio-pika, with publisher confirms.

Each message is one ``basic.publish`` with ``mandatory`` set, on a channel in
confirm mode; it counts as published once RabbitMQ answered ``basic.ack``. A
wave's publishes are all written before any confirm is awaited, in one write of
all their frames (see ``_write_wave``).

Where a message goes: the topic (or its route) is the routing key on the
exchange ``exchange`` (a durable topic exchange declared on connect). A route
of the form ``EXCHANGE/ROUTING_KEY`` names another exchange (empty for the
AMQP default exchange, whose routing key is a queue name).

Envelope: ``message_id`` is the outbox id, ``content_type`` the payload's
content type, ``timestamp`` the creation time, ``delivery_mode`` 2
(persistent); the headers carry the user headers plus ``outboxer-id``,
``outboxer-topic``, ``outboxer-key``, ``outboxer-created-at`` and
``content-type``.

Lanes. Callers that publish at the same time (the relay's loops share one
publisher) each get a channel of their own on the one connection, a lane, so
their waves are in flight together rather than in turn: a wave's confirms
take a disk write on RabbitMQ's side, and waves taking turns made that wait
add up under load. Channels are what RabbitMQ closes on a refusal, so a lane
sees only its own wave's refusals.

Failures. ``basic.return`` (no queue bound) and ``basic.nack`` are retryable,
as is a missing exchange (404). A message RabbitMQ refuses by closing the
channel (403 ACCESS_REFUSED, 406 PRECONDITION_FAILED such as a message above
``max_message_size``) is permanent. Such a close also fails every other
message in flight on the channel, so the lane opens a fresh channel (the
publisher reconnects only if the connection went too) and sends each message
that was in flight once more, alone on that channel: only the one RabbitMQ
refuses again on its own is permanent. Lanes caught by a connection close (an
outage) see their messages fail without a refusal of their own, so they too
publish them again alone, and none of those is ever called permanent for
another's refusal.

What RabbitMQ would take as a framing error is refused before it is written (a
header name over a field table's 128 bytes, properties over one frame): it
closes the whole connection for those. A connection RabbitMQ blocked
(``connection.blocked``, a resource alarm) fails the wave's unconfirmed
messages as not attempted (``NotSent``) at 80% of ``publish_timeout``, and
later waves wait for ``connection.unblocked`` before writing anything: an alarm
must not use up attempts.

Closing channels. No frame may go out on a channel after aiormq answered
RabbitMQ's ``channel.close`` with ``close-ok``: RabbitMQ takes any frame but
``channel.open`` on a closed channel number as a connection error (504
``CHANNEL_ERROR - expected 'channel.open'``) and closes the connection, every
lane's channel with it. aiormq's reader queues the ``close-ok`` as soon as the
close arrives, but the channel reports ``is_closed`` (all its lock checks) only
a few event-loop turns later, once it failed its pending futures: a publish
that takes the lock in between writes behind the ``close-ok``. So every write
first checks :func:`_takes_frames` in the same step as it hands its frames to
the connection's writer, and a lane has one writer at a time: a wave goes out
in one write on aiormq 7.2 (``_write_wave``); without the channel internals
that needs, the messages go out one ``basic_publish`` at a time, each confirmed
before the next is written (``_send_in_turn``), since concurrent
``basic_publish`` calls queue on aiormq's lock and cannot be checked between
taking it and writing.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.metadata
import inspect
import re
import struct
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, cast
from urllib.parse import urlencode

import aio_pika
import aiormq
import pamqp.frame
from aio_pika.abc import AbstractChannel, AbstractConnection
from aiormq import spec
from aiormq.abc import ChannelFrame
from pamqp import encode
from pamqp.common import FieldTable

from outboxer.brokers.base import NotSent, Publisher, option_bool, parse_options
from outboxer.brokers.tlsfiles import client_context, tls_files
from outboxer.config import duration_option
from outboxer.errors import BrokerUnavailableError, ConfigError, PublishError
from outboxer.message import Message
from outboxer.redact import get_logger

logger = get_logger("outboxer.publisher.rabbitmq")

#: Our own URL options; the driver's (_DRIVER_OPTIONS) go on to aio-pika.
_OPTIONS = (
    "exchange",
    "exchange_type",
    "declare_exchange",
    "persistent",
    "mandatory",
    "connect_timeout",
)
#: The query options aiormq reads (TLS, timeouts, the connection's name, the auth
#: mechanism) and those aio-pika's plain Connection reads.
_DRIVER_OPTIONS = (
    "cafile",
    "capath",
    "cadata",
    "certfile",
    "keyfile",
    "no_verify_ssl",
    "timeout",
    "heartbeat",
    "name",
    "auth",
    "interleave",
    "happy_eyeballs_delay",
)
#: The consumer's own URL options (outboxer.receivers.rabbitmq), accepted on the relay's
#: side too: one URL serves both.
CONSUMER_OPTIONS = ("queue", "queue_type", "single_active_consumer")
_EXCHANGE_TYPES = ("topic", "direct", "fanout", "headers")
#: Channel closes that the same message will cause again: refused for good.
_PERMANENT = (aiormq.exceptions.ChannelAccessRefused, aiormq.exceptions.ChannelPreconditionFailed)
_CLOSE_TIMEOUT = 5.0
#: Seconds the publishes of a wave whose channel closed get to fail by themselves.
_CLOSED_GRACE = 0.5
#: AMQP short strings (routing key, content type, header names) hold at most 255 bytes.
_SHORTSTR = 255
#: aiormq >= 7 can write a publish without awaiting the socket drain: the whole wave goes out
#: before the first confirm is awaited (its bounded write queue still applies backpressure).
_NO_DRAIN: dict[str, Any] = (
    {"wait": False} if "wait" in inspect.signature(aiormq.Channel.basic_publish).parameters else {}
)


_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
#: AMQP field-table names longer than this are truncated by pamqp: leave those to pamqp.
_TABLE_KEY_MAX = 128


class _Properties(spec.Basic.Properties):
    """Basic properties whose wire form is computed once, by ``_encode_properties``.

    pamqp encodes each property and header through a per-value type dispatch that was a
    sixth of the relay's CPU when draining to RabbitMQ. The bytes are the same as pamqp's
    (a test compares them); anything the fast path does not cover goes to pamqp.
    """

    wire: bytes | None = None

    def marshal(self) -> bytes:
        return self.wire if self.wire is not None else bytes(super().marshal())


def _over_short_string(text: str) -> bool:
    """Whether ``text`` is over an AMQP short string's 255 bytes (UTF-8: at most 4 bytes a
    character, so a short text needs no encoding to tell)."""
    return len(text) > _SHORTSTR // 4 and len(text.encode("utf-8")) > _SHORTSTR


def _short_string(text: str) -> bytes:
    data = text.encode("utf-8")
    if len(data) > _SHORTSTR:
        raise ValueError("short string over 255 bytes")
    return bytes((len(data),)) + data


@functools.lru_cache(maxsize=1024)
def _table_key(name: str) -> bytes | None:
    """A header name as a field-table entry begins (length, name, long-string type), or None
    if it is over _TABLE_KEY_MAX bytes. Header names repeat from message to message."""
    key = name.encode("utf-8")
    if len(key) > _TABLE_KEY_MAX:
        return None
    return bytes((len(key),)) + key + b"S"


def _encode_properties(
    content_type: str,
    delivery_mode: int,
    message_id: str,
    timestamp: datetime | None,
    headers: Mapping[str, object],
) -> bytes | None:
    """The AMQP encoding of these Basic properties, as pamqp writes it (property flags,
    then each present property in flag order; a table's entries sorted by name, strings
    as long strings); None if a header is not a string or its name is over 128 bytes."""
    # Per message on the relay's hot path: one list, cached entry heads, no tuples.
    parts: list[bytes] = []
    append = parts.append
    pack = _U32.pack
    for name, value in sorted(headers.items()):
        if type(value) is not str:
            return None
        head = _table_key(name)
        if head is None:
            return None
        data = value.encode("utf-8")
        append(head)
        append(pack(len(data)))
        append(data)
    table = b"".join(parts)
    flags = 0x2000 | 0x1000  # headers, delivery_mode
    parts = [b"", b""]  # flags, content type: filled in below
    if content_type:
        flags |= 0x8000
        parts[1] = _short_string(content_type)
    parts += (pack(len(table)), table, bytes((delivery_mode,)))
    if message_id:
        flags |= 0x0080
        parts.append(_short_string(message_id))
    if timestamp is not None:
        flags |= 0x0040
        parts.append(encode.timestamp(timestamp))
    parts[0] = _U16.pack(flags)
    return b"".join(parts)


def _properties(
    content_type: str,
    delivery_mode: int,
    message_id: str,
    timestamp: datetime | None,
    headers: dict[str, str],
) -> spec.Basic.Properties:
    properties = _Properties(
        content_type=content_type,
        delivery_mode=delivery_mode,
        message_id=message_id,
        timestamp=timestamp,
        headers=cast(FieldTable, headers),
    )  # a fresh dict: no copy needed
    properties.wire = _encode_properties(
        content_type, delivery_mode, message_id, timestamp, headers
    )
    return properties


_FRAME_HEAD = struct.Struct(">BHI")  # frame type, channel, payload size
_FRAME_END = b"\xce"
_METHOD, _HEADER, _BODY = 1, 2, 3
_CONTENT_HEADER = struct.Struct(">HHQ")  # class (Basic), weight (0), body size
#: More than the content header and the properties but the headers can take (see _over_frame).
_PROPERTIES_BOUND = 8192
#: The channel internals a wave writes through (aiormq 7.2): where they are missing, each
#: message goes out through ``basic_publish`` instead.
_WAVE_ATTRIBUTES = (
    "lock",
    "delivery_tag",
    "confirmations",
    "message_id_delivery_tag",
    "write_queue",
    "max_content_size",
    "create_future",
    "number",
    "connection",
)
#: The aiormq releases the wave writes were verified against, [lowest, first excluded): the
#: same range as the ``rabbitmq`` extra in pyproject.toml (a test keeps the two equal).
WAVE_AIORMQ_RANGE = ((7, 2, 2), (8, 0, 0))


def _release(version: str) -> tuple[int, int, int]:
    """``"7.2.4"`` -> ``(7, 2, 4)``; ``"8.0rc1"`` -> ``(8, 0, 0)``: each part's leading
    digits, 0 where there are none."""
    numbers = []
    for part in [*version.split("."), "", ""][:3]:
        digits = part[: len(part) - len(part.lstrip("0123456789"))]
        numbers.append(int(digits) if digits else 0)
    major, minor, patch = numbers
    return major, minor, patch


def _dotted(release: tuple[int, ...]) -> str:
    return ".".join(map(str, release))


def wave_writes_unsupported(channel: object, aiormq_version: str) -> str | None:
    """Why waves cannot be written in one go on this aiormq channel, or None if they can."""
    lowest, excluded = WAVE_AIORMQ_RANGE
    if not lowest <= _release(aiormq_version) < excluded:
        return (
            f"aiormq {aiormq_version} is outside the releases the wave writes were verified "
            f"with (>={_dotted(lowest)},<{_dotted(excluded)})"
        )
    missing = [name for name in _WAVE_ATTRIBUTES if not hasattr(channel, name)]
    if missing:
        return f"aiormq {aiormq_version}'s channel lacks {', '.join(missing)}"
    return None


def _unblocked(connection: object) -> asyncio.Event | None:
    """Set unless RabbitMQ told this aiormq connection it stopped reading from it
    (``connection.blocked``: a memory or disk alarm) and has not unblocked it since.

    aiormq keeps that state in a private event (its ``ready()`` waits on it); where it has
    none (None), a blocked connection is not told apart from a slow one.
    """
    unblocked = getattr(connection, "_Connection__connection_unblocked", None)
    return unblocked if isinstance(unblocked, asyncio.Event) else None


def _blocked(channel: aiormq.abc.AbstractChannel) -> bool:
    unblocked = _unblocked(channel.connection)
    return unblocked is not None and not unblocked.is_set()


def _takes_frames(channel: aiormq.abc.AbstractChannel) -> bool:
    """Whether a frame written on ``channel`` now reaches an open channel on RabbitMQ's side.

    False from the moment aiormq's connection reader got RabbitMQ's ``channel.close`` (or
    the ``close-ok`` to ours): it then takes the number out of ``connection.channels``, a
    step before the channel's reader queues its ``close-ok`` and several before the channel
    reports ``is_closed`` (see "Closing channels" in the module docstring).
    """
    return not channel.is_closed and channel.connection.channels.get(channel.number) is channel


async def connect_amqp(url: str, timeout: float | None) -> AbstractConnection:
    """``aio_pika.connect``, but a connection whose connect fails is closed here. aio-pika
    leaves it to the garbage collector, whose ``__del__`` schedules a ``close()`` that no
    loop may run: "coroutine 'Connection.close' was never awaited", once per broker outage."""
    connection = aio_pika.Connection(aio_pika.connection.make_url(url))
    try:
        await connection.connect(timeout=timeout)
    except BaseException:
        with contextlib.suppress(Exception):
            await connection.close()
        raise
    return connection


@functools.lru_cache(maxsize=4096)
def _publish_method(exchange: str, routing_key: str, mandatory: bool) -> bytes:
    """The payload of a ``basic.publish`` method frame; pamqp validates the names once."""
    frame = pamqp.frame.marshal(
        spec.Basic.Publish(exchange=exchange, routing_key=routing_key, mandatory=mandatory), 0
    )
    return bytes(frame[_FRAME_HEAD.size : -1])


def _wave_frames(
    channel_number: int, max_content_size: int, publishes: Sequence[_Publish], mandatory: bool
) -> bytes:
    """Every frame of a wave, as aiormq's ``basic_publish`` would write them one message at a
    time (a test compares the bytes): method, content header, body split at the frame size."""
    head = _FRAME_HEAD.pack
    parts: list[bytes] = []
    for publish in publishes:
        method = _publish_method(publish.exchange, publish.routing_key, mandatory)
        body = publish.body
        header = _CONTENT_HEADER.pack(60, 0, len(body)) + publish.properties.marshal()
        parts += (
            head(_METHOD, channel_number, len(method)),
            method,
            _FRAME_END,
            head(_HEADER, channel_number, len(header)),
            header,
            _FRAME_END,
        )
        for start in range(0, len(body), max_content_size):
            chunk = body[start : start + max_content_size]
            parts += (head(_BODY, channel_number, len(chunk)), chunk, _FRAME_END)
    return b"".join(parts)


class _Confirmation(asyncio.Future[Any]):
    """A publish's confirm that tells its wave the moment aiormq's reader settles it.

    A done callback runs one event-loop turn after ``set_result``; the gather and the
    ``asyncio.wait`` a wave used to wait through added two turns more, and the three were a
    quarter of the publisher's CPU per wave at moderate load (``bench/wake_cost.py``).
    """

    _wave: _WaveWait | None = None

    def set_result(self, result: Any) -> None:
        super().set_result(result)
        if self._wave is not None:
            self._wave.one_settled()

    def set_exception(self, exception: Any) -> None:
        super().set_exception(exception)
        if self._wave is not None:
            self._wave.one_settled()


class _WaveWait:
    """One future for a wave's task to await, set once every publish of the wave is settled,
    or by ``wake`` (the channel's close, the deadline)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sends: Sequence[asyncio.Future[Any]]):
        self.future: asyncio.Future[None] = loop.create_future()
        self.missing = 0
        for send in sends:
            if send.done():
                continue
            self.missing += 1
            if isinstance(send, _Confirmation):
                send._wave = self
            else:  # _send_in_turn's futures
                send.add_done_callback(self.one_settled)
        if not self.missing:
            self.wake()

    def one_settled(self, _: object = None) -> None:
        # Called from aiormq's reader: never raises.
        self.missing -= 1
        if self.missing == 0:
            self.wake()

    def wake(self, _: object = None) -> None:
        if not self.future.done():
            self.future.set_result(None)


def _fail_pending(
    confirmations: Sequence[asyncio.Future[Any]], watcher: asyncio.Future[Any]
) -> None:
    """A wave's watcher ended: if the channel closed, its pending confirmations fail with the
    close's reason (a refusal names the message that caused it)."""
    if watcher.cancelled():
        return
    reason = watcher.exception() or aiormq.exceptions.ChannelClosed(None, "channel closed")
    for confirmation in confirmations:
        if not confirmation.done():
            confirmation.set_exception(reason)


def _over_frame(publish: _Publish, limit: int | None) -> bool:
    """Whether the publish's content header frame would be over ``limit`` payload bytes
    (a content header cannot be split over frames, unlike a body)."""
    if limit is None:
        return False
    # Marshalled only when it may be over: a bound of its size from the headers' lengths
    # (4 bytes a character at most; 6 of framing an entry) and the short strings' (at most
    # 256 bytes each, a dozen of them) keeps this off the wave's path for every usual message.
    headers = publish.properties.headers or {}
    bound = _PROPERTIES_BOUND + sum(
        6 + 4 * (len(name) + len(value if isinstance(value, str) else str(value)))
        for name, value in headers.items()
    )
    if bound <= limit:
        return False
    return _CONTENT_HEADER.size + len(publish.properties.marshal()) > limit


@dataclass(slots=True)
class _Lane:
    """One wave's channel, and the generation of the connection it belongs to."""

    channel: AbstractChannel
    generation: int
    #: A wave on it stopped waiting with confirms pending: closed, not reused, so late
    #: confirms have no channel to land on.
    cut_short: bool = False


@dataclass(frozen=True, slots=True)
class _Publish:
    """One message, ready to go out."""

    exchange: str
    routing_key: str
    body: bytes
    properties: spec.Basic.Properties


class RabbitMQPublisher(Publisher):
    """Publishes to a RabbitMQ exchange with publisher confirms and ``mandatory``."""

    schemes = ("amqp", "amqps")
    url_options = frozenset((*_OPTIONS, *_DRIVER_OPTIONS, *CONSUMER_OPTIONS))
    #: Write each wave in one go (see ``_write_wave``); False: a ``basic_publish`` each.
    _wave_writes = True
    #: Seconds after which a channel limit learned from a 530 is tried again: one wave at
    #: the cap opens a channel beyond it, and if RabbitMQ allows it the limit is forgotten
    #: (an operator raised it, or other connections of the user gave channels back). Kept
    #: for ever, it throttled the relay until a restart.
    lane_cap_retry = 300.0

    def __init__(
        self,
        url: str,
        *,
        routes: Mapping[str, str] | None = None,
        publish_timeout: float = 30.0,
        exchange: str | None = None,
        exchange_type: str | None = None,
        declare_exchange: bool | None = None,
        persistent: bool | None = None,
        mandatory: bool | None = None,
        connect_timeout: float | None = None,
    ) -> None:
        super().__init__(url, routes=routes, publish_timeout=publish_timeout)
        parts, options = parse_options(url)
        #: The exchange for topics without an ``EXCHANGE/`` route ("" = AMQP default exchange).
        self.exchange = exchange if exchange is not None else options.get("exchange", "outboxer")
        self.exchange_type = (exchange_type or options.get("exchange_type") or "topic").lower()
        if self.exchange_type not in _EXCHANGE_TYPES:
            raise ConfigError(
                f"exchange_type must be one of {', '.join(_EXCHANGE_TYPES)}, "
                f"not {self.exchange_type!r}"
            )
        self.declare_exchange = option_bool(options, "declare_exchange", declare_exchange, True)
        self.persistent = option_bool(options, "persistent", persistent, True)
        self.mandatory = option_bool(options, "mandatory", mandatory, True)
        # Finite and bounded, as Kafka's: float() took inf (a connect to a host that drops
        # packets waited for ever) and nan.
        self.connect_timeout = duration_option(
            connect_timeout if connect_timeout is not None else options.get("connect_timeout", 10),
            "rabbitmq option connect_timeout",
            0.001,
            3600,
        )
        for topic, route in self.routes.items():
            if not route:
                raise ConfigError(f"route for topic {topic!r} is empty")
        if files := tls_files(options, {}):
            # aiormq loads them at each connect, where a bad one read as an outage for ever.
            if parts.scheme.lower() != "amqps":
                raise ConfigError(f"rabbitmq option {', '.join(files)}: TLS needs an amqps:// URL")
            client_context("rabbitmq", files)
        rest = {name: value for name, value in options.items() if name in _DRIVER_OPTIONS}
        self._driver_url = parts._replace(query=urlencode(rest)).geturl()
        self._connection: AbstractConnection | None = None
        #: Channels of the current connection that no wave is using (see "Lanes").
        self._idle_lanes: list[AbstractChannel] = []
        #: One (re)connect at a time; waves do not wait for each other.
        self._lock = asyncio.Lock()
        self._generation = 0  # connections made so far
        #: Closes of lanes given up mid-wave, kept referenced until they finish.
        self._closing: set[asyncio.Task[None]] = set()
        #: Whether waves go out in one write (``_write_wave``); decided on the first wave.
        self._whole_waves: bool | None = None
        #: An exchange declare was refused and the exchange used as it is: logged once.
        self._refusal_logged = False
        #: RabbitMQ's refusal of the exchange declare (403), once it came: later connects
        #: check the exchange passively instead of being refused again.
        self._refused: BaseException | None = None
        #: Lanes taken by waves and not given back yet.
        self._busy_lanes = 0
        #: The most channels RabbitMQ let this publisher open (learned from its 530
        #: NOT_ALLOWED close: a user's ``max-channels`` limit, the server's ``channel_max``);
        #: None until then. Waves beyond it wait for a lane instead of opening one.
        self._lane_cap: int | None = None
        self._cap_generation = 0  # the connection on which it was learned
        #: When (loop time) the cap was learned or last met again: once ``lane_cap_retry``
        #: has passed, one wave at the cap tries a channel beyond it (``_take_lane``).
        self._cap_since = 0.0
        self._probing = False  # a wave is trying a channel beyond the cap
        #: Set whenever a lane is given back (a wave waiting at the cap takes it).
        self._lane_returned = asyncio.Event()

    # ----- where a message goes -----------------------------------------------------------

    def target_for(self, message: Message) -> tuple[str, str]:
        """``(exchange, routing_key)`` for a message; see the module docstring."""
        destination = self.destination_for(message)
        if message.topic in self.routes and "/" in destination:
            exchange, routing_key = destination.split("/", 1)
            return exchange, routing_key
        return self.exchange, destination

    def _prepare(self, message: Message) -> _Publish:
        """The publish for a message; PublishError(retryable=False) if AMQP cannot carry it."""
        exchange, routing_key = self.target_for(message)
        for what, text in (("routing key", routing_key), ("content type", message.content_type)):
            if _over_short_string(text):
                raise PublishError(
                    f"{what} {text[:40]!r}… is longer than AMQP's {_SHORTSTR} bytes",
                    retryable=False,
                )
        for text in message.headers:
            # pamqp would cut a longer name to 128 bytes (a field table's limit) and send the
            # message with a header renamed, or two headers merged into one.
            if len(text) > _TABLE_KEY_MAX // 4 and len(text.encode("utf-8")) > _TABLE_KEY_MAX:
                raise PublishError(
                    f"header name {text[:40]!r}… is longer than an AMQP field table's "
                    f"{_TABLE_KEY_MAX} bytes",
                    retryable=False,
                )
        try:
            _publish_method(exchange, routing_key, self.mandatory)  # pamqp's checks, cached
        except ValueError as exc:
            raise PublishError(
                f"AMQP cannot carry the message to exchange {exchange[:40]!r}: {exc}",
                retryable=False,
            ) from exc
        properties = _properties(
            message.content_type,
            2 if self.persistent else 1,
            str(message.id),
            message.created_at,
            message.envelope_headers(),
        )
        return _Publish(exchange, routing_key, message.payload, properties)

    # ----- connection -----------------------------------------------------------------------

    async def _connect(self) -> None:
        await self._reconnect_unless_newer(self._generation)

    async def _reconnect_unless_newer(self, generation: int) -> None:
        """Open a fresh connection, unless another caller did since ``generation``."""
        async with self._lock:
            if self._generation != generation and not self._connection_lost():
                return
            await self._reconnect()

    async def _reconnect(self) -> None:
        try:
            await self._reconnect_once()
        except aiormq.exceptions.ConnectionNotAllowed as exc:
            # RabbitMQ still counted the channel its refusal closed when the passive check
            # opened the next (a user's max-channels 1: it untracks channels a moment
            # later): the connection is gone; the next connect checks passively at once.
            if self._refused is None or "channel" not in str(exc):
                raise
            await self._close()
            await self._reconnect_once()

    async def _reconnect_once(self) -> None:
        await self._close()
        connection = await connect_amqp(self._driver_url, self.connect_timeout)
        try:
            channel = await self._open_channel(connection)
            if self.declare_exchange and self.exchange and not self.exchange.startswith("amq."):
                if self._refused is not None:
                    # Refused before: a passive declare on the lane's channel, no refusal
                    # closing a channel at every connect.
                    await self._check_exists(channel, self.exchange, self._refused)
                    self._connection, self._idle_lanes = connection, [channel]
                    self._generation += 1
                    return
                try:
                    await channel.declare_exchange(
                        self.exchange,
                        self.exchange_type,
                        durable=True,
                        timeout=self.connect_timeout,
                    )
                except aiormq.exceptions.ChannelPreconditionFailed as exc:
                    raise PublishError(
                        f"exchange {self.exchange!r} exists with other settings than a durable "
                        f"{self.exchange_type} exchange ({exc.args[0] if exc.args else exc}); set "
                        "exchange_type to match it or declare_exchange=false",
                        retryable=False,
                    ) from exc
                except aiormq.exceptions.ChannelAccessRefused as exc:
                    # The refusal closed the channel; the connection is fine.
                    self._refused = exc
                    await self._quietly(channel.close())
                    await self.exchange_exists(connection, self.exchange, exc)
                    channel = await self._open_channel(connection)
        except BaseException:
            await self._quietly(connection.close())
            raise
        self._connection, self._idle_lanes = connection, [channel]
        self._generation += 1

    async def exchange_exists(
        self, connection: AbstractConnection, name: str, refusal: BaseException
    ) -> None:
        """After RabbitMQ refused to declare exchange ``name`` (403: the user lacks the
        ``configure`` permission, as an operations team that provisions exchanges itself
        grants): go on if it exists, else a non-retryable PublishError.

        Read as an outage, the refusal was retried at every connect for ever ("broker
        unreachable"), though the user could publish to the exchange. A passive declare
        needs no permission; it cannot check the exchange's type, which is the operator's.
        (The consumer side, outboxer.receivers.rabbitmq, calls this too.)"""
        reason = refusal.args[0] if refusal.args else refusal
        channel = await asyncio.wait_for(connection.channel(), self.connect_timeout)
        try:
            await self._check_exists(channel, name, refusal)
        finally:
            await self._quietly(channel.close())
        if not self._refusal_logged:
            self._refusal_logged = True
            logger.warning(
                "%s: RabbitMQ refused to declare exchange %r (%s); it exists, so it is used "
                "as it is (declare_exchange=false says so and skips the declare)",
                self.safe_url,
                name,
                reason,
            )

    @staticmethod
    async def _check_exists(channel: AbstractChannel, name: str, refusal: BaseException) -> None:
        """A passive declare of exchange ``name`` on ``channel``; a non-retryable
        PublishError if it does not exist (its 404 closed the channel)."""
        try:
            await channel.get_exchange(name, ensure=True)
        except aiormq.exceptions.ChannelNotFoundEntity:
            reason = refusal.args[0] if refusal.args else refusal
            raise PublishError(
                f"RabbitMQ refused to declare exchange {name!r} ({reason}) and it does not "
                "exist: have it declared, or grant the user the configure permission on it",
                retryable=False,
            ) from refusal

    async def _open_channel(self, connection: AbstractConnection) -> AbstractChannel:
        return await asyncio.wait_for(
            connection.channel(publisher_confirms=True, on_return_raises=True), self.connect_timeout
        )

    async def _close(self) -> None:
        connection, self._connection = self._connection, None
        lanes, self._idle_lanes = self._idle_lanes, []
        for channel in lanes:
            await self._quietly(channel.close())
        if connection is not None:
            await self._quietly(connection.close())

    @staticmethod
    async def _quietly(closing: Awaitable[object]) -> None:
        """Close a channel or connection; one already broken has nothing left to release.

        Closing the channel before its connection lets aio-pika finish its close
        callbacks rather than leave them pending when the connection goes.
        """
        with contextlib.suppress(aiormq.exceptions.AMQPError, RuntimeError, OSError, TimeoutError):
            await asyncio.wait_for(closing, _CLOSE_TIMEOUT)

    def _connection_lost(self) -> bool:
        # aio-pika's is_closed only turns true on close(); a server-side close clears `connected`.
        connection = self._connection
        return connection is None or connection.is_closed or not connection.connected.is_set()

    def _transport_lost(self) -> bool:
        return self._connection_lost()

    @property
    def blocked(self) -> str | None:
        # aiormq records connection.blocked / connection.unblocked (frames on channel 0) in
        # the event that ``_unblocked`` reads; a new connection starts unblocked.
        if self._connection_lost():
            return None
        transport = getattr(self._connection, "transport", None)
        unblocked = _unblocked(getattr(transport, "connection", None))
        if unblocked is None or unblocked.is_set():
            return None
        return "blocked by the broker (resource alarm)"

    async def _take_lane(self, deadline: float | None = None) -> _Lane:
        """An open channel of the current connection for one wave: an idle one if there is
        one, else a new one; at the channel limit RabbitMQ set (``_lane_cap``), the next one
        given back, or NotSent if none is by ``deadline`` (a loop time; default: in
        ``publish_timeout``)."""
        loop = asyncio.get_running_loop()
        if deadline is None:
            deadline = loop.time() + self.publish_timeout
        probe = False
        while True:
            if self._connection is None or self._connection_lost():
                raise BrokerUnavailableError(f"connection to {self.safe_url} is closed")
            while self._idle_lanes:
                channel = self._idle_lanes.pop()
                if not channel.is_closed:
                    self._busy_lanes += 1
                    return _Lane(channel, self._generation)
                await self._quietly(channel.close())
            open_now = self._busy_lanes + len(self._closing)
            # The server's channel_max (Connection.Tune) is known from the connect: kept to
            # from the start, instead of learned from a 530 that drops every lane's waves.
            channel_max = self._channel_max()
            if channel_max is None or open_now < channel_max:
                if self._lane_cap is None or open_now < self._lane_cap:
                    break
                if not self._probing and loop.time() >= self._cap_since + self.lane_cap_retry:
                    probe = self._probing = True
                    break
            limit = min(n for n in (self._lane_cap, channel_max) if n is not None)
            if loop.time() >= deadline:
                raise NotSent(
                    PublishError(
                        f"no channel came free in time: RabbitMQ allows this publisher "
                        f"{limit} channel(s); not attempted"
                    )
                )
            self._lane_returned.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(deadline - loop.time()):
                    await self._lane_returned.wait()
        self._busy_lanes += 1  # taken now: waves opening channels at once count each other
        try:
            channel = await self._open_channel(self._connection)
        except BaseException as exc:
            self._busy_lanes -= 1
            self._lane_returned.set()
            if probe:
                self._probing = False
            # RabbitMQ closes the whole connection (530) for a channel over a user's
            # max-channels or its channel_max, every lane's waves with it: it did so again
            # after each reconnect, as long as the relay's loops had more waves in flight.
            if isinstance(exc, aiormq.exceptions.ConnectionNotAllowed) and "channel" in str(exc):
                # The limit RabbitMQ names ("... limit of (2)", "... channel_max (16)"); a
                # refusal within a cap already learned (other connections of the user hold
                # channels too) lowers it to what this one had.
                named = [int(n) for n in re.findall(r"\((\d+)\)", str(exc))]
                if self._lane_cap is not None and self._cap_generation == self._generation:
                    cap = self._lane_cap  # the same close, failing opens under way with it
                elif self._lane_cap is not None:
                    cap = max(1, min(self._lane_cap, open_now))
                else:
                    cap = max(1, named[-1] if named else open_now)
                self._cap_generation = self._generation
                self._cap_since = loop.time()
                if cap != self._lane_cap:
                    self._lane_cap = cap
                    logger.warning(
                        "%s: RabbitMQ closed the connection for a channel beyond %d (%s); "
                        "this publisher keeps to %d channel(s) from now on, its waves "
                        "waiting for one",
                        self.safe_url,
                        cap,
                        exc.args[0] if exc.args else exc,
                        cap,
                    )
            raise
        if probe:
            self._probing = False
            if self._lane_cap is not None:
                logger.warning(
                    "%s: RabbitMQ allowed a channel beyond the %d this publisher kept to; "
                    "the limit is forgotten (learned again from the next 530)",
                    self.safe_url,
                    self._lane_cap,
                )
                self._lane_cap = None
                self._lane_returned.set()  # the waves waiting at the cap go on
        return _Lane(channel, self._generation)

    def _channel_max(self) -> int | None:
        """The ``channel_max`` RabbitMQ set at the connect (Connection.Tune), None for none
        (0) or where aiormq does not tell."""
        transport = getattr(self._connection, "transport", None)
        tune = getattr(getattr(transport, "connection", None), "connection_tune", None)
        channel_max = getattr(tune, "channel_max", None)
        return channel_max if isinstance(channel_max, int) and channel_max > 0 else None

    def _return_lane(self, lane: _Lane, *, reusable: bool) -> None:
        """Give a lane back after its wave: idle again if it is sound and of the current
        connection, else closed (a wave cut short may have left confirms pending on it)."""
        self._busy_lanes -= 1
        self._lane_returned.set()
        channel = lane.channel
        if (
            reusable
            and not lane.cut_short
            and lane.generation == self._generation
            and not channel.is_closed
        ):
            self._idle_lanes.append(channel)
        elif not channel.is_closed:
            task = asyncio.ensure_future(self._quietly(channel.close()))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    # ----- publishing -----------------------------------------------------------------------

    async def _send_all(
        self, lane: _Lane, publishes: Sequence[_Publish], deadline: float | None = None
    ) -> list[BaseException | None]:
        """Publish all of them on the channel at once; each one's outcome (None = acked).

        If RabbitMQ blocked the connection (a resource alarm) and confirms are still
        missing at ``deadline`` (a loop time), those come back as ``NotSent``: a broker
        that stopped reading took no attempt of theirs, and an alarm that outlasts a few
        waves must not use up their attempts. (Some may have been read before the block
        and are confirmed later: published again, they are duplicates, as after a timeout.)

        A publish still pending when the channel closes comes back as ``ChannelClosed``:
        aiormq fails the ones awaiting a confirm, but not the ones queued behind a dead
        connection's writer, which would wait forever (an outage can take the connection
        down). One never written because the channel was closing comes back as
        ``ChannelInvalidStateError``.

        On a connection that is not blocked, the confirms missing at ``deadline`` come back
        as ``TimeoutError`` and the ones in by then are kept: the base class's timeout, a
        little later, would fail the whole wave, the confirmed messages included.
        """
        watcher: asyncio.Future[Any] | None = None  # see _write_wave
        writer: asyncio.Task[None] | None = None  # see _send_in_turn
        try:
            underlay = await lane.channel.get_underlay_channel()
            if self._writes_whole_waves(underlay):
                sends, watcher = await self._write_wave(underlay, publishes)
            else:
                sends, writer = self._send_in_turn(underlay, publishes)
        except aiormq.exceptions.ChannelInvalidStateError as exc:
            return [exc] * len(publishes)
        loop = asyncio.get_running_loop()
        wave = _WaveWait(loop, sends)
        closing = underlay.closing
        closing.add_done_callback(wave.wake)
        timer = loop.call_at(deadline, wave.wake) if deadline is not None else None
        blocked: PublishError | None = None
        answered: list[bool] | None = None  # which were settled at the deadline, if it passed
        try:
            await wave.future
            if wave.missing and not closing.done():  # the deadline passed
                if _blocked(underlay):
                    blocked = self._blocked_error()
                else:  # before the finally below cancels the pending ones
                    answered = [send.done() for send in sends]
            elif wave.missing:
                # The channel closed: those failing on their own do so at once; the rest never will.
                await asyncio.wait(sends, timeout=_CLOSED_GRACE)
        finally:
            if timer is not None:
                timer.cancel()
            closing.cancel()  # only stops observing
            if watcher is not None:
                watcher.cancel()
            if writer is not None:
                writer.cancel()
                await asyncio.wait((writer,))  # settles every send it has not written
            for send in sends:
                send.cancel()
            if watcher is not None:
                # What basic_publish's own callback does: returns are matched by message id.
                for publish in publishes:
                    cast(Any, underlay).message_id_delivery_tag.pop(
                        publish.properties.message_id or "", None
                    )
        if blocked is not None:
            return [
                None if send.done() and self._outcome(send) is None else NotSent(blocked)
                for send in sends
            ]
        if answered is not None:
            lane.cut_short = True
            return [
                self._outcome(send) if done else self._unanswered(send)
                for send, done in zip(sends, answered, strict=True)
            ]
        return [self._outcome(send) for send in sends]

    def _unanswered(self, send: asyncio.Future[Any]) -> BaseException:
        """The outcome of a publish unconfirmed at the wave's deadline: timed out, or, if it
        was never written (``_send_in_turn`` writes one at a time, and its writer, cancelled,
        fails the rest with ChannelInvalidStateError), not attempted: RabbitMQ never got it,
        and a slow confirm of an earlier one must not use up its attempts."""
        if not send.cancelled() and isinstance(
            send.exception(), aiormq.exceptions.ChannelInvalidStateError
        ):
            return NotSent(
                TimeoutError(
                    "not written: an earlier message of the wave was not confirmed within "
                    f"{self.publish_timeout}s"
                )
            )
        return self._wave_timed_out()

    def _blocked_error(self) -> PublishError:
        # Not a lost connection: RabbitMQ reads the connection again once the alarm is
        # over, and a reconnect would wait on closing the blocked one.
        return PublishError(
            f"RabbitMQ at {self.safe_url} blocked the connection (connection.blocked: a "
            "memory or disk alarm); not attempted, published once the alarm is over"
        )

    async def _wait_unblocked(self, deadline: float) -> bool:
        """Whether the connection is not blocked, or unblocked before ``deadline``."""
        transport = getattr(self._connection, "transport", None)
        unblocked = _unblocked(getattr(transport, "connection", None))
        if unblocked is None or unblocked.is_set():
            return True
        remaining = deadline - asyncio.get_running_loop().time()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.0, remaining)):
                await unblocked.wait()
        return unblocked.is_set()

    def _writes_whole_waves(self, underlay: aiormq.abc.AbstractChannel) -> bool:
        """Whether waves go out in one write on this aiormq; the first no is logged, once."""
        if self._whole_waves is None:
            reason = (
                wave_writes_unsupported(underlay, importlib.metadata.version("aiormq"))
                if self._wave_writes
                else None
            )
            self._whole_waves = self._wave_writes and reason is None
            if reason is not None:
                logger.warning(
                    "RabbitMQ publisher for %s publishes one message at a time, each confirmed "
                    "before the next, instead of whole waves: %s",
                    self.safe_url,
                    reason,
                )
        return self._whole_waves

    @staticmethod
    def _outcome(send: asyncio.Future[Any]) -> BaseException | None:
        error = None if send.cancelled() else send.exception()
        # A close without a reason (ours: a lane reconnecting closes the connection under the
        # others) fails aiormq's pending futures with a bare Exception: still just a close.
        if send.cancelled() or type(error) is Exception:
            return aiormq.exceptions.ChannelClosed(None, "closed with the publish pending")
        if error is None and not isinstance(send.result(), spec.Basic.Ack | None):
            return PublishError(f"RabbitMQ answered {send.result()!r} instead of basic.ack")
        return error

    async def _write_wave(
        self,
        underlay: Any,
        publishes: Sequence[_Publish],
    ) -> tuple[list[asyncio.Future[Any]], asyncio.Future[Any]]:
        """Register a confirmation for each publish, then write the whole wave as one frame
        buffer: one socket write instead of a task, a lock round and a write per message,
        which were two thirds of the relay's CPU when draining to RabbitMQ.

        This is what ``basic_publish`` does for one message, on the same channel state
        (delivery tags, confirmations, the message ids returns are matched by), so aiormq's
        reader settles these confirmations and reports returns. A close fails the pending
        ones with its reason through one watcher per wave, which aiormq rejects on a close
        as it would each confirmation of its own (registering each one costs more than
        writing it).
        """
        loop = asyncio.get_running_loop()
        async with underlay.lock:  # raises ChannelInvalidStateError once the channel closed
            if not _takes_frames(underlay):  # closing: reports is_closed only a little later
                raise aiormq.exceptions.ChannelInvalidStateError(
                    "the channel was closing before the wave was written"
                )
            first = underlay.delivery_tag + 1
            confirmations: list[asyncio.Future[Any]] = [_Confirmation(loop=loop) for _ in publishes]
            try:
                for tag, (publish, confirmation) in enumerate(
                    zip(publishes, confirmations, strict=True), start=first
                ):
                    underlay.confirmations[tag] = confirmation
                    underlay.message_id_delivery_tag[publish.properties.message_id] = tag
                frames = _wave_frames(
                    underlay.number, underlay.max_content_size, publishes, self.mandatory
                )
                underlay.delivery_tag = first + len(publishes) - 1
                await self._enqueue_frames(
                    underlay, ChannelFrame(payload=frames, should_close=False)
                )
            except BaseException:
                # Not written: RabbitMQ numbers its confirms by what it received, so the
                # tags are given back, as basic_publish does.
                underlay.delivery_tag = first - 1
                for tag in range(first, first + len(confirmations)):
                    underlay.confirmations.pop(tag, None)
                raise
        watcher = underlay.create_future()
        watcher.add_done_callback(functools.partial(_fail_pending, confirmations))
        return confirmations, watcher

    @staticmethod
    async def _enqueue_frames(underlay: Any, frame: ChannelFrame) -> None:
        """Hand the frames to the connection's writer; raises ChannelInvalidStateError, with
        nothing handed over, if the channel closes while the writer's queue is full (a dead
        connection's writer never empties it).

        Waiting for room cannot let the frames follow a ``close-ok``: RabbitMQ closes a
        channel only for a frame written on it, and the lane's earlier waves were all
        confirmed before this one began."""
        try:
            underlay.write_queue.put_nowait(frame)
            return
        except asyncio.QueueFull:
            pass
        put = asyncio.ensure_future(underlay.write_queue.put(frame))
        closing = underlay.closing
        try:
            await asyncio.wait((put, closing), return_when=asyncio.FIRST_COMPLETED)
        finally:
            closing.cancel()  # only stops observing
            put.cancel()  # a put that has not happened yet never will
        if put.cancelled():
            raise aiormq.exceptions.ChannelInvalidStateError(
                "the channel closed before the wave was written"
            )

    def _send_in_turn(
        self, underlay: aiormq.abc.AbstractChannel, publishes: Sequence[_Publish]
    ) -> tuple[list[asyncio.Future[None]], asyncio.Task[None]]:
        """One future per publish, and the task that publishes them one at a time, each
        confirmed before the next is written, for aiormq releases without the channel state
        ``_write_wave`` writes through.

        Concurrent ``basic_publish`` calls would all queue on aiormq's channel lock, and
        the one that takes it while the channel is closing writes behind the ``close-ok``
        (see "Closing channels" in the module docstring). One at a time, each publish is
        checked against :func:`_takes_frames` right before its call, which writes at once
        (the lock is free, the writer's queue has room for one lane's frames). After a
        refusal (or if the task is cancelled) the publishes not written fail with
        ChannelInvalidStateError.
        """
        loop = asyncio.get_running_loop()
        sends: list[asyncio.Future[None]] = [loop.create_future() for _ in publishes]

        def not_written(position: int) -> None:
            for send in sends[position:]:
                if not send.done():
                    send.set_exception(
                        aiormq.exceptions.ChannelInvalidStateError(
                            "not written: the channel was closing"
                        )
                    )

        async def write_in_turn() -> None:
            for position, (publish, send) in enumerate(zip(publishes, sends, strict=True)):
                if not _takes_frames(underlay):
                    not_written(position)
                    return
                try:
                    await self._send(underlay, publish)
                except asyncio.CancelledError:
                    send.cancel()  # it may have been written: a close with it pending
                    not_written(position + 1)
                    raise
                except Exception as exc:  # noqa: BLE001 - the message's own outcome
                    send.set_exception(exc)
                else:
                    send.set_result(None)

        return sends, asyncio.ensure_future(write_in_turn())

    async def _send(self, underlay: aiormq.abc.AbstractChannel, publish: _Publish) -> None:
        """One ``basic.publish``; returns once RabbitMQ acked it, raises the driver's error else."""
        confirmation = await underlay.basic_publish(
            publish.body,
            exchange=publish.exchange,
            routing_key=publish.routing_key,
            properties=publish.properties,
            mandatory=self.mandatory,
            **_NO_DRAIN,
        )
        if not isinstance(confirmation, spec.Basic.Ack):
            raise PublishError(f"RabbitMQ answered {confirmation!r} instead of basic.ack")

    async def _publish_wave(self, messages: Sequence[Message]) -> list[BaseException | None]:
        results: list[BaseException | None] = [None] * len(messages)
        prepared: dict[int, _Publish] = {}
        for index, message in enumerate(messages):
            try:
                prepared[index] = self._prepare(message)
            except PublishError as exc:
                results[index] = exc
            except UnicodeEncodeError as exc:
                # A lone surrogate (a row's headers JSON may hold "\ud800"): raised out of
                # the wave, it failed every message of it, attempt after attempt.
                results[index] = PublishError(
                    f"AMQP cannot carry the message, it is not valid Unicode: {exc}",
                    retryable=False,
                )
        if not prepared:
            return results
        # Leave the base class's timeout for what is already settled, not for the whole wave.
        deadline = asyncio.get_running_loop().time() + 0.8 * self.publish_timeout
        if not await self._wait_unblocked(deadline):
            # Nothing written (not even a channel.open for a new lane, which would wait for
            # its answer): frames on a blocked connection wait unread in its buffers.
            return self._fail(results, list(prepared), NotSent(self._blocked_error()))
        try:
            lane = await self._take_lane(deadline)
        except NotSent as exc:  # at the channel limit, and no lane came free in time
            return self._fail(results, list(prepared), exc)
        except Exception as exc:  # noqa: BLE001 - reported on each message
            if self._connection_lost():
                # Nothing of the wave was written: the connection went before it had a
                # channel (lost while one opened). No attempt is counted.
                not_sent = NotSent(self._lost(exc))
                return [
                    not_sent if index in prepared else result
                    for index, result in enumerate(results)
                ]
            return self._fail(results, list(prepared), exc)
        try:
            underlay = await lane.channel.get_underlay_channel()
        except Exception:  # noqa: BLE001 - closing: the wave finds out below and recovers
            underlay = None
        limit: int | None = getattr(underlay, "max_content_size", None)
        for index in [i for i in prepared if _over_frame(prepared[i], limit)]:
            # RabbitMQ takes a content header over its frame_max as a framing error and
            # closes the connection (501 FRAME_ERROR), every lane's waves with it, on
            # every attempt: the message is refused here, for good, instead.
            del prepared[index]
            results[index] = PublishError(
                f"the message's properties and headers take more than the "
                f"{limit} bytes of one AMQP frame (frame_max) on this connection",
                retryable=False,
            )
        if not prepared:
            self._return_lane(lane, reusable=True)
            return results
        finished = False
        try:
            results = await self._publish_on_lane(lane, prepared, results, deadline)
            finished = True
            return results
        finally:
            self._return_lane(lane, reusable=finished)

    async def _publish_on_lane(
        self,
        lane: _Lane,
        prepared: dict[int, _Publish],
        results: list[BaseException | None],
        deadline: float,
    ) -> list[BaseException | None]:
        """Publish ``prepared`` on the lane; after a channel (or connection) close, recover
        as the module docstring says, on a new channel in the same lane."""
        loop = asyncio.get_running_loop()
        todo = list(prepared)
        while todo:
            if loop.time() > deadline:
                return self._fail(
                    results,
                    todo,
                    PublishError(
                        "RabbitMQ closed the channel; no time was left to publish the message again"
                    ),
                )
            raw = await self._send_all(lane, [prepared[i] for i in todo], deadline)
            in_flight: list[int] = []  # written before the channel closed, in write order
            unsent: list[int] = []  # refused by the client once the channel was closed
            for index, outcome in zip(todo, raw, strict=True):
                if isinstance(outcome, NotSent):  # blocked: see _send_all
                    results[index] = outcome
                    continue
                # A connection closed under the wave (another lane's refusal, or an outage,
                # which the reconnect below then reports) closed the channel as well.
                if isinstance(
                    outcome, aiormq.exceptions.ChannelClosed | aiormq.exceptions.ConnectionClosed
                ):
                    in_flight.append(index)
                elif isinstance(outcome, aiormq.exceptions.ChannelInvalidStateError):
                    unsent.append(index)
                elif isinstance(outcome, BaseException):
                    results[index] = self._translate(outcome)
            if not in_flight and not unsent:
                break
            if not in_flight:  # the channel closed before any of them went out: not their doing
                return self._fail(results, unsent, self._lost(None))
            # One of the in-flight messages closed the channel (or an outage took the
            # connection down). Nothing went out on the channel after its close, so a new
            # channel is enough, and the other lanes keep the connection their waves are on.
            try:
                await self._replace_lane(lane)
            except Exception as exc:  # noqa: BLE001 - reported on each message
                return self._fail(results, in_flight + unsent, self._lost(exc))
            # Send them again one at a time, in write order, until one closes the channel on its
            # own: it is the culprit, and RabbitMQ dropped everything written after it unread,
            # so those go back into a pipelined round with the unsent ones.
            later: list[int] = []
            for position, index in enumerate(in_flight):
                if loop.time() > deadline:
                    later = in_flight[position:]
                    break
                results[index], closed = await self._publish_alone(lane, prepared[index], deadline)
                if closed:
                    later = in_flight[position + 1 :]
                    break
            todo = sorted(later + unsent)
        return results

    async def _replace_lane(self, lane: _Lane) -> None:
        """Swap the lane's closed channel for a new one; on a new connection if the
        connection is gone, unless another lane reconnected since the lane's began."""
        await self._quietly(lane.channel.close())
        if self._connection_lost():
            await self._reconnect_unless_newer(lane.generation)
        if self._connection is None or self._connection_lost():
            raise BrokerUnavailableError(f"connection to {self.safe_url} is closed")
        lane.channel, lane.generation = await self._open_channel(self._connection), self._generation

    async def _publish_alone(
        self, lane: _Lane, publish: _Publish, deadline: float | None = None
    ) -> tuple[BaseException | None, bool]:
        """Publish one message with nothing else in flight on its lane: its failure is its own.

        Returns the outcome and whether the message closed the channel (the lane then holds
        a fresh channel, if one could be opened).
        """
        try:
            if lane.channel.is_closed:
                await self._replace_lane(lane)
            [outcome] = await self._send_all(lane, [publish], deadline)
            if outcome is not None:
                raise outcome
        except Exception as exc:  # noqa: BLE001 - returned as the message's outcome
            closed = isinstance(exc, aiormq.exceptions.ChannelClosed)
            if closed:  # nothing else was in flight on it: a new channel is enough
                with contextlib.suppress(Exception):  # if not, the next round reports the outage
                    await self._replace_lane(lane)
            return self._translate(exc, alone=True), closed
        return None, False

    def _fail(
        self, results: list[BaseException | None], indexes: Sequence[int], exc: BaseException
    ) -> list[BaseException | None]:
        error = self._translate(exc)
        for index in indexes:
            results[index] = error
        return results

    def _translate(self, exc: BaseException, *, alone: bool = False) -> BaseException:
        """The driver's error as this library's: retryable or not, connection lost or not."""
        errors = aiormq.exceptions
        frame = (
            exc.message.delivery if isinstance(exc, errors.PublishError) and exc.message else None
        )
        if isinstance(frame, spec.Basic.Return):  # mandatory and no queue took it
            return PublishError(
                f"RabbitMQ returned the message as unroutable ({frame.reply_code} {frame.reply_text}): "
                f"no queue is bound to exchange {frame.exchange!r} for routing key {frame.routing_key!r}"
            )
        if isinstance(exc, errors.DeliveryError):
            return PublishError(f"RabbitMQ did not take the message: {exc}")
        if isinstance(exc, errors.ChannelClosed):
            reason = exc.args[0] if exc.args else type(exc).__name__
            if isinstance(exc, errors.ChannelNotFoundEntity):
                return PublishError(
                    f"RabbitMQ refused the message: {reason} (the exchange may be "
                    "declared later; retrying)"
                )
            if alone and isinstance(exc, _PERMANENT):
                return PublishError(f"RabbitMQ refused the message: {reason}", retryable=False)
            return PublishError(f"RabbitMQ closed the channel: {reason}")
        if isinstance(exc, ConnectionError | OSError | TimeoutError | BrokerUnavailableError):
            return exc
        if self._connection_lost():
            return self._lost(exc)
        return exc

    def _lost(self, exc: BaseException | None) -> BrokerUnavailableError:
        """The connection is gone (or unusable): every message concerned is retryable."""
        if isinstance(exc, BrokerUnavailableError):
            return exc
        detail = f": {type(exc).__name__}: {exc}" if exc is not None else ""
        error = BrokerUnavailableError(f"no usable connection to {self.safe_url}{detail}")
        error.__cause__ = exc
        return error


__all__ = ["RabbitMQPublisher"]
