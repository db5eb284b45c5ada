"""The Publisher port: the base class owns the public behaviour, adapters fill in primitives.

An adapter implements ``_connect``, ``_close`` and either ``_publish_one``
(awaits the broker's confirmation of one message) or ``_publish_wave`` (a
whole wave at once, for brokers that pipeline); brokers that ack each publish
on its own subclass ``AckedPublisher``, which owns that wave and asks only for
sending one message and reading its ack. Everything else lives here:
per-key ordering, timeouts, error classification, connection state and counters.

Ordering. A batch is cut into *waves*: wave ``n`` holds the ``n``-th message of
every key plus, in wave 0, every keyless message. The messages of one wave are
independent, so they are all in flight at once; wave ``n + 1`` starts only
after wave ``n`` is confirmed. If a key's message fails, the key's later
messages in the batch are *skipped* (not attempted), so a retry can never be
overtaken by its successor.
"""

from __future__ import annotations

import asyncio
import difflib
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar, Generic, TypeVar
from urllib.parse import parse_qsl, urlsplit

from outboxer.brokers import resolve
from outboxer.errors import BrokerUnavailableError, ConfigError, PublishError
from outboxer.message import Message
from outboxer.options import parse_bool
from outboxer.redact import get_logger, redact_url, register_url_secrets

logger = get_logger("outboxer.publisher")
#: What a broker answers each publish with (see AckedPublisher).
AckT = TypeVar("AckT")


class OutcomeKind(StrEnum):
    PUBLISHED = "published"
    FAILED = "failed"
    SKIPPED = "skipped"  # not attempted: an earlier message of its key failed


@dataclass(frozen=True, slots=True)
class Outcome:
    """What became of one message of a batch."""

    kind: OutcomeKind
    error: str | None = None
    #: For FAILED: whether trying again later may succeed.
    retryable: bool = True
    #: For FAILED: the least wait before the next attempt that the broker asked for, if any.
    retry_after: float | None = None
    #: For FAILED: False when the message never reached the broker (the publisher was not
    #: connected): the relay gives it back with no attempt counted, as it does SKIPPED.
    attempted: bool = True

    @property
    def published(self) -> bool:
        return self.kind is OutcomeKind.PUBLISHED


PUBLISHED = Outcome(OutcomeKind.PUBLISHED)
SKIPPED = Outcome(OutcomeKind.SKIPPED, "not attempted: an earlier message of the same key failed")


@dataclass
class PublisherStats:
    published: int = 0
    failed: int = 0
    skipped: int = 0
    batches: int = 0
    publish_seconds: float = 0.0
    connects: int = 0
    errors_by_type: dict[str, int] = field(default_factory=dict)


def waves(messages: Sequence[Message]) -> list[list[int]]:
    """Indexes of ``messages`` cut into waves (see the module docstring)."""
    result: list[list[int]] = [[]]
    depth: dict[str, int] = {}
    for index, message in enumerate(messages):
        if message.key is None:
            result[0].append(index)
            continue
        level = depth.get(message.key, 0)
        depth[message.key] = level + 1
        if level == len(result):
            result.append([])
        result[level].append(index)
    return result


def option_bool(options: Mapping[str, str], name: str, given: bool | None, default: bool) -> bool:
    """A true/false adapter option: the keyword argument wins, then the URL query, then the default."""
    if given is not None:
        return given
    text = options.get(name, "")
    return parse_bool(text, name) if text.strip() else default


def parse_options(url: str) -> tuple[Any, dict[str, str]]:
    """Split a broker URL into its parts and its query-string options."""
    parts = urlsplit(url)
    return parts, dict(parse_qsl(parts.query, keep_blank_values=True))


#: Names an error message lists at most (a URL of thousands of bad options gave a message
#: of as many names: 71 kB for 8,000).
SHOWN_NAMES = 10


def _listed(texts: Sequence[str], total: int) -> str:
    """The first of ``total`` names (``texts``, at most SHOWN_NAMES), and how many more."""
    more = total - len(texts)
    return ", ".join(texts) + (f" and {more} more" if more > 0 else "")


def unknown_names(unknown: Iterable[str], known: Collection[str]) -> str:
    """``unknown`` for a message, each with the known name it is closest to, if any."""
    names = sorted(set(unknown))
    shown = []
    for name in names[:SHOWN_NAMES]:
        text = repr(name[:60])
        if close := difflib.get_close_matches(name, known, n=1):
            text += f" (did you mean {close[0]}?)"
        shown.append(text)
    return _listed(shown, len(names))


def repeated_names(names: Iterable[str]) -> str:
    """The names that ``names`` holds more than once, for a message ("" if none): counted in
    one pass, where a ``list.count`` per name took 0.5 s for 8,000 names (quadratic)."""
    twice = sorted(name for name, count in Counter(names).items() if count > 1)
    return _listed([repr(name[:60]) for name in twice[:SHOWN_NAMES]], len(twice))


def check_url_repeats(url: str, broker: str) -> None:
    """ConfigError for a query option given twice in ``url``: one of its values would be
    dropped without a word (dict(): the last; redis-py's own parsing: the first)."""
    names = [name for name, _ in parse_qsl(urlsplit(url).query, keep_blank_values=True)]
    if twice := repeated_names(names):
        raise ConfigError(
            f"{broker}: URL option(s) {twice} given more than once in {redact_url(url)!r:.200}"
        )


def check_url_options(url: str, known: frozenset[str], broker: str) -> None:
    """ConfigError for a query option of ``url`` not in ``known``, or one given twice.

    A typo (``subjet_prefix=orders.``) was dropped without a word, and the relay published
    to the subject the default prefix makes, where no consumer listens; a name given twice
    kept its last value, silently too."""
    names = [name for name, _ in parse_qsl(urlsplit(url).query, keep_blank_values=True)]
    if unknown := set(names) - known:
        raise ConfigError(
            f"{broker}: unknown URL option(s) {unknown_names(unknown, known)} in "
            f"{redact_url(url)!r:.200}; known: {', '.join(sorted(known))}"
        )
    check_url_repeats(url, broker)


class Publisher(ABC):
    """Publishes outbox messages to one broker; a message counts only once confirmed."""

    #: URL schemes this adapter serves, e.g. ("amqp", "amqps").
    schemes: ClassVar[tuple[str, ...]] = ()
    #: Every query option the adapter's URL may carry: its own, its driver's, and its
    #: receiver's (one URL serves the relay and the consumers); any other is refused at
    #: start (check_url_options). None: the rest goes to a driver that refuses unknown
    #: names itself (librdkafka, redis-py) or to the endpoint (webhooks).
    url_options: ClassVar[frozenset[str] | None] = None

    def __init__(
        self,
        url: str,
        *,
        routes: Mapping[str, str] | None = None,
        publish_timeout: float = 30.0,
    ) -> None:
        if publish_timeout <= 0:
            raise ConfigError("publish_timeout must be positive")
        self.url = url
        register_url_secrets(url)  # masked in every outboxer log line from now on
        if self.url_options is not None:
            check_url_options(url, self.url_options, f"{urlsplit(url).scheme.lower()}:// broker")
        #: Outbox topic -> broker destination (exchange routing key, stream, subject…).
        self.routes: dict[str, str] = dict(routes or {})
        self.publish_timeout = publish_timeout
        self.stats = PublisherStats()
        self._connected = False
        # The relay's loops share one publisher: only one of them (re)connects at a time.
        self._connect_lock = asyncio.Lock()

    # ----- primitives for adapters ---------------------------------------------------------

    @abstractmethod
    async def _connect(self) -> None:
        """Open connections; raise if the broker is unreachable."""

    @abstractmethod
    async def _close(self) -> None:
        """Release connections; must not raise for an already broken connection."""

    async def _publish_one(self, message: Message) -> None:
        """Publish one message and return once the broker confirmed it, else raise."""
        raise NotImplementedError(
            f"{type(self).__name__} implements neither _publish_one nor _publish_wave"
        )

    async def _publish_wave(self, messages: Sequence[Message]) -> list[BaseException | None]:
        """Publish independent messages together; one result per message (None = confirmed).

        The wave ends at ``_wave_deadline``, before the base class's ``publish_timeout``:
        that one fails the whole wave, the messages already confirmed included (counted an
        attempt and published again). A message unanswered by then times out on its own.
        """
        tasks = [asyncio.ensure_future(self._publish_one(message)) for message in messages]
        try:
            await asyncio.wait(tasks, timeout=self._wave_remaining(self._wave_deadline()))
        finally:
            for task in tasks:
                task.cancel()  # no-op for the finished ones
            # Cancelled ones release what they hold (a connection) before the wave ends.
            await asyncio.wait(tasks)
        return [self._wave_timed_out() if task.cancelled() else task.exception() for task in tasks]

    def _wave_deadline(self) -> float:
        """The loop time a wave stops waiting for confirmations: a little before
        ``publish_timeout``, so the outcomes known by then are kept (see _publish_wave)."""
        return asyncio.get_running_loop().time() + self.publish_timeout - self._wave_margin()

    def _wave_margin(self) -> float:
        """Seconds between a wave's deadline and the backstop: what an adapter has left for
        its work after the confirmations (NATS's duplicate checks) before all is lost."""
        return min(1.0, self.publish_timeout / 10)

    @staticmethod
    def _wave_remaining(deadline: float) -> float:
        return max(0.0, deadline - asyncio.get_running_loop().time())

    def _wave_timed_out(self) -> TimeoutError:
        """A message of a wave that the broker did not answer in time: retryable, and a
        connection error (the relay checks the connection before going on)."""
        return TimeoutError(f"broker did not confirm within {self.publish_timeout}s")

    def is_connection_error(self, exc: BaseException) -> bool:
        """Whether ``exc`` means the connection is gone (the relay reconnects before going on)."""
        return isinstance(
            exc, BrokerUnavailableError | ConnectionError | OSError | asyncio.TimeoutError
        )

    def is_retryable(self, exc: BaseException) -> bool:
        """Whether publishing the same message again later may succeed."""
        if isinstance(exc, PublishError):
            return exc.retryable
        return True  # unknown failures are retried; max_attempts bounds them

    # ----- public behaviour ---------------------------------------------------------------

    def destination_for(self, message: Message) -> str:
        """The broker-side name for a message's topic (the topic itself unless routed)."""
        return self.routes.get(message.topic, message.topic)

    def _transport_lost(self) -> bool:
        """Whether the adapter knows, without I/O, that its connection is gone (the broker
        closed it, its reader saw the end); False where it cannot tell. ``_connect`` then
        replaces it: it must close what is left of the old connection first."""
        return False

    @property
    def connected(self) -> bool:
        # Not only until a publish fails: a broker that dropped the connection while the
        # relay idled makes the relay reconnect (backing off, /health saying so) before its
        # next claim, rather than claim rows and fail them on a dead connection.
        return self._connected and not self._transport_lost()

    @property
    def blocked(self) -> str | None:
        """Why the broker holds this publisher's messages back on a connection that is up
        (RabbitMQ's ``connection.blocked``: a resource alarm), or None. Its waves come back
        unsent meanwhile, so /health names it rather than say "ok"."""
        return None

    def problem(self) -> str | None:
        """What /health says of this publisher when it cannot publish now, or None."""
        if not self.connected:
            return "not connected"
        return self.blocked

    async def connect(self) -> bool:
        """Connect unless connected; return whether this call made the connection (the
        loops sharing a publisher wait here for the one that connects)."""
        async with self._connect_lock:
            if self.connected:
                return False
            self._connected = False  # the transport is gone: a publish must not use it
            # The broker's name is looked up on threads of its own, not on the default
            # executor, which a DNS outage's lookups filled (resolve).
            resolve.install(asyncio.get_running_loop(), self.host_names())
            try:
                # A broker that accepts the TCP connection but never answers must not hang the relay.
                await asyncio.wait_for(self._connect(), self.publish_timeout)
            except PublishError:
                raise
            except Exception as exc:
                raise BrokerUnavailableError(
                    f"cannot connect to {self.safe_url}: {describe(exc)}"
                ) from exc
            self._connected = True
            self.stats.connects += 1
            return True

    def host_names(self) -> list[str]:
        """The host names this publisher's connections look up (its URL's)."""
        return resolve.hosts_of(self.url)

    async def close(self) -> None:
        self._connected = False
        await self._close()

    async def __aenter__(self) -> Publisher:
        await self.connect()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    @property
    def safe_url(self) -> str:
        """The URL without its password, token or secret query values, for logs and errors."""
        return redact_url(self.url)

    async def publish_batch(
        self, messages: Sequence[Message], known: list[Outcome | None] | None = None
    ) -> list[Outcome]:
        """Publish a batch; one Outcome per message, in the same order.

        Never raises for a broker failure: every failure is an Outcome, so the
        relay can record it on the message.

        ``known`` (one None per message) gets each message's outcome once its wave has
        ended: a caller whose publish is cancelled mid-batch (a forced shutdown, a lost
        lease) reads there what the broker answered for the waves before the one in flight;
        the messages still None there have an unknown fate.
        """
        if known is not None and len(known) != len(messages):
            raise ValueError(f"known holds {len(known)} entries for {len(messages)} messages")
        outcomes: list[Outcome | None] = known if known is not None else [None] * len(messages)
        failed_keys: set[str] = set()
        started = time.perf_counter()
        for wave in waves(messages):
            if not self.connected:
                # The connection broke (in this batch, in another loop's batch, or while
                # idle, as the adapter saw): the rest of this batch is not sent. Failed but
                # not attempted: the relay gives these rows back with no attempt counted,
                # and reconnects before its next claim (a flapping broker must not use up
                # attempts of messages it never got).
                not_sent = self._not_connected()
                for index, outcome in enumerate(outcomes):
                    if outcome is None:
                        outcomes[index] = not_sent
                break
            todo: list[int] = []
            for index in wave:
                key = messages[index].key
                if key is not None and key in failed_keys:
                    outcomes[index] = SKIPPED
                else:
                    todo.append(index)
            if not todo:
                continue
            results = await self._publish_wave_with_timeout([messages[i] for i in todo])
            for index, error in zip(todo, results, strict=True):
                if error is None:
                    outcomes[index] = PUBLISHED
                    continue
                attempted = not isinstance(error, NotSent)
                if isinstance(error, NotSent):
                    error = error.cause
                key = messages[index].key
                if key is not None:
                    failed_keys.add(key)
                self.stats.errors_by_type[type(error).__name__] = (
                    self.stats.errors_by_type.get(type(error).__name__, 0) + 1
                )
                if self.is_connection_error(error):
                    self._connected = False
                outcomes[index] = Outcome(
                    OutcomeKind.FAILED,
                    describe(error),
                    self.is_retryable(error),
                    error.retry_after if isinstance(error, PublishError) else None,
                    attempted=attempted,
                )
        final = [outcome or SKIPPED for outcome in outcomes]
        self.stats.batches += 1
        self.stats.publish_seconds += time.perf_counter() - started
        for outcome in final:
            if outcome.kind is OutcomeKind.PUBLISHED:
                self.stats.published += 1
            elif outcome.kind is OutcomeKind.FAILED:
                self.stats.failed += 1
            else:
                self.stats.skipped += 1
        return final

    def _lost_reason(self) -> str:
        """Why the broker closed the connection, when it said (": ..."), else ""."""
        return ""

    def _not_connected(self) -> Outcome:
        """The outcome of a message not sent because the publisher is not connected."""
        return Outcome(
            OutcomeKind.FAILED,
            f"not connected to {self.safe_url}{self._lost_reason()}",
            retryable=True,
            attempted=False,
        )

    async def _publish_wave_with_timeout(
        self, messages: Sequence[Message]
    ) -> list[BaseException | None]:
        try:
            # A timeout, not wait_for: on Python 3.11 wait_for runs the wave in a task of
            # its own, a task and two event-loop turns more for every wave.
            async with asyncio.timeout(self.publish_timeout):
                results = await self._publish_wave(messages)
        except TimeoutError:
            # A backstop: adapters end their waves at _wave_deadline with each message's own
            # outcome; this one loses the outcomes already known.
            return [self._wave_timed_out()] * len(messages)
        except Exception as exc:  # noqa: BLE001 -- an adapter bug or a dropped connection: fail the wave, keep the relay
            logger.warning("publish wave failed: %s", describe(exc))
            return [exc] * len(messages)
        if len(results) != len(messages):
            raise RuntimeError(
                f"{type(self).__name__}._publish_wave returned {len(results)} results for {len(messages)} messages"
            )
        return results


class NotSent(Exception):
    """Wraps the error of a message a wave never sent (the connection was not open, or broke
    before its turn): the relay gives it back with no attempt counted."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause

    def __str__(self) -> str:
        return str(self.cause)


class AckedPublisher(Publisher, Generic[AckT]):
    """A publisher for brokers that answer each publish with an ack of its own (NATS
    JetStream's PubAck, MQTT's PUBACK): a wave's messages are all sent, then their acks
    are awaited together, until they are all in or the connection is lost.

    An adapter fills in ``_connection_lost_event``, ``_send``, ``_ack_error`` and
    ``_connection_error``.
    """

    @abstractmethod
    def _connection_lost_event(self) -> asyncio.Event | None:
        """The event set once the current connection is lost; None if not connected."""

    @abstractmethod
    async def _send(self, message: Message) -> asyncio.Future[AckT]:
        """Send one message; the future gets its ack. Raise for a message that was not sent:
        the wave goes on after a failure of the message's own, and stops after one that
        ``is_connection_error`` calls a connection failure."""

    @abstractmethod
    def _ack_error(self, message: Message, ack: AckT) -> BaseException | None:
        """None if ``ack`` confirms ``message``, else the error it means."""

    @abstractmethod
    def _connection_error(self, detail: str) -> BaseException:
        """The error for a message the connection failed; ``detail`` completes "the
        connection …": "is not open", "was lost before publishing" or "… before the ack"."""

    async def _publish_wave(self, messages: Sequence[Message]) -> list[BaseException | None]:
        lost = self._connection_lost_event()
        if lost is None or lost.is_set():
            return [NotSent(self._connection_error("is not open"))] * len(messages)
        deadline = self._wave_deadline()
        results: list[BaseException | None] = [None] * len(messages)
        pending: dict[int, asyncio.Future[AckT]] = {}
        try:
            for index, message in enumerate(messages):
                try:
                    pending[index] = await self._send(message)
                except Exception as exc:  # noqa: BLE001 - the message's outcome
                    results[index] = exc
                    if self.is_connection_error(exc):
                        break
            if pending:
                acks = asyncio.gather(*pending.values(), return_exceptions=True)
                watcher = asyncio.ensure_future(lost.wait())
                try:
                    # Until the deadline at most: the acks already in are kept (see
                    # Publisher._publish_wave), the missing ones time out on their own.
                    await asyncio.wait(
                        (acks, watcher),
                        timeout=self._wave_remaining(deadline),
                        return_when=asyncio.FIRST_COMPLETED,
                    )
                finally:
                    watcher.cancel()
        finally:
            for future in pending.values():
                future.cancel()  # no-op for the acknowledged ones; a late ack is dropped
        for index, message in enumerate(messages):
            if index not in pending:
                if results[index] is None:  # not sent: the connection broke before its turn
                    results[index] = NotSent(self._connection_error("was lost before publishing"))
            elif (ack := pending[index]).cancelled():
                results[index] = (
                    self._connection_error("was lost before the ack")
                    if lost.is_set()
                    else self._wave_timed_out()
                )
            else:
                results[index] = self._ack_error(message, ack.result())
        return results


def describe(exc: BaseException) -> str:
    """``Type: message`` (bounded), as recorded in last_error."""
    text = str(exc) or repr(exc)
    return f"{type(exc).__name__}: {text}"[:2000]
