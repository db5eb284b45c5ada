"""The Receiver port: the consumer side of a broker. The base class owns the public
behaviour; an adapter fills in ``_connect``, ``_close``, ``_receive`` and ``_ack`` (and, where
its broker needs them, ``_extend`` and ``_release``).

A receiver hands the runner (:mod:`outboxer.consumer`) what arrived as :class:`Incoming`
items, each holding the decoded :class:`Delivery` and the broker's handle to acknowledge it
with. It never acknowledges on its own: the runner acks a message only once the consumer's
transaction that applied it (or recorded it as a dead letter) has committed.

Decoding. Every adapter reads the envelope the matching publisher writes (see
``docs/brokers/*.md``): the message id, outbox topic, key, content type and creation time,
from the broker's native fields where it has them and from the ``outboxer-*`` headers
otherwise. Those envelope headers are taken out of ``Delivery.headers``, which holds the
user's headers only. A message without an id, or whose JSON payload does not parse, is
*malformed*: the runner dead-letters it at once (its error says why) instead of retrying.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, ClassVar, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit

from outboxer.brokers import publisher_options
from outboxer.brokers.base import Publisher, describe, repeated_names
from outboxer.config import int_option
from outboxer.errors import BrokerUnavailableError, ConfigError
from outboxer.message import (
    BINARY,
    HEADER_CONTENT_TYPE,
    HEADER_CREATED_AT,
    HEADER_ID,
    HEADER_KEY,
    HEADER_TOPIC,
    uuid7,
)
from outboxer.redact import get_logger, redact_url

# Redacting: a driver's error text may carry a broker URL with its password, and these
# lines reach the application's handlers when a receiver runs inside its process.
logger = get_logger("outboxer.receiver")

#: Header names of the envelope: not the user's, so not in ``Delivery.headers``.
ENVELOPE_HEADERS = frozenset(
    {HEADER_ID, HEADER_TOPIC, HEADER_KEY, HEADER_CREATED_AT, HEADER_CONTENT_TYPE}
)


@dataclass(frozen=True, slots=True)
class Delivery:
    """One message as a consumer's handler gets it."""

    id: uuid.UUID
    topic: str
    key: str | None
    #: The user's headers (the envelope's own fields are attributes here).
    headers: Mapping[str, str]
    #: Decoded by content type: JSON -> the value, ``text/*`` -> str, anything else -> bytes.
    payload: Any
    #: The payload bytes as they arrived.
    body: bytes
    content_type: str
    created_at: datetime | None = None
    #: 1 on the first attempt in this consumer, 2 after one failure, and so on.
    attempt: int = 1
    #: The delivery as it arrived, when the consumer decrypted it or fetched its claim-checked
    #: payload (else None): what its dead letter stores, so that encryption at rest holds
    #: in the dead-letter table too. A replay decrypts it again.
    received: Delivery | None = field(default=None, repr=False, compare=False)


class MalformedMessage(ValueError):
    """A message the runner cannot apply whatever it tries: it is dead-lettered at once."""


@dataclass(eq=False, slots=True)
class Incoming:
    """One received message: its delivery and the broker's handle to acknowledge it."""

    delivery: Delivery
    #: Whatever the adapter acknowledges with (a delivery tag, a stream entry id …).
    token: Any = None
    #: Why the message cannot be read (then ``delivery`` holds what could be read of it).
    malformed: str | None = None
    #: The receiver's connection it came on: an ack on a later connection would be refused
    #: or, worse, acknowledge another message (AMQP delivery tags restart per channel).
    generation: int = 0
    #: The broker says it delivered this message before (RabbitMQ's redelivered flag, a NATS
    #: JetStream delivery count above 1, a Redis entry read from the pending list or claimed
    #: from another consumer, MQTT's PUBLISH DUP flag; on Kafka, with ``suspect_window``, the
    #: first messages of a partition after each assignment):
    #: an earlier attempt may have killed the consumer, so the runner records its attempt
    #: before its handler runs (a *suspect*; docs/design/consumer.md).
    redelivered: bool = False


def decode_payload(body: bytes, content_type: str) -> Any:
    """The payload as a handler gets it; MalformedMessage for JSON that does not parse."""
    kind = content_type.split(";", 1)[0].strip().lower()
    if kind == "application/json" or kind.endswith("+json"):
        try:
            return json.loads(body)
        except ValueError as exc:
            raise MalformedMessage(
                f"payload is not the JSON its content type says: {exc}"
            ) from None
        except RecursionError:
            # No ValueError: raised out of a receive it reads as a lost connection, and the
            # same message comes first again after every reconnect.
            raise MalformedMessage("payload is JSON nested too deep to decode") from None
    if kind.startswith("text/"):
        try:
            return body.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise MalformedMessage(f"payload is not UTF-8 text: {exc}") from None
    return body


def _created_at(text: str | None) -> datetime | None:
    if not text:
        return None
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        return None  # informative only: never a reason to refuse a message
    # Without an offset (another producer wrote it) it is UTC, as every outboxer time: left
    # naive, drivers stored it as the consumer host's local time (SQLite, asyncpg) or as
    # UTC (MySQL), hours apart, and the handler got a time it could not compare.
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def decode(
    headers: Mapping[str, str],
    body: bytes,
    *,
    message_id: str | None = None,
    topic: str | None = None,
    key: str | None = None,
    content_type: str | None = None,
    fallback_topic: str = "",
) -> Incoming:
    """An Incoming from the envelope fields an adapter read; native fields first, then the
    ``outboxer-*`` headers. Malformed messages come back marked, never raised."""
    raw_id = message_id or headers.get(HEADER_ID)
    kind = content_type or headers.get(HEADER_CONTENT_TYPE) or BINARY
    user_headers = {name: value for name, value in headers.items() if name not in ENVELOPE_HEADERS}
    problem = None
    identifier: uuid.UUID | None = None
    try:
        identifier = uuid.UUID(str(raw_id)) if raw_id else None
        if identifier is None:
            problem = "no message id: not published by outboxer?"
    except ValueError:
        problem = f"message id {str(raw_id)[:60]!r} is not a UUID"
    payload: Any = body
    if problem is None:
        try:
            payload = decode_payload(body, kind)
        except MalformedMessage as exc:
            problem = str(exc)
    delivery = Delivery(
        id=identifier or uuid7(),
        topic=topic or headers.get(HEADER_TOPIC) or fallback_topic,
        key=key if key is not None else headers.get(HEADER_KEY),
        headers=user_headers,
        payload=payload,
        body=body,
        content_type=kind,
        created_at=_created_at(headers.get(HEADER_CREATED_AT)),
    )
    return Incoming(delivery, malformed=problem)


def unreadable(problem: str, body: bytes = b"", *, topic: str = "") -> Incoming:
    """A malformed Incoming for a message an adapter could not even take apart.

    An adapter returns this instead of raising out of ``_receive``: a raise reads as a lost
    connection, and after the reconnect the broker hands over the same message again, so
    one bad message would stop the receiver for good. Marked malformed, it is dead-lettered
    by the runner (under an id of its own: it has no readable one) and acknowledged."""
    delivery = Delivery(
        id=uuid7(),
        topic=topic,
        key=None,
        headers={},
        payload=body,
        body=body,
        content_type=BINARY,
    )
    return Incoming(delivery, malformed=problem)


def split_url(url: str, names: Sequence[str]) -> tuple[str, dict[str, str]]:
    """``url`` without the query options in ``names``, and those options (ConfigError for
    one given twice: the last would win without a word, as the publisher's options would
    not, check_url_options)."""
    parts = urlsplit(url)
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    if twice := repeated_names(name for name, _ in pairs if name in names):
        raise ConfigError(f"URL option(s) {twice} given more than once in {redact_url(url)!r:.200}")
    ours = {name: value for name, value in pairs if name in names}
    rest = [(name, value) for name, value in pairs if name not in names]
    return parts._replace(query=urlencode(rest)).geturl(), ours


T = TypeVar("T")


async def take(
    arrived: asyncio.Queue[T], lost: asyncio.Event, limit: int, timeout: float, what: str
) -> list[T]:
    """Up to ``limit`` items a driver's callback queued, waiting up to ``timeout`` for the
    first; ConnectionError once ``lost`` is set (the items are redelivered after a reconnect)."""
    items: list[T] = []
    if arrived.empty() and not lost.is_set():
        getter = asyncio.ensure_future(arrived.get())
        lost_wait = asyncio.ensure_future(lost.wait())
        try:
            await asyncio.wait(
                (getter, lost_wait), timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            lost_wait.cancel()
            if not getter.done():
                getter.cancel()
        if getter.done() and not getter.cancelled():
            items.append(getter.result())
    if lost.is_set():
        raise ConnectionError(f"the connection to {what} is lost")
    while not arrived.empty() and len(items) < limit:
        items.append(arrived.get_nowait())
    return items


@dataclass
class ReceiverStats:
    received: int = 0
    acked: int = 0
    #: Acks skipped because the message came on an earlier connection (it is redelivered).
    stale_acks: int = 0
    failed_acks: int = 0
    connects: int = 0


@dataclass
class Watermark:
    """Positions acknowledged out of order, and the first one not acknowledged yet.

    For brokers that acknowledge a position, not a message (a Kafka partition's offset, a
    file's line): everything below ``next`` may be acknowledged, whatever order the
    runner's parallel lanes finished in.
    """

    next: int
    done: set[int] = field(default_factory=set)

    def complete(self, position: int) -> bool:
        """Record ``position`` as done; True if ``next`` moved (there is more to commit)."""
        if position < self.next:
            return False
        self.done.add(position)
        moved = False
        while self.next in self.done:
            self.done.discard(self.next)
            self.next += 1
            moved = True
        return moved


class Receiver(ABC):
    """Receives one consumer group's messages from one broker; acks only what it is told."""

    schemes: ClassVar[tuple[str, ...]] = ()
    #: Query options the receiver reads itself (the rest is the publisher's, see ``parse``).
    options: ClassVar[tuple[str, ...]] = ()
    #: The broker's publisher, whose URL parsing and options the receiver shares (``parse``).
    publisher_class: ClassVar[type[Publisher] | None] = None
    #: Topic pattern meaning "everything", when no topics are given; None: topics required.
    all_topics: ClassVar[str | None] = None
    #: Seconds between ``_extend`` calls for messages held (None: the broker needs none).
    extend_interval: float | None = None
    #: The largest prefetch the broker takes (the consumer's default stays within it).
    max_prefetch: ClassVar[int] = 1_000_000

    def __init__(
        self,
        url: str,
        *,
        group: str,
        topics: Sequence[str] | None = None,
        prefetch: int = 100,
        name: str | None = None,
        connect_timeout: float = 30.0,
        publisher_options: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> None:
        if not isinstance(group, str) or not group.strip() or len(group) > 200:
            raise ConfigError("group must be a non-empty name of at most 200 characters")
        self.url = url
        self.group = group
        chosen = [topic for topic in (topics or []) if topic]
        if not chosen:
            if self.all_topics is None:
                raise ConfigError(
                    f"{type(self).__name__} needs the topics to consume (--topic NAME)"
                )
            chosen = [self.all_topics]
        self.topics: list[str] = chosen
        self.prefetch = int_option(prefetch, "prefetch", 1, Receiver.max_prefetch)
        self.name = name
        self.connect_timeout = connect_timeout
        rest, from_url = split_url(url, self.options)
        # As in the URL's query: the publisher's options (an exchange, a stream prefix) given
        # with the receiver's are the publisher's, and win over the destination's.
        known = self._publisher_known()
        theirs = {
            name: value
            for name, value in options.items()
            if name not in self.options and (known is None or name in known)
        }
        options = {name: value for name, value in options.items() if name not in theirs}
        unknown = set(options) - set(self.options)
        if unknown:
            raise ConfigError(
                f"{type(self).__name__}: unknown options {sorted(unknown)}; "
                f"known: {', '.join(self.options) or 'none'}"
                + (f" (and the broker's: {', '.join(sorted(known))})" if known else "")
            )
        #: The receiver's own options: keyword arguments win over the URL's query string.
        self.settings: dict[str, Any] = {**from_url, **options}
        merged = dict(publisher_options or {})
        for name, value in theirs.items():
            # A table in both (Kafka's config): the consumer's entries over the relay's, not
            # in place of them (its credentials and TLS files stay).
            base = merged.get(name)
            if isinstance(base, Mapping) and isinstance(value, Mapping):
                value = {**base, **value}
            merged[name] = value
        self.publisher = self.parse(rest, **self._publisher_side(rest, merged))
        self.stats = ReceiverStats()
        self._connected = False
        self._generation = 0

    # ----- primitives for adapters ---------------------------------------------------------

    def parse(self, url: str, **options: Any) -> Publisher | None:
        """The matching publisher, for its URL parsing and options (never connected)."""
        return None if self.publisher_class is None else self.publisher_class(url, **options)

    def _publisher_known(self) -> frozenset[str] | None:
        """The options the publisher takes (None: any)."""
        cls = self.publisher_class
        return frozenset() if cls is None else publisher_options(cls)

    def _publisher_side(self, url: str, options: Mapping[str, Any]) -> dict[str, Any]:
        """``publisher_options`` checked: a destination's options in a settings file shared
        with the relay (an exchange, a stream prefix, Kafka's config) name where the relay
        publishes, so the receiver reads them as the relay does. A name neither side knows
        is refused here rather than as the publisher's TypeError."""
        known = self._publisher_known()
        if known is not None and (unknown := sorted(set(options) - known)):
            ours = sorted(set(unknown) & set(self.options))
            hint = (
                f"; {', '.join(ours)}: the consumer's own, given in [consumer] options or --option"
                if ours
                else ""
            )
            raise ConfigError(
                f"{type(self).__name__}: unknown publisher option(s) {unknown} for the broker "
                f"{redact_url(url)!r}; known: {', '.join(sorted(known)) or 'none'}{hint}"
            )
        return dict(options)

    @abstractmethod
    async def _connect(self) -> None:
        """Open connections and subscribe; raise if the broker is unreachable."""

    @abstractmethod
    async def _close(self) -> None:
        """Release connections (unacknowledged messages go back to the broker); never raise
        for a connection that is already broken."""

    @abstractmethod
    async def _receive(self, limit: int, timeout: float) -> list[Incoming]:
        """Up to ``limit`` messages, waiting at most ``timeout`` seconds for the first one."""

    @abstractmethod
    async def _ack(self, incomings: Sequence[Incoming]) -> None:
        """Acknowledge messages of the current connection: the broker never sends them again."""

    async def _extend(self, incomings: Sequence[Incoming]) -> None:
        """Tell the broker these messages are still being worked on (not redeliver them yet)."""
        return None

    async def _release(self, incomings: Sequence[Incoming]) -> None:
        """Hand back messages that will not be applied here (shutdown), for prompt redelivery."""
        return None

    async def lag(self, timeout: float = 5.0) -> int | None:
        """Messages the broker holds for this consumer group that no consumer of it has been
        handed yet; None when the broker does not tell (or the receiver is not connected).

        For metrics, called every few seconds beside ``receive`` and ``ack``: it never raises
        for a broker that does not answer, but gives None after ``timeout`` seconds at most
        (and logs at DEBUG only). What it counts differs by broker, and so does how a group's
        members' figures add up: on Kafka each member reports its own partitions (high
        watermark less its position), so a group's lag is the *sum* over its members; the
        others (RabbitMQ's ready count, JetStream's ``num_pending``, Redis's group ``lag``)
        report the whole group's backlog, the same from every member: take the *max* by
        group. MQTT gives no queue depth (None)."""
        return None

    def idle(self) -> bool:
        """Whether an empty receive means the broker has nothing more for now (``exit_when_idle``);
        False while the receiver is still getting ready (joining a group, waiting)."""
        return True

    # ----- public behaviour -----------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self._connected

    @property
    def safe_url(self) -> str:
        if self.publisher is not None:
            return self.publisher.safe_url
        parts = urlsplit(self.url)
        return parts._replace(netloc=parts.netloc.rpartition("@")[2], query="").geturl()

    async def connect(self) -> None:
        if self._connected:
            return
        try:
            await asyncio.wait_for(self._connect(), self.connect_timeout)
        except ConfigError:
            await self._close_quietly()  # a refused setting: nothing half-open stays behind
            raise
        except Exception as exc:
            await self._close_quietly()
            raise BrokerUnavailableError(
                f"cannot consume from {self.safe_url}: {describe(exc)}"
            ) from exc
        self._generation += 1
        self._connected = True
        self.stats.connects += 1

    async def close(self) -> None:
        self._connected = False
        await self._close()

    async def _close_quietly(self) -> None:
        try:
            await self._close()
        except Exception as exc:  # noqa: BLE001 -- closing what failed to open: log, go on
            logger.debug("closing %s after a failed connect: %s", self.safe_url, describe(exc))

    async def receive(self, limit: int, timeout: float) -> list[Incoming]:
        """Up to ``limit`` messages (none if ``timeout`` passes); BrokerUnavailableError if the
        connection is gone (connect again, then go on)."""
        if not self._connected:
            raise BrokerUnavailableError(f"not connected to {self.safe_url}")
        try:
            received = await self._receive(limit, timeout)
        except Exception as exc:
            self._connected = False
            await self._close_quietly()
            raise BrokerUnavailableError(
                f"lost the connection to {self.safe_url}: {describe(exc)}"
            ) from exc
        for incoming in received:
            incoming.generation = self._generation
        self.stats.received += len(received)
        return received

    def _current(self, incomings: Sequence[Incoming]) -> list[Incoming]:
        current = [i for i in incomings if i.generation == self._generation and self._connected]
        self.stats.stale_acks += len(incomings) - len(current)
        return current

    async def ack(self, incomings: Sequence[Incoming]) -> None:
        """Acknowledge committed messages. A failed ack is logged, not raised: the broker
        delivers the message again and the inbox recognises it as a duplicate."""
        current = self._current(incomings)
        if not current:
            return
        try:
            await self._ack(current)
        except Exception as exc:  # noqa: BLE001 -- redelivered, then skipped as a duplicate
            self.stats.failed_acks += len(current)
            logger.warning(
                "%s: could not ack %d message(s), the broker will deliver them again "
                "(skipped then as duplicates): %s",
                self.safe_url,
                len(current),
                describe(exc),
            )
            return
        self.stats.acked += len(current)

    async def extend(self, incomings: Sequence[Incoming]) -> None:
        current = self._current(incomings)
        if current:
            try:
                await self._extend(current)
            except Exception as exc:  # noqa: BLE001 -- at worst a redelivery, a duplicate then
                logger.warning("%s: could not extend message leases: %s", self.safe_url, exc)

    async def release(self, incomings: Sequence[Incoming]) -> None:
        current = self._current(incomings)
        if current:
            try:
                await self._release(current)
            except Exception as exc:  # noqa: BLE001 -- they are redelivered later instead
                logger.info("%s: could not hand messages back: %s", self.safe_url, exc)


__all__ = [
    "ENVELOPE_HEADERS",
    "Delivery",
    "Incoming",
    "MalformedMessage",
    "Receiver",
    "ReceiverStats",
    "Watermark",
    "decode",
    "decode_payload",
    "split_url",
    "take",
    "unreadable",
]
