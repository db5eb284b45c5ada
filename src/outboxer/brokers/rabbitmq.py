"""``amqp://`` and ``amqps://``: RabbitMQ through aio-pika, with publisher confirms.

Each message is one ``basic.publish`` with ``mandatory`` set, on a channel in
confirm mode; it counts as published once RabbitMQ answered ``basic.ack``. A
wave's publishes are all written before any confirm is awaited.

Where a message goes: the topic (or its route) is the routing key on the
exchange ``exchange`` (a durable topic exchange declared on connect). A route
of the form ``EXCHANGE/ROUTING_KEY`` names another exchange (empty for the
AMQP default exchange, whose routing key is a queue name).

Envelope: ``message_id`` is the outbox id, ``content_type`` the payload's
content type, ``timestamp`` the creation time, ``delivery_mode`` 2
(persistent); the headers carry the user headers plus ``outboxer-id``,
``outboxer-topic``, ``outboxer-key``, ``outboxer-created-at`` and
``content-type``.

Failures. ``basic.return`` (no queue bound) and ``basic.nack`` are retryable,
as is a missing exchange (404). A message RabbitMQ refuses by closing the
channel (403 ACCESS_REFUSED, 406 PRECONDITION_FAILED such as a message above
``max_message_size``) is permanent. Such a close also fails every other
message in flight on the channel, and a close amid pipelined publishes can make
the client send frames on the dead channel, which RabbitMQ answers by closing
the connection. So after a channel close the publisher reconnects and sends
each message that was in flight once more, alone: only the one RabbitMQ
refuses again on its own is permanent.

Waves (and connects) of one publisher take turns, so that this recovery never
sees the refusals of a wave that a concurrent caller publishes meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import aio_pika
import aiormq
from aio_pika.abc import AbstractChannel, AbstractConnection
from aiormq import spec
from pamqp.common import FieldTable

from outboxer.brokers.base import Publisher, option_bool, parse_options
from outboxer.errors import BrokerUnavailableError, ConfigError, PublishError
from outboxer.message import Message

#: Our own URL options; the rest of the query string goes to aio-pika (heartbeat, name, cafile…).
_OPTIONS = ("exchange", "exchange_type", "declare_exchange", "persistent", "mandatory",
            "connect_timeout")
_EXCHANGE_TYPES = ("topic", "direct", "fanout", "headers")
#: Channel closes that the same message will cause again: refused for good.
_PERMANENT = (aiormq.exceptions.ChannelAccessRefused, aiormq.exceptions.ChannelPreconditionFailed)
_CLOSE_TIMEOUT = 5.0
#: AMQP short strings (routing key, content type, header names) hold at most 255 bytes.
_SHORTSTR = 255
#: aiormq >= 7 can write a publish without awaiting the socket drain: the whole wave goes out
#: before the first confirm is awaited (its bounded write queue still applies backpressure).
_NO_DRAIN: dict[str, Any] = (
    {"wait": False} if "wait" in inspect.signature(aiormq.Channel.basic_publish).parameters else {}
)


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
            raise ConfigError(f"exchange_type must be one of {', '.join(_EXCHANGE_TYPES)}, "
                              f"not {self.exchange_type!r}")
        self.declare_exchange = option_bool(options, "declare_exchange", declare_exchange, True)
        self.persistent = option_bool(options, "persistent", persistent, True)
        self.mandatory = option_bool(options, "mandatory", mandatory, True)
        if connect_timeout is None:
            text = options.get("connect_timeout", "10")
            try:
                connect_timeout = float(text)
            except ValueError:
                raise ConfigError(f"connect_timeout must be a number of seconds, not {text!r}") from None
        if connect_timeout <= 0:
            raise ConfigError("connect_timeout must be positive")
        self.connect_timeout = connect_timeout
        for topic, route in self.routes.items():
            if not route:
                raise ConfigError(f"route for topic {topic!r} is empty")
        rest = {name: value for name, value in options.items() if name not in _OPTIONS}
        self._driver_url = parts._replace(query=urlencode(rest)).geturl()
        self._connection: AbstractConnection | None = None
        self._channel: AbstractChannel | None = None
        #: One wave or (re)connect at a time: several relay loops share a publisher, and a wave's
        #: recovery (reconnect, then publishing alone) must not see another wave's refusals.
        self._lock = asyncio.Lock()
        self._generation = 0  # connections made so far

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
        for what, text in (("routing key", routing_key), ("content type", message.content_type),
                           *(("header name", name) for name in message.headers)):
            if len(text.encode("utf-8")) > _SHORTSTR:
                raise PublishError(f"{what} {text[:40]!r}… is longer than AMQP's {_SHORTSTR} bytes",
                                   retryable=False)
        headers: FieldTable = dict(message.envelope_headers())
        properties = spec.Basic.Properties(
            content_type=message.content_type,
            delivery_mode=2 if self.persistent else 1,
            message_id=str(message.id),
            timestamp=message.created_at,
            headers=headers,
        )
        return _Publish(exchange, routing_key, message.payload, properties)

    # ----- connection -----------------------------------------------------------------------

    async def _connect(self) -> None:
        generation = self._generation
        async with self._lock:
            if self._generation != generation and not self._connection_lost():
                return  # another caller connected while this one waited
            await self._reconnect()

    async def _reconnect(self) -> None:
        await self._close()
        connection = await aio_pika.connect(self._driver_url, timeout=self.connect_timeout)
        try:
            channel = await self._open_channel(connection)
            if self.declare_exchange and self.exchange and not self.exchange.startswith("amq."):
                try:
                    await channel.declare_exchange(self.exchange, self.exchange_type, durable=True,
                                                   timeout=self.connect_timeout)
                except aiormq.exceptions.ChannelPreconditionFailed as exc:
                    raise PublishError(
                        f"exchange {self.exchange!r} exists with other settings than a durable "
                        f"{self.exchange_type} exchange ({exc.args[0] if exc.args else exc}); set "
                        "exchange_type to match it or declare_exchange=false",
                        retryable=False,
                    ) from exc
        except BaseException:
            await self._quietly(connection.close())
            raise
        self._connection, self._channel = connection, channel
        self._generation += 1

    async def _open_channel(self, connection: AbstractConnection) -> AbstractChannel:
        return await asyncio.wait_for(
            connection.channel(publisher_confirms=True, on_return_raises=True), self.connect_timeout)

    async def _close(self) -> None:
        connection, self._connection = self._connection, None
        channel, self._channel = self._channel, None
        if channel is not None:
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

    async def _usable_channel(self) -> AbstractChannel:
        """The publishing channel, reopened if a refused message closed it."""
        if self._connection is None or self._connection_lost():
            raise BrokerUnavailableError(f"connection to {self.safe_url} is closed")
        if self._channel is None or self._channel.is_closed:
            closed, self._channel = self._channel, None
            if closed is not None:
                await self._quietly(closed.close())
            self._channel = await self._open_channel(self._connection)
        return self._channel

    # ----- publishing -----------------------------------------------------------------------

    async def _send(self, channel: AbstractChannel, publish: _Publish) -> None:
        """One ``basic.publish``; returns once RabbitMQ acked it, raises the driver's error else."""
        underlay = await channel.get_underlay_channel()
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
        async with self._lock:
            return await self._publish_wave_locked(messages)

    async def _publish_wave_locked(self, messages: Sequence[Message]) -> list[BaseException | None]:
        results: list[BaseException | None] = [None] * len(messages)
        prepared: dict[int, _Publish] = {}
        for index, message in enumerate(messages):
            try:
                prepared[index] = self._prepare(message)
            except PublishError as exc:
                results[index] = exc
        loop = asyncio.get_running_loop()
        # Leave the base class's timeout for what is already settled, not for the whole wave.
        deadline = loop.time() + 0.8 * self.publish_timeout
        todo = list(prepared)
        while todo:
            if loop.time() > deadline:
                return self._fail(results, todo, PublishError(
                    "RabbitMQ closed the channel; no time was left to publish the message again"))
            try:
                channel = await self._usable_channel()
            except Exception as exc:  # noqa: BLE001 - reported on each message
                return self._fail(results, todo, exc)
            raw = await asyncio.gather(*(self._send(channel, prepared[i]) for i in todo),
                                       return_exceptions=True)
            in_flight: list[int] = []  # written before the channel closed, in write order
            unsent: list[int] = []  # refused by the client once the channel was closed
            for index, outcome in zip(todo, raw, strict=True):
                if isinstance(outcome, aiormq.exceptions.ChannelClosed):
                    in_flight.append(index)
                elif isinstance(outcome, aiormq.exceptions.ChannelInvalidStateError):
                    unsent.append(index)
                elif isinstance(outcome, BaseException):
                    results[index] = self._translate(outcome)
            if not in_flight and not unsent:
                break
            if not in_flight:  # the channel closed before any of them went out: not their doing
                return self._fail(results, unsent, self._lost(None))
            # One of the in-flight messages closed the channel. Frames written after the close
            # may have made RabbitMQ close the connection too: start over on a fresh one.
            try:
                await self._reconnect()
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
                results[index], closed = await self._publish_alone(prepared[index])
                if closed:
                    later = in_flight[position + 1:]
                    break
            todo = sorted(later + unsent)
        return results

    async def _publish_alone(self, publish: _Publish) -> tuple[BaseException | None, bool]:
        """Publish one message with nothing else in flight: its failure is its own.

        Returns the outcome and whether the message closed the channel.
        """
        try:
            await self._send(await self._usable_channel(), publish)
        except Exception as exc:  # noqa: BLE001 - returned as the message's outcome
            return self._translate(exc, alone=True), isinstance(exc, aiormq.exceptions.ChannelClosed)
        return None, False

    def _fail(self, results: list[BaseException | None], indexes: Sequence[int],
              exc: BaseException) -> list[BaseException | None]:
        error = self._translate(exc)
        for index in indexes:
            results[index] = error
        return results

    def _translate(self, exc: BaseException, *, alone: bool = False) -> BaseException:
        """The driver's error as this library's: retryable or not, connection lost or not."""
        errors = aiormq.exceptions
        frame = exc.message.delivery if isinstance(exc, errors.PublishError) and exc.message else None
        if isinstance(frame, spec.Basic.Return):  # mandatory and no queue took it
            return PublishError(
                f"RabbitMQ returned the message as unroutable ({frame.reply_code} {frame.reply_text}): "
                f"no queue is bound to exchange {frame.exchange!r} for routing key {frame.routing_key!r}")
        if isinstance(exc, errors.DeliveryError):
            return PublishError(f"RabbitMQ did not take the message: {exc}")
        if isinstance(exc, errors.ChannelClosed):
            reason = exc.args[0] if exc.args else type(exc).__name__
            if isinstance(exc, errors.ChannelNotFoundEntity):
                return PublishError(f"RabbitMQ refused the message: {reason} (the exchange may be "
                                    "declared later; retrying)")
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
