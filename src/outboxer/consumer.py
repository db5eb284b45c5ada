"""The consumer runner: receive -> one transaction (inbox claim + handler) -> commit -> ack.

``Consumer(db=URL, broker=URL, group=NAME, handler=fn)`` applies each message a broker
delivers to the consumer's database once in effect: the handler's writes and the inbox
record of the message id commit together, and the broker hears of the message (ack) only
after that commit. A redelivery finds the inbox record and is acked without calling the
handler; a crash before the commit leaves nothing behind and the broker delivers again.

DESIGN

Lanes. Each key has a lane: its messages in delivery order, applied one at a time (a
keyless message is a lane of its own). Lanes whose head may be applied wait in the ready
queue; ``concurrency`` workers, each with a connection of its own, take up to ``batch``
ready lanes and apply their heads in one transaction (``consumer_db``). So one key's
messages are applied in the order the broker delivered them and different keys in
parallel; at most ``prefetch`` messages are held at a time (the broker's flow control
where it has one: RabbitMQ's prefetch, MQTT's Receive Maximum).

Failures. A handler's exception rolls the batch back; the others are applied again at once
(no attempt counted), the culprit waits ``backoff.delay(n)`` after its ``n``-th failure
(the relay's Backoff), its lane holding back the later messages of its key meanwhile. After
``max_attempts`` failures it is written to the dead-letter table and acked. The messages of
its key that follow are applied as usual, or, with ``abandoned_blocks_key``, recorded as
dead letters too, *held* behind it, until ``outboxer dead-letters replay`` applies them in
order. A message that cannot be read (no outboxer id, a JSON payload that does not parse)
is dead-lettered at once. A message the broker says it delivered before
(``Incoming.redelivered``) may have killed the process last time, which no in-process count
survives: such a *suspect* is applied alone, its attempt recorded in the database before
its handler runs (``Session.suspect_attempt``), and once ``max_attempts`` recorded attempts
never ended it is dead-lettered without calling the handler. Database outages are not
the message's fault: the worker opens a new connection with the relay's outage backoff
and applies the batch again, no attempt counted; lost again, it applies each message alone, and one that goes on losing the
connection waits the outage backoff between tries (no hot loop, no other key held back).
An outage is a connection that is gone (its driver says so, or the rollback fails), or a
round trip of the runner's own, a COMMIT included, that got no answer within
``statement_timeout`` (``consumer_db`` cuts the connection off; a batch whose COMMIT was cut
off is not acked: if it did commit, the inbox makes the next attempt a duplicate):
whatever the handler raised while the connection is fine (an OSError of its own included) is
its failure. So is a failure of the consumer's own statements for a message applied alone
(the inbox claim, the dead-letter check, the held record), which retrying at once would
repeat for ever; but not a lock wait that ran out in them (another consumer of the group
holds the message: ``Session.lock_waited``), tried again after the outage backoff with no
attempt counted, its claim then a duplicate once the holder commits. Nor a database whose
disk is full (``Session.database_full``: PostgreSQL's disk_full, SQLITE_FULL, MySQL's disk
or table full), whichever statement met it, a handler's write on it included: the batch
rolled back, not acked, each head tried again after the outage backoff, no attempt counted. A handler that returns
a coroutine without being a coroutine function (a plain decorator around one) fails the same
way: nothing awaited it, nothing is applied.

Hung handlers. With ``handler_timeout``, an attempt whose handler has not returned in time
fails (HandlerTimeout) like any other: an async handler is cancelled; a sync handler's
thread cannot be, so its session is abandoned (never commits, closed once the call ends),
its transaction ended from a fresh session (``Session.end_abandoned``: its locks go) that
the worker goes on with, the pool given a thread in its place. An async handler that has
not ended ``TIMEOUT_GRACE`` after its cancellation (it caught the CancelledError and went
on) is abandoned the same way: its batch runs in a task of its own (only with
handler_timeout: one task per batch), left running on the abandoned session. More than
``concurrency`` such handlers at once stop the consumer (ConsumerShutdownError, ``hung``)
for a supervisor to restart it, that attempt not charged (a suspect's row stays: one
death). An abandoned async handler still running when the consumer stops has its
connection closed and makes ``run_async`` raise ConsumerShutdownError (``hung``): asyncio's
own end would wait for its task for ever.

Shutdown (SIGTERM, ``stop()``): stop fetching; batches in flight commit and are acked
(given ``shutdown_timeout``, or until a second SIGTERM/SIGINT, ``signalled()``), their
leases extended meanwhile; messages
held but not started, or waiting for a retry, are handed back unacknowledged. Batches still
running then are cancelled: never acked, rolled back, delivered again. An async handler's
cancellation ends it; a sync handler's thread cannot be interrupted, nor an async handler
that ignores its cancellation: given ``CANCELLED_WAIT`` to end, such a batch is abandoned
(its session is left open, not closed under the handler, refuses to commit if the handler
ever returns, and is closed once that call ends). Either way ``run_async`` names the
messages whose handlers had not returned in an ERROR line and raises ConsumerShutdownError (``hung`` if any still runs:
``outboxer consume`` then exits 1 at once, its connections closing with the process, so
what the handler wrote is rolled back by the database). Sync sessions run in daemon threads
(``DaemonThreadPool``): a program that calls ``run()`` as a library can exit once it
returned, the hung thread ending with the process (its transaction rolled back as well). After
a second signal the broker's close gets ``CANCELLED_WAIT``, then is cancelled.
A suspect whose attempt the shutdown cut short (its handler cancelled or abandoned, or its
retry after a lost connection or a lock wait never came) did not kill the process: before
its message is handed back, its suspect row is deleted on a connection of its own (given
``SUSPECT_FORGET_WAIT``; left behind, it counts one death too many).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import dataclasses
import importlib
import inspect
import logging
import math
import signal
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from outboxer.brokers.base import describe
from outboxer.consumer_db import (
    STATEMENT_TIMEOUT,
    BatchFailed,
    DaemonThreadPool,
    DeadLetter,
    HandlerEndedTransaction,
    HandlerReturnedAwaitable,
    NoAnswerError,
    Result,
    Session,
    call_sync_handler,
    is_async_handler,
    session_factory,
)
from outboxer.errors import (
    BrokerUnavailableError,
    ConfigError,
    ConsumerShutdownError,
    InsecureConnectionError,
    PayloadError,
    SchemaError,
)
from outboxer.metrics import LATENCY_BUCKETS
from outboxer.receivers import create_receiver, receiver_class
from outboxer.receivers.base import Delivery, Incoming, MalformedMessage, Receiver, decode_payload
from outboxer.redact import shown_value
from outboxer.relay import OUTAGE_BACKOFF
from outboxer.retry import Backoff
from outboxer.stores import create_store

if TYPE_CHECKING:
    from outboxer.claimcheck import ObjectStore
    from outboxer.crypto import KeyRing

logger = logging.getLogger("outboxer.consumer")

Handler = Callable[[Delivery, Any], Any]
#: Makes a worker's session; sync sessions run in the thread pool given.
SessionFactory = Callable[[ThreadPoolExecutor], Session]

#: Seconds a fetch waits for the broker before looking at the stop flag again.
FETCH_WAIT = 0.5
#: Seconds a broker connection must have lasted for its loss to count as the first in a row
#: (reconnected at once); losses sooner after the connect back off (``_fetch``).
STABLE_CONNECTION = 10.0
#: Seconds batches cancelled at shutdown get to roll back before they are abandoned (a sync
#: handler's thread, an async handler that ignores its cancellation).
CANCELLED_WAIT = 1.0
#: Seconds an async handler cancelled at ``handler_timeout`` gets to end (its cancellation
#: runs its ``finally`` and ``except`` blocks) before it is abandoned, as a sync one is at
#: once: one that catches its cancellation and goes on must not hold its worker for ever.
TIMEOUT_GRACE = 1.0
#: Seconds a shutdown gives deleting the suspect rows of the attempts it cut short (a
#: connection of its own, a DELETE each): a database that is gone or slow must not hold the
#: process's exit; past it the rows stay, each counting one death too many at the next
#: delivery of its message.
SUSPECT_FORGET_WAIT = 2.0
#: Seconds between two readings of the group's backlog at the broker (``Receiver.lag``,
#: ``outboxer_consumer_lag_messages``): one cheap broker request each.
LAG_INTERVAL = 5.0
#: Dead letters a replay reads at a time: a group of millions is walked, not loaded.
REPLAY_PAGE_SIZE = 1000


@dataclass
class ConsumerStats:
    """Counters of one consumer group in this process."""

    received: int = 0
    applied: int = 0
    #: Acked without calling the handler: the inbox had the message (a redelivery).
    duplicates: int = 0
    #: Handler attempts that raised (each is rolled back).
    failed: int = 0
    #: Messages written to the dead-letter table (held back ones included), then acked.
    dead_lettered: int = 0
    #: Dead-lettered without an attempt, behind a dead letter of their key.
    held: int = 0
    #: Dead-lettered at once because they could not be read.
    malformed: int = 0
    transactions: int = 0
    handler_seconds: float = 0.0
    database_errors: int = 0
    #: Database errors that were the database's disk being full (also in database_errors):
    #: no attempt counted, the messages retried after the outage backoff.
    database_full: int = 0
    broker_errors: int = 0
    #: Claim-checked payloads the object store did not return within object_store_timeout
    #: (each also a failed attempt: retried after its backoff, then dead-lettered).
    claim_check_timeouts: int = 0
    #: Claim-checked payloads whose object the store did not have (each a failed attempt).
    claim_check_missing: int = 0
    #: Claim-check holds (Consumer.hold) the object store refused or did not put within
    #: object_store_timeout: the dead letter that needed one waits (not written, not acked).
    claim_check_hold_errors: int = 0
    #: Attempts at a redelivered message (a suspect) recorded in inbox_suspects before its
    #: handler ran: each a message the broker says it delivered before.
    suspect_attempts: int = 0
    #: Messages dead-lettered because the consumer died max_attempts times applying them
    #: (recorded suspect attempts that never ended; also counted in dead_lettered).
    suspects_dead_lettered: int = 0
    #: Handler attempts that had not returned within handler_timeout (each also a failed
    #: attempt: rolled back, retried after its backoff, then dead-lettered).
    handler_timeouts: int = 0
    started_at: float = field(default_factory=time.time)

    def as_dict(self) -> dict[str, float | int]:
        return dict(self.__dict__)


@dataclass
class LatencyHistogram:
    """Bucket counts of seconds observed (one group's delivery latency), read by
    ConsumerCollector as a Prometheus histogram: the consumer counts, the scrape renders."""

    bounds: tuple[float, ...] = LATENCY_BUCKETS
    #: Observations per bucket (not cumulative), the last one past every bound (+Inf).
    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    count: int = 0
    sum: float = 0.0

    def observe(self, seconds: float) -> None:
        # Prometheus buckets are "less than or equal": the first bound >= seconds.
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.count += 1
        self.sum += seconds

    def cumulative(self) -> list[tuple[str, float]]:
        """(le, observations at or below it) for each bound and +Inf."""
        buckets: list[tuple[str, float]] = []
        seen = 0
        for bound, observed in zip([*map(repr, self.bounds), "+Inf"], self.counts, strict=True):
            seen += observed
            buckets.append((bound, seen))
        return buckets


class HandlerTimeout(Exception):
    """A handler had not returned within ``handler_timeout``: a failed attempt, its
    transaction rolled back (an async handler cancelled; a sync one abandoned in its thread,
    its connection ended), retried after its backoff, dead-lettered after max_attempts."""

    def __init__(self, handler: object, timeout: float, how: str, *, fatal: bool = False) -> None:
        self.handler_name = _handler_name(handler)
        self.timeout = timeout
        #: What became of the handler: cancelled, or abandoned still running.
        self.how = how
        #: Abandoned past the bound of hung threads: the consumer stops (not charged).
        self.fatal = fatal
        super().__init__(
            f"handler {self.handler_name} did not return within handler_timeout "
            f"({timeout:g}s): {how}"
        )


def _handler_name(handler: object) -> str:
    name = getattr(handler, "__qualname__", None) or type(handler).__qualname__
    module = getattr(handler, "__module__", None)
    return f"{module}.{name}" if module else str(name)


class HandlerCancelled(Exception):
    """An async handler raised CancelledError while its worker was not being cancelled (it
    awaited a task or future that was): a failure of the message, retried, dead-lettered."""


@dataclass(eq=False)
class _Lane:
    """A key's messages in delivery order (or one keyless message); the head is next."""

    key: str | None
    queue: deque[Incoming] = field(default_factory=deque)
    #: Failed attempts of the head message.
    failures: int = 0
    #: The head is waiting for its retry (a timer puts the lane back in the ready queue).
    retry: asyncio.TimerHandle | None = None
    #: Database connections lost in a row applying the head alone (no attempt counted).
    losses: int = 0
    #: Lock waits that ran out, or answers of a full database, in a row applying the head
    #: (no attempt counted).
    waits: int = 0
    #: The head is a suspect whose attempt this process recorded (Session.suspect_attempt)
    #: and has not ended yet: tried again after a lost connection or a lock wait, it is
    #: not recorded a second time (that would count a death that did not happen); still
    #: set at shutdown, its row is deleted (Consumer._forget_cut_short).
    suspect_recorded: bool = False

    @property
    def head(self) -> Incoming:
        return self.queue[0]


def load_handler(spec: str) -> Handler:
    """``package.module:function`` -> the function; ConfigError if it cannot be found."""
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise ConfigError(
            f"handler must be module:function, such as app.events:apply; got {spec!r}"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"cannot import handler module {module_name!r}: {exc}") from exc
    except Exception as exc:
        # The module's own code failed (a SyntaxError, a setting it reads on import): named
        # as the handler's module, where a bare "RuntimeError: ..." named nothing.
        logger.debug("importing handler module %s failed", module_name, exc_info=True)
        raise ConfigError(
            f"handler module {module_name!r} failed on import: {describe(exc)} (run with "
            "--log-level DEBUG for the traceback)"
        ) from exc
    target: Any = module
    for part in attribute.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise ConfigError(f"module {module_name!r} has no {attribute!r}")
    if not callable(target):
        raise ConfigError(f"handler {spec!r} is not callable")
    handler: Handler = target
    return handler


class Consumer:
    """Applies one consumer group's messages from a broker to a database, once in effect."""

    def __init__(
        self,
        *,
        db: str,
        broker: str | Receiver | None,
        group: str,
        handler: Handler | str,
        topics: Sequence[str] | None = None,
        concurrency: int = 4,
        batch: int = 100,
        prefetch: int | None = None,
        max_attempts: int = 10,
        backoff: Backoff | None = None,
        abandoned_blocks_key: bool = False,
        schema: str = "outboxer",
        table: str = "outbox",
        shutdown_timeout: float = 30.0,
        name: str | None = None,
        broker_options: Mapping[str, Any] | None = None,
        publisher_options: Mapping[str, Any] | None = None,
        async_driver: str | None = None,
        exit_when_idle: bool = False,
        keyring: KeyRing | None = None,
        object_store: ObjectStore | None = None,
        object_store_timeout: float = 30.0,
        sessions: SessionFactory | None = None,
        handler_timeout: float | None = None,
        statement_timeout: float | None = STATEMENT_TIMEOUT,
    ) -> None:
        if not 1 <= concurrency <= 256:
            raise ConfigError("concurrency must be between 1 and 256")
        if not 1 <= batch <= 10_000:
            raise ConfigError("batch must be between 1 and 10000")
        if max_attempts < 1:
            raise ConfigError("max_attempts must be at least 1")
        if shutdown_timeout <= 0:
            raise ConfigError("shutdown_timeout must be positive")
        if not object_store_timeout > 0:  # NaN too
            raise ConfigError("object_store_timeout must be positive")
        handler_timeout = _checked_seconds("handler_timeout", handler_timeout)
        statement_timeout = _checked_seconds("statement_timeout", statement_timeout)
        self.handler: Handler = load_handler(handler) if isinstance(handler, str) else handler
        if not callable(self.handler):
            raise ConfigError("handler must be a function taking (message, connection)")
        self.is_async = is_async_handler(self.handler)
        if not self.is_async and _wraps_a_coroutine_function(self.handler):
            # A sync adapter (asgiref's async_to_sync) is fine; a plain decorator that returns
            # the coroutine is not, and only its first call can tell: that fails the message.
            logger.warning(
                "consumer %s: handler %r wraps a coroutine function but is not one itself: it "
                "runs as a plain function, and any message for which it returns a coroutine "
                "fails (HandlerReturnedAwaitable)",
                group,
                self.handler,
            )
        if group.endswith(" ") and urlsplit(db).scheme.lower().startswith(("mysql", "mariadb")):
            # Once, here, rather than at each message's inbox claim (inbox.check_mysql_consumer).
            raise ConfigError(
                f"group {group!r} ends in a space: MySQL and MariaDB take it for the same "
                "group without it, and it would share that one's inbox and dead letters"
            )
        self.db = db
        self.group = group
        self.concurrency = concurrency
        self.batch = batch
        # The default within what the broker takes (RabbitMQ's basic.qos: 65535): a large
        # batch or concurrency refused "prefetch must be at most …", a value never set.
        most = (
            receiver_class(broker).max_prefetch
            if isinstance(broker, str)
            else Receiver.max_prefetch
            if broker is None
            else type(broker).max_prefetch
        )
        self.prefetch = prefetch or min(max(100, 2 * concurrency * batch), most)
        self.max_attempts = max_attempts
        self.backoff = backoff or Backoff()
        self.abandoned_blocks_key = abandoned_blocks_key
        self.schema = schema
        self.table = table
        self.shutdown_timeout = shutdown_timeout
        self.exit_when_idle = exit_when_idle
        #: Payload protection undone before the handler: claim-checked payloads are fetched
        #: from ``object_store``, encrypted ones decrypted with ``keyring``.
        self.keyring = keyring
        self.object_store = object_store
        #: Seconds a claim-checked payload's fetch may take: a store that hangs (a hard NFS
        #: mount) fails the message retryably rather than stopping its worker for ever. It
        #: bounds a dead letter's claim-check hold (and its release) and a KMS key fetch too.
        self.object_store_timeout = object_store_timeout
        #: Seconds an attempt's handler may run (None: no bound): past it the attempt fails
        #: (HandlerTimeout). An async handler is cancelled; a sync one's thread cannot be,
        #: so its attempt is abandoned there (see DESIGN), at most ``concurrency`` at once.
        self.handler_timeout = handler_timeout
        self._receiver: Receiver | None
        if broker is None or isinstance(broker, Receiver):
            self._receiver = broker  # None: only for replaying dead letters
        else:
            # The consumer's own settings: as broker options they were a TypeError naming
            # create_receiver's arguments ("got multiple values for keyword argument").
            passed = sorted(
                {"group", "topics", "prefetch", "name", "publisher_options"}
                & set(broker_options or {})
            )
            if passed:
                raise ConfigError(
                    f"broker option(s) {passed} are the consumer's own settings: pass them as "
                    "such (--group, --topic, --prefetch, --name), not as --option"
                )
            self._receiver = create_receiver(
                broker,
                group=group,
                topics=topics,
                prefetch=self.prefetch,
                name=name or socket.gethostname(),
                # The relay's options of the broker (a shared settings file's destination):
                # where it publishes, read by the receiver's publisher-side parsing.
                publisher_options=publisher_options,
                **dict(broker_options or {}),
            )
        #: What makes a worker's session: by default a connection of its own to ``db``, of
        #: the handler's kind; a framework passes its own (outboxer.contrib.django runs the
        #: handler on Django's connection, in ``transaction.atomic()``). ``db`` still names
        #: the database whose schema is checked at start-up.
        self._make_session = sessions or session_factory(
            db, schema, is_async=self.is_async, async_driver=async_driver
        )
        #: Seconds each round trip of the runner's own on its sessions may take (a connect,
        #: the inbox claim, COMMIT, a dead letter's record; not the handler's statements,
        #: which ``handler_timeout`` bounds): past it the connection is cut off and the
        #: batch is an outage, not acked, applied again on a new connection with no attempt
        #: counted. The relay's bound on MySQL by default; None: no bound. Also settable
        #: before ``run_async`` (checked again then, when each session is made).
        self.statement_timeout: float | None = statement_timeout
        self.stats = ConsumerStats()
        #: Seconds from each applied message's creation (its enqueue transaction, by the
        #: ``created_at`` it carries) to the commit that applied it: the whole pipeline's
        #: delay, outbox, relay, broker and this consumer's queue included.
        self.delivery_latency = LatencyHistogram()
        #: The group's backlog at the broker as last read (``Receiver.lag``, every
        #: ``LAG_INTERVAL`` while running); None when the broker does not tell.
        self.lag: int | None = None
        self._stats_lock = threading.Lock()
        self._stopping = asyncio.Event()
        #: A second SIGTERM/SIGINT: the batches in flight are not waited for.
        self._forced = asyncio.Event()
        self._fatal: BaseException | None = None
        #: The deliveries whose handler is running now (sync ones in threads), the
        #: connection each was given and when it began (time.monotonic()), by call.
        self._running: dict[object, tuple[Delivery, Any, float]] = {}
        #: Each worker's session now: a handler_timeout gives a worker a new one.
        self._worker_sessions: dict[asyncio.Task[None], Session] = {}
        #: Sessions abandoned under a handler past handler_timeout that still runs (a sync
        #: one in its thread, an async one that ignores its cancellation in its task), with
        #: the message it applies; each leaves when its call ends.
        self._hung: dict[Session, Delivery] = {}
        self._executor: ThreadPoolExecutor | None = None
        #: Each worker's session and the batch it is applying.
        self._batches: dict[asyncio.Task[None], tuple[Session, list[_Lane]]] = {}
        #: Workers abandoned at shutdown (see DESIGN).
        self._given_up: set[asyncio.Task[None]] = set()
        #: Set (from any thread) when a handler returns while stopping; the loop it is of.
        self._returned = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Queue[_Lane] = asyncio.Queue()
        #: Lanes by key; keyless lanes are only in ``_lanes_all``.
        self._lanes: dict[str, _Lane] = {}
        self._lanes_all: set[_Lane] = set()
        self._held = 0  # messages received and not yet acked or handed back
        self._room = asyncio.Event()
        self._timed_handler = self._timed(self.handler, handler_timeout)
        #: A replay of dead letters is an operator's command, not bounded (Ctrl-C ends it).
        self._replay_handler = (
            self._timed(self.handler, None) if handler_timeout is not None else self._timed_handler
        )

    # ----- lifecycle -------------------------------------------------------------------------

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    @property
    def receiver(self) -> Receiver:
        if self._receiver is None:
            raise ConfigError("this consumer has no broker: pass broker=URL to run it")
        return self._receiver

    @property
    def in_flight(self) -> int:
        """Messages received and not yet acked or handed back."""
        return self._held

    def stop(self) -> None:
        """Stop fetching; what is in flight commits and is acked, then ``run_async`` returns."""
        if not self._stopping.is_set():
            logger.info("consumer %s stopping: finishing the batches in flight", self.group)
        self._stopping.set()
        self._room.set()

    def signalled(self) -> None:
        """SIGTERM or SIGINT: the first stops the consumer (``shutdown_timeout`` for the
        batches in flight), the next one cuts that wait short."""
        if not self.stopping:
            self.stop()
            return
        if not self._forced.is_set():
            logger.warning(
                "consumer %s: stopping now, not waiting for the batches in flight", self.group
            )
        self._forced.set()

    def run(self) -> ConsumerStats:
        """Run until SIGTERM or SIGINT (or, with ``exit_when_idle``, until nothing comes).

        ConsumerShutdownError if handlers had not returned at shutdown; with ``hung``, a
        thread of a sync handler still runs: a daemon thread, which the interpreter's exit
        does not wait for (the process's end closes its connection, rolling it back), or an
        async handler ignoring its cancellation, whose connection is closed and whose task
        is left behind after ``CANCELLED_WAIT`` (asyncio.run would wait for it for ever)."""

        async def main() -> ConsumerStats:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.signalled)
            return await self.run_async()

        # asyncio.run, but its end does not wait for ever for a task that ignores its
        # cancellation (an abandoned async handler, ``hung``): asyncio.run cancels every
        # task left and waits for each.
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            return loop.run_until_complete(main())
        finally:
            try:
                _end_tasks_left(loop)
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.run_until_complete(loop.shutdown_default_executor())
            finally:
                asyncio.set_event_loop(None)
                loop.close()

    async def run_async(self) -> ConsumerStats:
        """Run until ``stop()``; returns the counters."""
        receiver = self.receiver  # ConfigError now if there is no broker
        self._stopping.clear()
        self._forced.clear()
        self._fatal = None
        self._running, self._batches, self._given_up = {}, {}, set()
        self._worker_sessions, self._hung = {}, {}
        self._loop = asyncio.get_running_loop()
        cut_short: ConsumerShutdownError | None = None
        # Nothing carries over from an earlier run: its unacked messages come again.
        self._ready, self._lanes, self._lanes_all, self._held = asyncio.Queue(), {}, set(), 0
        executor = self._executor = self._threads()
        sessions: list[Session] = []
        tasks: list[asyncio.Task[None]] = []
        try:
            if not await self._check_schema():
                return self.stats
            sessions = [self._new_session(executor) for _ in range(self.concurrency)]
            for session in sessions:
                session.on_return = self._wake
                if not await self._open(session):
                    return self.stats
            logger.info(
                "consumer %s started: broker %s, topics %s, concurrency %d, batch %d, prefetch %d",
                self.group,
                receiver.safe_url,
                ", ".join(receiver.topics),
                self.concurrency,
                self.batch,
                self.prefetch,
            )
            workers = [asyncio.create_task(self._work(session)) for session in sessions]
            self._worker_sessions = dict(zip(workers, sessions, strict=True))
            fetcher = asyncio.create_task(self._fetch())
            tasks = [fetcher, *workers]
            if receiver.extend_interval:
                tasks.append(asyncio.create_task(self._extend(receiver.extend_interval)))
            tasks.append(asyncio.create_task(self._read_lag(receiver)))
            await self._stopping.wait()
            cut_short = await self._shutdown(fetcher, workers)
        finally:
            self._stopping.set()
            for task in tasks:
                task.cancel()
            # Not those _shutdown abandoned (they may never end), and bounded all the same.
            if waiting := [task for task in tasks if task not in self._given_up]:
                await asyncio.wait(waiting, timeout=CANCELLED_WAIT)
            # Before the messages go back to the broker: another consumer's attempt at one
            # would find this process's row (one death counted), or have its own deleted.
            await self._forget_cut_short()
            await self._bounded(self._release_all(), "handing messages back to the broker")
            await self._bounded(receiver.close(), "closing the broker connection")
            abandoned = self._abandoned()
            for task, session in abandoned.items():
                # Closed once its call ends (in that call's thread, or from the task's end on
                # the loop): not left open until garbage collection, one per hung batch.
                session.close_after(task)
            with self._stats_lock:
                hung = dict(self._hung)  # closed by close_after when their call ends
            # An async one's task would hold asyncio.run's end for ever (it cancels every task
            # and waits for each): the consumer says so (hung), and its connection goes now
            # (unless a statement of the handler waits on it: psycopg's discard), which rolls
            # back its transaction if end_abandoned did not already end it.
            tasks_left = {s: d for s, d in hung.items() if s.is_async and s.busy()}
            # So does the session of an async batch the shutdown cut short whose handler
            # ignores its cancellation: left to close_after, it stayed open as long as the
            # handler ran, its transaction holding the claims of the messages just handed
            # back to the broker (their next delivery waited on them). Such a batch is
            # already named, with ``hung``, by the shutdown's error.
            cut_left = [s for s in abandoned.values() if s.is_async and s.busy()]
            for session in dict.fromkeys([*tasks_left, *cut_left]):
                session.discard()
            if hung:
                logger.warning(
                    "consumer %s: %d handler(s) abandoned after handler_timeout still run%s",
                    self.group,
                    len(hung),
                    f" ({len(tasks_left)} async one(s) ignoring their cancellation)"
                    if tasks_left
                    else " in their threads (left to end with the process)",
                )
            for session in dict.fromkeys([*sessions, *self._worker_sessions.values()]):
                # Closing under a handler would hang.
                if session not in abandoned.values() and session not in hung:
                    await self._quietly(session.close(), "closing a database connection")
            executor.shutdown(wait=False)
            self.lag = None
            logger.info("consumer %s stopped: %s", self.group, self.stats.as_dict())
        if tasks_left:
            stopped = self._fatal if isinstance(self._fatal, ConsumerShutdownError) else cut_short
            if stopped is not None:
                stopped.hung = True
            elif self._fatal is None:
                listed = "; ".join(
                    f"{delivery.id} (topic {delivery.topic}, key {delivery.key})"
                    for delivery in tasks_left.values()
                )
                raise ConsumerShutdownError(
                    f"consumer {self.group}: async handler(s) abandoned after handler_timeout "
                    f"ignore their cancellation and still run: {listed}",
                    message_ids=[str(delivery.id) for delivery in tasks_left.values()],
                    hung=True,
                )
        if self._fatal is not None:
            raise self._fatal
        if cut_short is not None:
            raise cut_short
        return self.stats

    async def _read_lag(self, receiver: Receiver) -> None:
        """The group's backlog at the broker, read every ``LAG_INTERVAL`` for /metrics."""
        while True:
            try:
                self.lag = await receiver.lag(LAG_INTERVAL) if receiver.connected else None
            except Exception as exc:  # noqa: BLE001 -- a receiver of the application's: a metric
                logger.debug("consumer %s: the broker's backlog not read: %s", self.group, exc)
                self.lag = None
            await asyncio.sleep(LAG_INTERVAL)

    async def _forget_cut_short(self) -> None:
        """Delete the suspect rows of the attempts this run cut short and hands back: an
        attempt the consumer itself ended (a shutdown) is no death. Bounded by
        ``SUSPECT_FORGET_WAIT``; rows it could not delete are logged and stay."""
        lanes = [lane for lane in self._lanes_all if lane.suspect_recorded]
        if not lanes:
            return
        # A connection and a thread of their own: a worker's session may be abandoned under
        # a hung handler, and the workers' threads taken by such handlers.
        executor = DaemonThreadPool(1, thread_name_prefix=f"outboxer-{self.group}-suspects")
        session = self._new_session(executor)
        work = asyncio.ensure_future(self._delete_suspects(session, lanes))
        try:
            await asyncio.wait({work}, timeout=SUSPECT_FORGET_WAIT)
        finally:
            if not work.done():
                work.cancel()
                # Closed once its call ends (a sync one goes on in its thread), not under it.
                session.close_after(work)
            executor.shutdown(wait=False)
        left = [lane.head.delivery for lane in lanes if lane.suspect_recorded]
        if not left:
            logger.info(
                "consumer %s: %d suspect attempt(s) cut short by the shutdown: not counted as "
                "deaths",
                self.group,
                len(lanes),
            )
            return
        failure = work.exception() if work.done() and not work.cancelled() else None
        logger.warning(
            "consumer %s: deleting the suspect rows of attempts cut short by the shutdown %s; "
            "each of these messages may count one death too many at its next delivery: %s",
            self.group,
            f"failed: {describe(failure)}"
            if failure is not None
            else f"did not finish within {SUSPECT_FORGET_WAIT:g}s",
            ", ".join(str(delivery.id) for delivery in left),
        )

    async def _delete_suspects(self, session: Session, lanes: Sequence[_Lane]) -> None:
        """``_forget_cut_short``'s work: each lane's suspect row deleted, its flag cleared.
        Cancelled, it leaves the session to ``close_after``."""
        try:
            await session.open()
            for lane in lanes:
                await session.suspect_done(self.group, lane.head.delivery.id)
                lane.suspect_recorded = False
        finally:
            if not (task := asyncio.current_task()) or not task.cancelling():
                await self._quietly(session.close(), "closing a database connection")

    def _new_session(self, executor: ThreadPoolExecutor) -> Session:
        """A session of ``_make_session``, bounded by ``statement_timeout``."""
        # Again here: the attribute may have been set after the constructor checked it.
        bound = _checked_seconds("statement_timeout", self.statement_timeout)
        session = self._make_session(executor)
        session.statement_timeout = bound
        return session

    def _threads(self) -> ThreadPoolExecutor:
        """Threads for sync handlers' transactions, one per worker: daemon threads, so that
        a handler hung for ever in one (abandoned at shutdown) does not keep the process
        from exiting once ``run()`` returned (DaemonThreadPool)."""
        return DaemonThreadPool(self.concurrency, thread_name_prefix=f"outboxer-{self.group}")

    async def _shutdown(
        self, fetcher: asyncio.Task[None], workers: list[asyncio.Task[None]]
    ) -> ConsumerShutdownError | None:
        """Wait for the batches in flight (``shutdown_timeout``, or until forced), then cut
        those still running short: the error to raise once the consumer has stopped."""
        fetcher.cancel()
        await asyncio.gather(fetcher, return_exceptions=True)
        for lane in self._lanes_all:
            if lane.retry is not None:
                lane.retry.cancel()
        if not await self._wait_or_forced(workers, self.shutdown_timeout):
            return None
        late = [task for task in workers if not task.done()]
        # Snapshots: what runs at the bound, and the batches it belongs to.
        with self._stats_lock:  # sync handlers' threads change it
            running = list(self._running.values())
        batches = [self._batches[task][1] for task in late if task in self._batches]
        for task in late:
            if task in self._batches:
                # Now, not after the wait: a sync handler returning meanwhile must not commit
                # what is about to be handed back to the broker as not applied.
                self._batches[task][0].abandoned = True
            task.cancel()
        # Even when forced: a cancelled async handler rolls back in a round trip or two, and
        # a sync handler just over the bound may return (its batch then rolls back).
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CANCELLED_WAIT
        while True:
            self._returned.clear()
            hung = self._abandoned()
            left = deadline - loop.time()
            if not hung or left <= 0:
                break
            returned = asyncio.ensure_future(self._returned.wait())
            ending = {task for task in hung if not task.done()}
            await asyncio.wait({returned, *ending}, timeout=left, return_when="FIRST_COMPLETED")
            returned.cancel()
        self._given_up = set(hung)
        named = [delivery for delivery, _, _ in running] or [
            lane.head.delivery for lanes in batches for lane in lanes
        ]
        what = "handler(s) that did not return" if running else "batch(es) that did not finish"
        why = (
            "at a second SIGTERM/SIGINT"
            if self._forced.is_set()
            else f"within shutdown_timeout ({self.shutdown_timeout:g}s)"
        )
        listed = "; ".join(
            f"{delivery.id} (topic {delivery.topic}, key {delivery.key})" for delivery in named
        )
        logger.error(
            "consumer %s: message(s) with %s %s: %s; not acked, their transaction not "
            "committed: the broker delivers them again%s",
            self.group,
            what,
            why,
            listed,
            f"; {len(hung)} batch(es) still running, abandoned" if hung else "",
        )
        return ConsumerShutdownError(
            f"consumer {self.group}: message(s) with {what} {why}: {listed}",
            message_ids=[str(delivery.id) for delivery in named],
            hung=bool(hung),
        )

    def _wake(self) -> None:
        """A handler or a session's thread returned (from any thread)."""
        if self.stopping and self._loop is not None:
            # _shutdown may be waiting for it (a thread cannot wake the loop otherwise);
            # only then, not a wake-up per message.
            with contextlib.suppress(RuntimeError):  # its loop closed: nobody waits
                self._loop.call_soon_threadsafe(self._returned.set)

    def _abandoned(self) -> dict[asyncio.Task[None], Session]:
        """The workers of batches cut short whose handler still runs (a sync handler's
        thread, an async handler that ignored its cancellation), with their sessions: left
        open, for closing one would wait for the handler (or pull the connection from under
        it), and marked so that its transaction never commits if the handler returns."""
        with self._stats_lock:
            busy = [conn for _, conn, _ in self._running.values()]
        workers: dict[asyncio.Task[None], Session] = {}
        for task, (session, _) in list(self._batches.items()):
            # A cancelled sync batch's task ends at once, its thread does not: still in the
            # transaction (an inbox claim waiting on a row lock, a slow COMMIT), where a close
            # queued behind it (run_async waited as long as the lock was held) or ran in
            # another thread under it.
            if not task.done() or session.busy() or any(conn is session.conn for conn in busy):
                session.abandoned = True
                workers[task] = session
            else:
                del self._batches[task]
        return workers

    async def _wait_or_forced(self, tasks: Sequence[asyncio.Task[None]], timeout: float) -> bool:
        """Wait for ``tasks`` to end, at most ``timeout`` or until forced; whether any is left."""
        forced = asyncio.ensure_future(self._forced.wait())
        try:
            pending = {task for task in tasks if not task.done()}
            deadline = asyncio.get_running_loop().time() + timeout
            while pending and not forced.done():
                left = deadline - asyncio.get_running_loop().time()
                if left <= 0:
                    break
                await asyncio.wait({*pending, forced}, timeout=left, return_when="FIRST_COMPLETED")
                pending = {task for task in pending if not task.done()}
            return bool(pending)
        finally:
            forced.cancel()

    async def _release_all(self) -> None:
        unacked = [incoming for lane in self._lanes_all for incoming in lane.queue]
        if unacked and self.receiver.connected:
            await self.receiver.release(unacked)

    async def _bounded(self, closing: Coroutine[Any, Any, Any], what: str) -> None:
        """``_quietly``, but after a second SIGTERM/SIGINT (before or during the call) given
        only ``CANCELLED_WAIT`` more, then cancelled: a broker that never answers the close
        must not keep a forced shutdown waiting for ever."""
        call = asyncio.ensure_future(self._quietly(closing, what))
        forced = asyncio.ensure_future(self._forced.wait())
        try:
            await asyncio.wait({call, forced}, return_when=asyncio.FIRST_COMPLETED)
            if not call.done():
                await asyncio.wait({call}, timeout=CANCELLED_WAIT)
            if not call.done():
                logger.warning(
                    "consumer %s: %s did not end within %gs of the second SIGTERM/SIGINT: given up",
                    self.group,
                    what,
                    CANCELLED_WAIT,
                )
                call.cancel()
                # Bounded too: a call that ignores its cancellation is left to the loop.
                await asyncio.wait({call}, timeout=CANCELLED_WAIT)
        finally:
            forced.cancel()
            if not call.done():  # run_async itself cancelled: the call with it, as awaited
                call.cancel()

    @staticmethod
    async def _quietly(closing: Any, what: str) -> None:
        try:
            await closing
        except Exception as exc:  # noqa: BLE001 -- shutting down: nothing is lost, say so
            logger.warning("%s failed: %s", what, describe(exc))

    async def _sleep(self, seconds: float) -> bool:
        """Sleep, or return early (True) once stopping."""
        try:
            await asyncio.wait_for(self._stopping.wait(), seconds)
        except TimeoutError:
            return False
        return True

    async def _check_schema(self) -> bool:
        """The consumer's database must have the inbox and dead-letter tables of this version."""
        store = create_store(self.db, schema=self.schema, table=self.table)
        failures = 0
        try:
            while True:
                try:
                    await store.connect()
                    await store.check_schema()
                    return True
                except (SchemaError, InsecureConnectionError):  # no outage: retrying cannot help
                    raise
                except Exception as exc:  # noqa: BLE001 -- the database may be starting
                    failures += 1
                    self.stats.database_errors += 1
                    delay = OUTAGE_BACKOFF.delay(failures)
                    logger.warning("database unreachable (%s); retrying in %.1fs", exc, delay)
                    if await self._sleep(delay):
                        return False
        finally:
            await store.close()

    async def _open(self, session: Session) -> bool:
        """(Re)open a worker's connection, backing off while the database is down."""
        failures = 0
        while not self.stopping:
            try:
                await session.close()
            except Exception as exc:  # noqa: BLE001 -- the old connection is broken anyway
                logger.debug("closing a broken connection: %s", exc)
            try:
                await session.open()
                return True
            except Exception as exc:  # noqa: BLE001 -- database outage: back off, try again
                failures += 1
                self.stats.database_errors += 1
                delay = OUTAGE_BACKOFF.delay(failures)
                logger.warning("database unreachable (%s); retrying in %.1fs", exc, delay)
                await self._sleep(delay)
        return False

    # ----- fetching ---------------------------------------------------------------------------

    async def _fetch(self) -> None:
        failures = 0
        #: Connections lost in a row, each within STABLE_CONNECTION of being made: a broker
        #: that drops every connection at once (a frame the client cannot read, a proxy
        #: that cuts) must not be reconnected to in a hot loop.
        losses, connected_at = 0, 0.0
        while not self.stopping:
            if not self.receiver.connected:
                try:
                    await self.receiver.connect()
                    logger.info(
                        "consumer %s: receiving from %s", self.group, self.receiver.safe_url
                    )
                    failures, connected_at = 0, time.monotonic()
                except ConfigError as exc:
                    self._fatal = exc
                    self.stop()
                    return
                except BrokerUnavailableError as exc:
                    failures += 1
                    self.stats.broker_errors += 1
                    delay = OUTAGE_BACKOFF.delay(failures)
                    logger.warning("%s; retrying in %.1fs", exc, delay)
                    await self._sleep(delay)
                    continue
            room = self.prefetch - self._held
            if room <= 0:
                self._room.clear()
                await self._room.wait()
                continue
            try:
                received = await self.receiver.receive(room, FETCH_WAIT)
            except BrokerUnavailableError as exc:
                self.stats.broker_errors += 1
                stable = time.monotonic() - connected_at >= STABLE_CONNECTION
                losses = 1 if stable else losses + 1
                if losses == 1:  # the first loss in a while: reconnect at once
                    logger.warning("%s; reconnecting", exc)
                    continue
                delay = OUTAGE_BACKOFF.delay(losses - 1)
                logger.warning("%s (again, %d in a row); reconnecting in %.1fs", exc, losses, delay)
                await self._sleep(delay)
                continue
            if not received:
                if self.exit_when_idle and self._held == 0 and self.receiver.idle():
                    self.stop()
                continue
            for incoming in received:
                self._dispatch(incoming)

    def _dispatch(self, incoming: Incoming) -> None:
        self.stats.received += 1
        self._held += 1
        # A malformed message whose key could be read takes its key's turn too: dead-lettered
        # ahead of an earlier message of its key still retrying, it would hold that one back
        # (abandoned_blocks_key) behind a later one, and a replay would go out of order.
        key = incoming.delivery.key
        lane = self._lanes.get(key) if key is not None else None
        if lane is not None:
            lane.queue.append(incoming)  # it becomes the head once those before it are done
            return
        lane = _Lane(key, deque([incoming]))
        if key is not None:
            self._lanes[key] = lane
        self._lanes_all.add(lane)
        self._ready.put_nowait(lane)

    async def _extend(self, interval: float) -> None:
        # Until run_async's end cancels it, not until stop(): the batches shutdown_timeout
        # waits for still hold their messages, and a lease run out meanwhile handed them to
        # another consumer of the group while their transaction was open (applied twice at
        # once, one more delivery counted); held ones keep theirs until they are released.
        while True:
            await asyncio.sleep(interval)
            held = [incoming for lane in self._lanes_all for incoming in lane.queue]
            if held:
                await self.receiver.extend(held)

    # ----- applying --------------------------------------------------------------------------

    async def _work(self, session: Session) -> None:
        me = asyncio.current_task()
        assert me is not None
        while True:
            lanes = await self._take()
            if not lanes:
                return
            session = self._worker_sessions.get(me, session)  # a new one after a timeout
            self._batches[me] = (session, lanes)  # named at shutdown if it does not finish
            try:
                await self._apply(session, lanes)
            except asyncio.CancelledError:
                raise  # the entry stays: _abandoned() tells whether its handler still runs
            except BaseException:
                del self._batches[me]
                raise
            del self._batches[me]

    async def _take(self) -> list[_Lane]:
        """Up to ``batch`` ready lanes (waiting for the first); empty once stopping."""
        getter = asyncio.ensure_future(self._ready.get())
        stopper = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait((getter, stopper), return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
            if not getter.done():
                getter.cancel()
        if not getter.done() or getter.cancelled():
            return []
        lanes = [getter.result()]
        if self.stopping:
            return []  # the lane stays held: handed back at shutdown
        while len(lanes) < self.batch and not self._ready.empty():
            lanes.append(self._ready.get_nowait())
        return lanes

    async def _apply(self, session: Session, lanes: list[_Lane], *, alone: bool = False) -> None:
        """Apply the heads of ``lanes`` in one transaction, then ack them (see DESIGN)."""
        session = self._session_now(session)
        todo: list[_Lane] = []
        for lane in lanes:
            if lane.head.malformed is None and (self.keyring or self.object_store):
                try:
                    lane.head.delivery = await self.unwrap(lane.head.delivery)
                except Unreadable as exc:
                    lane.head.malformed = str(exc)
                except Exception as exc:  # noqa: BLE001 -- the object store may be back later
                    self.fetch_failed(exc)
                    await self._failed(session, lane, exc)
                    continue
            if lane.head.malformed is not None:
                await self._dead_letter(session, lane, lane.head.malformed, 0, malformed=True)
            else:
                todo.append(lane)
        todo.sort(key=lambda lane: lane.head.delivery.id)  # one lock order for every consumer
        if len(todo) > 1 and any(lane.head.redelivered for lane in todo):
            # A redelivered message may be one that killed the consumer last time (a
            # suspect): applied alone, after the others, so that dying again it takes no
            # batch-mate's commit with it, and its recorded attempt stands for it alone.
            # Told apart before any is applied: a lane applied goes on with its next message
            # (back in the ready queue, another worker's), which this batch must not touch.
            suspects = [lane for lane in todo if lane.head.redelivered]
            firsts = [lane for lane in todo if not lane.head.redelivered]
            if firsts:
                await self._apply(session, firsts, alone=alone)
            for lane in suspects:
                if not self.stopping:
                    await self._apply(session, [lane], alone=True)
            return
        suspect = len(todo) == 1 and todo[0].head.redelivered
        if suspect and not await self._suspect_attempt(session, todo[0]):
            return
        lost = 0  # connections lost in a row applying this batch
        while todo and not self.stopping:
            deliveries = [
                dataclasses.replace(lane.head.delivery, attempt=lane.failures + 1)
                if lane.failures
                else lane.head.delivery  # attempt 1 already
                for lane in todo
            ]
            try:
                results = await self._applied(session, deliveries, suspect=suspect)
            except BatchFailed as failure:
                session = self._session_now(session)  # a new one if the handler hung
                if isinstance(failure.cause, HandlerTimeout) and failure.index is not None:
                    lane = todo.pop(failure.index)
                    self._timed_out(lane, failure.cause)
                    if failure.cause.fatal:
                        # Not charged: the process stops over it. A suspect's row stays, one
                        # death, so that restarts over it end in a dead letter.
                        lane.suspect_recorded = False
                        return
                    await self._failed(session, lane, failure.cause)
                    continue  # the others again at once, no attempt charged
                if session.abandoned:
                    # Shutdown gave up on this batch and handed its messages back; an async
                    # handler that ignored its cancellation has just returned. Nothing to
                    # charge: counted as a failure, a message with max_attempts=1 was written
                    # as a dead letter (and acked on a closed receiver) after shutdown.
                    return
                if session.lost(failure):  # an outage, wherever it struck: no attempt
                    self.stats.database_errors += 1
                    self._outage(failure, todo)
                    if not await self._open(session):
                        return
                    lost += 1
                    if lost == 1 and not any(lane.losses for lane in todo):
                        continue  # again at once: a loss is the database's, most of the time
                    # Lost again on a new connection: the database may be dropping it over
                    # one of these messages (a value over MySQL's max_allowed_packet, a
                    # proxy's rule). Applied again at once, the batch would loop hot and hold
                    # back every key in it for ever: each alone, so such a message holds
                    # back only its own key, and then after the outage backoff.
                    if len(todo) > 1:
                        for lane in todo:
                            await self._apply(session, [lane], alone=True)
                        return
                    self._lost_again(todo[0])
                    return
                if session.database_full(failure):  # an outage, wherever it struck: no attempt
                    self.stats.database_errors += 1
                    self.stats.database_full += 1
                    if failure.index is not None and len(todo) > 1:
                        # A handler's write met it: the others again at once (on a full
                        # database their claims meet it too, and then they wait as well).
                        self._database_full([todo.pop(failure.index)], failure)
                        continue
                    self._database_full(todo, failure)
                    return
                if failure.index is not None:  # its handler raised
                    await self._failed(session, todo.pop(failure.index), failure.cause)
                    continue  # the others again at once: not their fault
                # A handler's COMMIT found by the batch's check, not the database's fault.
                self.stats.database_errors += not isinstance(failure.cause, HandlerEndedTransaction)
                if session.lock_waited(failure) and (
                    alone or len(todo) == 1 or failure.stage == "commit"
                ):
                    # Another consumer of the group holds the message (a redelivery while its
                    # transaction is open) or, at BEGIN or COMMIT, the database's write lock
                    # (SQLite): no attempt counted, never dead-lettered for it. Tried again
                    # after a backoff, the claim finds a duplicate once the holder commits.
                    # A claim's wait with several messages is split first (below): only the
                    # held message's lane waits.
                    self._lock_waited(todo, failure)
                    return
                if len(todo) > 1 and not alone:
                    # A statement or the commit failed with no handler raising (a deadlock,
                    # a deferred constraint): alone, each message's own failure shows.
                    for lane in todo:
                        await self._apply(session, [lane], alone=True)
                    return
                # Alone, and the connection is fine: its commit or one of the consumer's
                # statements for it (the dead-letter check, the held record, the inbox claim)
                # failed for what it holds. Charged to it like a handler's failure: retried
                # with its backoff, then dead-lettered, where retrying at once for ever would
                # stop this worker and the message's key for good.
                logger.warning(
                    "consumer %s: message %s (topic %s, key %s): the consumer's %s failed: %s",
                    self.group,
                    todo[0].head.delivery.id,
                    todo[0].head.delivery.topic,
                    todo[0].head.delivery.key,
                    failure.stage,
                    describe(failure.cause),
                )
                await self._failed(session, todo.pop(), failure.cause)
                continue
            self.stats.transactions += 1
            committed = time.time()
            for lane, result in zip(todo, results, strict=True):
                if result is Result.APPLIED:
                    self.stats.applied += 1
                    if (created := lane.head.delivery.created_at) is not None:
                        # Clocks of two hosts: a message "from the future" counts as 0 s.
                        self.delivery_latency.observe(max(committed - created.timestamp(), 0.0))
                elif result is Result.DUPLICATE:
                    self.stats.duplicates += 1
                else:
                    self.stats.held += 1
                    self.stats.dead_lettered += 1
                    # Held back behind a dead letter of its key, it is a dead letter too:
                    # its object is held as well (after the commit: see docs).
                    await self.hold_committed(lane.head.delivery)
            await self._done(todo)
            return

    def _outage(self, failure: BatchFailed, lanes: Sequence[_Lane]) -> None:
        if not isinstance(failure.cause, NoAnswerError):
            logger.warning("database connection lost (%s); reconnecting", failure)
            return
        # A database that stopped answering (a stalled network, a proxy that forwards
        # nothing): said as such, its messages named, for nothing else shows it. A COMMIT
        # cut off may have committed: the inbox then makes the next attempt a duplicate.
        logger.warning(
            "consumer %s: %s; reconnecting, not acked, applied again with no attempt counted: %s",
            self.group,
            failure.cause,
            ", ".join(str(lane.head.delivery.id) for lane in lanes),
        )

    def _session_now(self, session: Session) -> Session:
        """The current worker's session: ``session``, or the one that replaced it after a
        sync handler outlived handler_timeout (``_abandon``)."""
        task = asyncio.current_task()
        return self._worker_sessions.get(task, session) if task is not None else session

    async def _applied(
        self, session: Session, deliveries: list[Delivery], *, suspect: bool
    ) -> list[Result]:
        """``session.apply`` of ``deliveries``; a handler running longer than handler_timeout
        fails its attempt: BatchFailed with HandlerTimeout, its index. An async handler is
        cancelled at the bound by its wrapper (``_timed``); a sync one, or an async one still
        running ``TIMEOUT_GRACE`` after its cancellation, is abandoned (``_abandon``)."""
        applying = session.apply(
            self.group,
            deliveries,
            self._timed_handler,
            hold_keys=self.abandoned_blocks_key,
            suspect=suspect,
        )
        if self.handler_timeout is None:
            return await applying  # in this worker's task: no task, no watch
        timeout = self._abandon_after()
        # A task of its own (one per batch), that the worker can leave running under a
        # handler that does not end.
        task = asyncio.ensure_future(applying)
        task.add_done_callback(_outcome_read)
        try:
            while True:
                started = self._handler_started(session)
                now = time.monotonic()
                wait = timeout if started is None else started + timeout - now
                done, _ = await asyncio.wait({task}, timeout=max(wait, 0.0))
                if done:
                    return task.result()
                if (started := self._handler_started(session)) is None:
                    continue
                if time.monotonic() - started >= timeout:
                    timed_out = await self._abandon(session, task, deliveries)
                    if timed_out is not None:
                        raise timed_out
        except asyncio.CancelledError:
            task.cancel()  # a sync call goes on in its thread: shutdown's business
            if self.is_async:
                # The handler runs in that task: this worker ends when it has (rolled back),
                # as when the worker ran it itself; the shutdown gives that CANCELLED_WAIT,
                # then gives up on the batch (``_abandoned``: the session is busy).
                await asyncio.wait({task})
            raise
        except BaseException:
            task.cancel()
            raise

    def _abandon_after(self) -> float:
        """Seconds a handler may run before its attempt is abandoned (handler_timeout set)."""
        assert self.handler_timeout is not None
        return self.handler_timeout + (TIMEOUT_GRACE if self.is_async else 0.0)

    def _handler_started(self, session: Session) -> float | None:
        """When the handler running on ``session``'s connection began, if one runs."""
        with self._stats_lock:
            return next(
                (began for _, conn, began in self._running.values() if conn is session.conn),
                None,
            )

    async def _abandon(
        self, session: Session, task: asyncio.Task[list[Result]], deliveries: list[Delivery]
    ) -> BatchFailed | None:
        """Give up on ``session``'s batch, whose handler outlived handler_timeout (a sync
        one) or its cancellation at it by TIMEOUT_GRACE (an async one): its transaction
        never commits (``abandoned``), its connection is ended from a new one
        (``end_abandoned``: the batch's locks go) and closed once the call returns
        (``close_after``); the worker goes on with a new session, the pool with a new
        thread (a sync handler's). An async handler's task is left running: nothing it does
        later is committed or acked, and it holds only the abandoned session. The failure
        to raise, or None if the handler returned meanwhile."""
        assert self.handler_timeout is not None
        limit = self._abandon_after()
        with self._stats_lock:  # the handler's thread removes its entry under it
            now = time.monotonic()
            # Only a handler past the bound: the one the caller saw may have returned since
            # and the batch's next handler begun on the same connection, not to be charged.
            call = next(
                (
                    c
                    for c, (_, conn, began) in self._running.items()
                    if conn is session.conn and now - began >= limit
                ),
                None,
            )
            if call is None:
                return None  # it returned: the batch goes on (to its next handler, its commit)
            delivery = self._running.pop(call)[0]  # not named again at shutdown
            # Before the lock is released: from its return on, the thread checks it before
            # the next handler and the commit (consumer_db._refuse_abandoned).
            session.abandoned = True
            self._hung[session] = delivery
            hung = len(self._hung)
        task.cancel()
        me = asyncio.current_task()
        assert me is not None

        def ended() -> None:
            with self._stats_lock:
                self._hung.pop(session, None)

        pool = self._executor
        assert pool is not None  # set by run_async, which runs the workers
        if getattr(session, "executor", None) is pool and isinstance(pool, DaemonThreadPool):
            daemons: DaemonThreadPool = pool
            daemons.grow()
            session.when_idle(daemons.shrink)
        session.when_idle(ended)
        session.close_after(task)
        fatal = hung > self.concurrency
        where = "async ones ignoring their cancellation" if self.is_async else "in their threads"
        how = (
            f"cancelled, and still running {TIMEOUT_GRACE:g}s later: abandoned"
            if self.is_async
            else "abandoned in its thread"
        )
        fresh = self._new_session(pool)
        fresh.on_return = self._wake
        self._worker_sessions[me] = fresh
        if me in self._batches:
            self._batches[me] = (fresh, self._batches[me][1])
        index = next((i for i, d in enumerate(deliveries) if d is delivery), None)
        if fatal:
            self._fatal = ConsumerShutdownError(
                f"consumer {self.group}: {hung} handlers did not return within "
                f"handler_timeout ({self.handler_timeout:g}s) and still run ({where}), "
                f"more than concurrency ({self.concurrency}): stopping so that a restart ends "
                f"them; the last one applied message {delivery.id} (topic {delivery.topic}, "
                f"key {delivery.key})",
                message_ids=[str(delivery.id)],
                hung=True,
            )
            self.stop()
        elif await self._open_now(fresh):
            try:
                if not await fresh.end_abandoned(session):
                    logger.warning(
                        "consumer %s: the transaction of the abandoned handler of message %s "
                        "cannot be ended from another connection here: its locks stay until "
                        "the handler returns",
                        self.group,
                        delivery.id,
                    )
            except Exception as exc:  # noqa: BLE001 -- its locks stay: later attempts wait
                logger.warning(
                    "consumer %s: ending the transaction of the abandoned handler of message "
                    "%s failed (%s): its locks stay until the handler returns",
                    self.group,
                    delivery.id,
                    describe(exc),
                )
        return BatchFailed(
            "handler",
            HandlerTimeout(self.handler, self.handler_timeout, how, fatal=fatal),
            index,
        )

    async def _open_now(self, session: Session) -> bool:
        """``_open``, and while stopping one try all the same (``_open`` makes none then): a
        timeout during the shutdown's wait must still end the abandoned transaction, whose
        locks (SQLite's write lock) would hold back the other batches in flight until
        shutdown_timeout, and give its worker a connection to finish its batch on."""
        if not self.stopping:
            return await self._open(session)
        try:
            await session.open()
        except Exception as exc:  # noqa: BLE001 -- stopping: the batch's messages come again
            self.stats.database_errors += 1
            logger.warning("database unreachable while stopping (%s)", describe(exc))
            return False
        return True

    def _timed_out(self, lane: _Lane, cause: HandlerTimeout) -> None:
        self.stats.handler_timeouts += 1
        delivery = lane.head.delivery
        with self._stats_lock:
            hung = len(self._hung)
        logger.warning(
            "consumer %s: message %s (topic %s, key %s): handler %s did not return within "
            "handler_timeout (%gs): %s%s",
            self.group,
            delivery.id,
            delivery.topic,
            delivery.key,
            cause.handler_name,
            cause.timeout,
            cause.how,
            f" ({hung} abandoned handler(s) still running, at most {self.concurrency})"
            if hung
            else "",
        )

    async def unwrap(self, delivery: Delivery) -> Delivery:
        """``delivery`` with its claim-checked payload fetched and its encryption undone
        (unchanged when it has neither). Unreadable for what no retry will fix (a ciphertext
        that does not authenticate, an object that does not match)."""
        from outboxer.message import Message

        message = Message(
            id=delivery.id,
            topic=delivery.topic,
            payload=delivery.body,
            key=delivery.key,
            headers=delivery.headers,
            content_type=delivery.content_type,
            created_at=delivery.created_at,
        )
        try:
            if self.object_store is not None:
                from outboxer.claimcheck import fetch_payload_async

                message = await fetch_payload_async(
                    message, self.object_store, timeout=self.object_store_timeout
                )
            if self.keyring is not None:
                from outboxer.crypto import HEADER_KEY_ID, decrypt

                key_id = message.headers.get(HEADER_KEY_ID)
                if key_id and not self.keyring.has_key(key_id):
                    # A callable ring fetches from a KMS: off the event loop, once per key.
                    await self._fetch_key(key_id)
                message = decrypt(message, self.keyring)
        except Exception as exc:
            if _permanent(exc):
                raise Unreadable(describe(exc)) from exc
            raise
        if message.payload is delivery.body and message.headers is delivery.headers:
            return delivery
        try:
            payload = decode_payload(message.payload, message.content_type)
        except MalformedMessage as exc:
            raise Unreadable(str(exc)) from exc
        return dataclasses.replace(
            delivery,
            headers=message.headers,
            payload=payload,
            body=message.payload,
            content_type=message.content_type,
            received=delivery.received or delivery,
        )

    async def _fetch_key(self, key_id: str) -> None:
        """Fetch ``key_id`` from the keyring's source (a KMS) in a daemon thread of its own,
        given up after object_store_timeout (KeyRingUnavailableError: a failed attempt,
        retried), as the relay does (``crypto.fetch_key_bounded``). Not a fixed pool: once
        its threads were all held by calls that never return, every later fetch queued
        behind them and timed out, never reaching the KMS again until a restart. Past
        MAX_ABANDONED_FETCHES calls of this ring left running, the fetch fails at once."""
        from outboxer.crypto import fetch_key_bounded

        keyring = self.keyring
        assert keyring is not None
        await fetch_key_bounded(
            keyring, key_id, self.object_store_timeout, waiter="the consumer", log=logger
        )

    def fetch_failed(self, exc: BaseException) -> None:
        """Count what ``unwrap`` raised for now (not Unreadable): a claim-check read that
        timed out and a missing object each have their counter; the caller counts the
        failed attempt."""
        from outboxer.claimcheck import ObjectNotFoundError, ObjectReadTimeoutError

        if isinstance(exc, ObjectReadTimeoutError):
            self.stats.claim_check_timeouts += 1
        elif isinstance(exc, ObjectNotFoundError):
            self.stats.claim_check_missing += 1

    def _timed(self, handler: Handler, timeout: float | None) -> Handler:
        stats, lock = self.stats, self._stats_lock

        def add(started: float, call: object) -> None:
            with lock:  # sync handlers run in several threads
                stats.handler_seconds += time.perf_counter() - started
                self._running.pop(call, None)  # gone if run_async began anew since
            self._wake()

        def begin(delivery: Delivery, conn: Any) -> object:
            call = object()
            with lock:
                self._running[call] = (delivery, conn, time.monotonic())
            return call

        if self.is_async:

            async def timed_async(delivery: Delivery, conn: Any) -> Any:
                started, call = time.perf_counter(), begin(delivery, conn)
                try:
                    if timeout is None:
                        return await handler(delivery, conn)
                    bound = asyncio.timeout(timeout)
                    try:
                        async with bound:
                            result = await handler(delivery, conn)
                    except Exception as exc:
                        if bound.expired():  # cancelled by the bound, whatever it raised then
                            raise HandlerTimeout(handler, timeout, "cancelled") from exc
                        raise
                    if bound.expired():
                        # It caught its cancellation and returned all the same: what it
                        # wrote may be half of what it meant to, not to be committed.
                        raise HandlerTimeout(handler, timeout, "cancelled (and it returned)")
                    return result
                except asyncio.CancelledError as exc:
                    task = asyncio.current_task()
                    if task is None or task.cancelling():
                        raise  # this worker is being cancelled (shutdown)
                    # The handler's own (it awaited something cancelled): escaping as it is,
                    # it would end the worker and leave its lanes held until shutdown.
                    raise HandlerCancelled(
                        "the handler raised CancelledError without being cancelled"
                    ) from exc
                finally:
                    add(started, call)

            return timed_async

        def timed(delivery: Delivery, conn: Any) -> Any:
            started, call = time.perf_counter(), begin(delivery, conn)
            try:
                return call_sync_handler(handler, delivery, conn)  # names the user's handler
            finally:
                add(started, call)

        return timed

    async def _suspect_attempt(self, session: Session, lane: _Lane) -> bool:
        """Record the attempt at a redelivered head before its handler runs (one commit of
        its own: the handler may kill the process); whether to apply it now. Not when the
        consumer already died ``max_attempts`` times on it: then it is a dead letter."""
        if lane.suspect_recorded:
            return True  # this process's attempt still stands (tried again, not died)
        delivery = lane.head.delivery
        try:
            deaths = await session.suspect_attempt(self.group, delivery.id)
        except Exception as exc:  # noqa: BLE001 -- the database's trouble, sorted below
            if session.lost(exc):  # an outage: no attempt counted, as for a batch
                self.stats.database_errors += 1
                if await self._open(session):
                    self._lost_again(lane)
                return False
            if session.database_full(exc):  # as for a batch: no attempt counted
                self.stats.database_errors += 1
                self.stats.database_full += 1
                self._database_full([lane], BatchFailed("statement", exc))
                return False
            logger.warning(
                "consumer %s: message %s: recording its attempt as a suspect failed: %s",
                self.group,
                delivery.id,
                describe(exc),
            )
            await self._failed(session, lane, exc)  # charged to it, or it would loop hot
            return False
        lane.suspect_recorded = True
        self.stats.suspect_attempts += 1
        if deaths < self.max_attempts:
            if deaths:
                logger.warning(
                    "consumer %s: message %s (topic %s, key %s) is delivered again after the "
                    "consumer died %d time(s) applying it (dead-lettered at %d)",
                    self.group,
                    delivery.id,
                    delivery.topic,
                    delivery.key,
                    deaths,
                    self.max_attempts,
                )
            return True
        error = (
            f"the consumer died {deaths} times applying this message (its process ended "
            "before the transaction did: a crash, the OOM killer, os._exit)"
        )
        await self._dead_letter(session, lane, error, deaths, died=True)
        return False

    async def _forget_suspect(self, session: Session, lane: _Lane) -> None:
        """The head's recorded attempt ended without the apply's commit (a failure counted
        in-process, a dead letter): its suspect row goes, in a transaction of its own."""
        if not lane.suspect_recorded:
            return
        lane.suspect_recorded = False
        try:
            await session.suspect_done(self.group, lane.head.delivery.id)
        except Exception as exc:  # noqa: BLE001 -- left behind, it counts one death too many
            logger.warning(
                "consumer %s: message %s: deleting its suspect row failed (%s); if it is "
                "delivered again, one death too many is counted",
                self.group,
                lane.head.delivery.id,
                describe(exc),
            )

    async def _failed(self, session: Session, lane: _Lane, cause: BaseException) -> None:
        # The in-process count takes over: an exception is no death.
        await self._forget_suspect(session, lane)
        lane.failures += 1
        self.stats.failed += 1
        delivery = lane.head.delivery
        error = describe(cause)
        if lane.failures >= self.max_attempts:
            await self._dead_letter(session, lane, error, lane.failures)
            return
        delay = self.backoff.delay(lane.failures)
        logger.log(
            # A bug of the handler, not a passing failure: it fails every attempt.
            logging.ERROR if isinstance(cause, HandlerEndedTransaction) else logging.WARNING,
            "consumer %s: message %s (topic %s, key %s) failed attempt %d of %d, retrying in "
            "%.1fs: %s",
            self.group,
            delivery.id,
            delivery.topic,
            delivery.key,
            lane.failures,
            self.max_attempts,
            delay,
            error,
        )
        lane.retry = asyncio.get_running_loop().call_later(delay, self._retry_due, lane)

    def _lost_again(self, lane: _Lane) -> None:
        """The head, applied alone, lost the database connection again: no attempt counted
        (the database may be down), tried again after the outage backoff."""
        lane.losses += 1
        delay = OUTAGE_BACKOFF.delay(lane.losses)
        delivery = lane.head.delivery
        logger.warning(
            "consumer %s: message %s (topic %s, key %s): the database connection was lost "
            "again applying it (%d in a row); retrying in %.1fs",
            self.group,
            delivery.id,
            delivery.topic,
            delivery.key,
            lane.losses,
            delay,
        )
        lane.retry = asyncio.get_running_loop().call_later(delay, self._retry_due, lane)

    def _lock_waited(self, lanes: Sequence[_Lane], failure: BatchFailed) -> None:
        """The batch of ``lanes`` waited for a lock in the consumer's own statements until the
        database gave up (``Session.lock_waited``): rolled back, not acked, no attempt
        counted; each head tried again after the outage backoff."""
        self._wait_without_attempt(
            lanes,
            failure,
            f"the consumer's {failure.stage} waited for a lock in vain (another consumer "
            "applying it?)",
        )

    def _database_full(self, lanes: Sequence[_Lane], failure: BatchFailed) -> None:
        """The batch of ``lanes`` failed because the consumer's database is full
        (``Session.database_full``): rolled back, not acked, no attempt counted, never
        dead-lettered for it; each head tried again after the outage backoff (so that an
        hour of it is a try every OUTAGE_BACKOFF's cap, no hot loop)."""
        self._wait_without_attempt(
            lanes, failure, f"the consumer's database is full (its {failure.stage} failed)"
        )

    def _wait_without_attempt(self, lanes: Sequence[_Lane], failure: BatchFailed, why: str) -> None:
        """Each head of ``lanes`` tried again after the outage backoff, by its count of such
        waits in a row (``_Lane.waits``), not acked, no attempt counted."""
        loop = asyncio.get_running_loop()
        for lane in lanes:
            lane.waits += 1
            delay = OUTAGE_BACKOFF.delay(lane.waits)
            delivery = lane.head.delivery
            logger.warning(
                "consumer %s: message %s (topic %s, key %s): %s, no attempt counted (%d in a "
                "row); retrying in %.1fs: %s",
                self.group,
                delivery.id,
                delivery.topic,
                delivery.key,
                why,
                lane.waits,
                delay,
                describe(failure.cause),
            )
            lane.retry = loop.call_later(delay, self._retry_due, lane)

    def _retry_due(self, lane: _Lane) -> None:
        lane.retry = None
        if not self.stopping:
            self._ready.put_nowait(lane)

    async def _dead_letter(
        self,
        session: Session,
        lane: _Lane,
        error: str,
        attempts: int,
        *,
        malformed: bool = False,
        died: bool = False,
    ) -> None:
        delivery = lane.head.delivery
        failures = 0
        while True:
            try:
                # The hold first: a crash before the dead letter commits leaves a hold the
                # message no longer needs (its object kept too long), never a dead letter
                # whose object retention may delete.
                await self.hold(delivery)
                await session.record_dead_letter(self.group, delivery, error, attempts)
                break
            except HoldFailed as exc:  # the object store's trouble, not the database's
                failures += 1
                delay = OUTAGE_BACKOFF.delay(failures)
                logger.warning(
                    "consumer %s: message %s not dead-lettered yet: %s; retrying in %.1fs",
                    self.group,
                    delivery.id,
                    exc,
                    delay,
                )
                if await self._sleep(delay):
                    return
            except Exception as exc:  # noqa: BLE001 -- database trouble: the message waits
                failures += 1
                self.stats.database_errors += 1
                lost = session.lost(exc)
                full = session.database_full(exc)
                self.stats.database_full += full
                if lost and not await self._open(session):
                    return  # stopping: not acked, delivered again later
                delay = OUTAGE_BACKOFF.delay(failures)
                # Not lost nor full: even the bare record (record_dead_letter's fallback) was
                # refused, so the table, not the message, is at fault; an operator has to act.
                logger.log(
                    logging.WARNING if lost or full else logging.ERROR,
                    "consumer %s: recording message %s as a dead letter failed (%s); retrying "
                    "in %.1fs",
                    self.group,
                    delivery.id,
                    describe(exc),
                    delay,
                )
                if await self._sleep(delay):
                    return
        await self._forget_suspect(session, lane)
        self.stats.dead_lettered += 1
        self.stats.malformed += malformed
        # Counted once written, not when judged: a consumer stopping meanwhile wrote none.
        self.stats.suspects_dead_lettered += died
        logger.error(
            "consumer %s: message %s (topic %s, key %s) is a dead letter after %d attempt(s): %s",
            self.group,
            delivery.id,
            delivery.topic,
            delivery.key,
            attempts,
            error,
        )
        await self._done([lane])

    async def _done(self, lanes: Sequence[_Lane]) -> None:
        """The heads of ``lanes`` are committed: ack them, then their lanes go on."""
        await self.receiver.ack([lane.head for lane in lanes])
        for lane in lanes:
            lane.queue.popleft()
            lane.failures = lane.losses = lane.waits = 0
            lane.suspect_recorded = False  # its row went with the commit (suspect=True)
            self._held -= 1
            if lane.queue:
                self._ready.put_nowait(lane)
            else:
                self._lanes_all.discard(lane)
                if lane.key is not None and self._lanes.get(lane.key) is lane:
                    del self._lanes[lane.key]
        self._room.set()

    # ----- dead letters -----------------------------------------------------------------------

    async def replay_dead_letters(self, ids: Sequence[str] | None = None) -> dict[str, int]:
        """Apply this group's dead letters again, in the order they came (only ``ids`` if given).

        Each goes through the usual transaction (inbox claim + handler) and leaves the table in
        it; one already applied (the inbox has it) just leaves. One that fails again stays,
        with one more attempt and its new error; with ``abandoned_blocks_key`` the later dead
        letters of its key stay too (so do those behind a dead letter that was not chosen).
        One whose transaction waited for a lock in vain (another transaction holds the
        message or its dead letter) is not tried: it stays as it was, counted as skipped.
        Returns counts: replayed, duplicates, failed, skipped.

        Only the chosen dead letters are read (a whole group in pages of
        ``REPLAY_PAGE_SIZE``): whether one is behind an earlier dead letter of its key is
        asked of the table, where that earlier one still is (not chosen, or failed again).
        """
        wanted = None if ids is None else {parse_message_id(value) for value in ids}
        counts = dict.fromkeys(("replayed", "duplicates", "failed", "skipped"), 0)
        executor = self._threads()
        session = self._new_session(executor)
        await session.open()
        try:
            pages = self._group_pages(session) if wanted is None else self._chosen(session, wanted)
            async for page in pages:
                # Keys known blocked, and (a whole group only) keys known free, within the
                # page: a cache of key_blocked_before, bounded by the page like the page.
                blocked: set[str] = set()
                free: set[str] = set()
                for letter in page:
                    key = letter.delivery.key if self.abandoned_blocks_key else None
                    if key is not None and key not in free:
                        if key in blocked or await session.key_blocked_before(
                            self.group, key, letter.seq
                        ):
                            blocked.add(key)
                            counts["skipped"] += 1
                            continue
                        # Walking the whole group, every earlier dead letter of the key in this
                        # page was seen here: one that fails again lands in blocked.
                        if wanted is None:
                            free.add(key)
                    outcome = await self._replay_one(session, letter)
                    counts[outcome] += 1
                    if outcome in ("failed", "skipped") and key is not None:
                        blocked.add(key)
                        free.discard(key)
        finally:
            if session.busy():
                # Cut short (Ctrl-C) while a statement or the handler still runs in its
                # thread: closing would run under it, or queue behind it for as long as it
                # takes. Left to that thread: nothing commits after the cancellation, and the
                # open transaction rolls back when the connection goes.
                session.abandoned = True
                logger.warning(
                    "dead-letter replay for %s cut short while its database call still ran: "
                    "its connection is left to end with that call",
                    self.group,
                )
            else:
                await session.close()
            executor.shutdown(wait=False)
        return counts

    async def _group_pages(self, session: Session) -> AsyncIterator[list[DeadLetter]]:
        """The group's dead letters, page by page (keyset on seq)."""
        after = 0
        while True:
            page = await session.dead_letters_after(self.group, after, REPLAY_PAGE_SIZE)
            if page:
                yield page
            if len(page) < REPLAY_PAGE_SIZE:
                return
            after = page[-1].seq

    async def _chosen(
        self, session: Session, wanted: set[uuid.UUID]
    ) -> AsyncIterator[list[DeadLetter]]:
        """The dead letters of ``wanted`` in arrival order, page by page; ids that are not
        (or no longer) dead letters of the group are left out."""
        places: list[tuple[int, uuid.UUID]] = []
        for message_id in wanted:
            seq = await session.dead_letter_seq(self.group, message_id)
            if seq is not None:
                places.append((seq, message_id))
        places.sort()
        for start in range(0, len(places), REPLAY_PAGE_SIZE):
            page = []
            for _, message_id in places[start : start + REPLAY_PAGE_SIZE]:
                letter = await session.dead_letter(self.group, message_id)
                if letter is not None:
                    page.append(letter)
            yield page

    async def _replay_one(self, session: Session, letter: DeadLetter) -> str:
        """Apply one dead letter again: replayed, duplicates, failed (then it stays, with
        one more attempt and its error) or skipped (a lock wait ran out: it stays as it was)."""
        delivery = letter.delivery
        retry = dataclasses.replace(delivery, attempt=letter.attempts + 1)
        try:
            retry = await self.unwrap(retry)
            [result] = await session.apply(
                self.group, [retry], self._replay_handler, hold_keys=False, replaying=True
            )
            # The dead letter left the table with that commit: its hold goes now (a crash
            # before keeps the object too long, never loses it).
            await self.release_hold(delivery)
            return "replayed" if result is Result.APPLIED else "duplicates"
        except BatchFailed as failure:
            if session.lost(failure) or session.database_full(failure):  # outages: the replay ends
                raise failure.cause from failure
            if session.lock_waited(failure):
                # Another transaction holds the message (a consumer applying its redelivery)
                # or its dead letter (another replay): not tried, as the consumer counts no
                # attempt for such a wait; the dead letter stays as it was, for a later
                # replay (recording the attempt would wait on the same lock anyway).
                self.stats.database_errors += 1
                logger.warning(
                    "dead letter %s not replayed: the consumer's %s waited for a lock in vain "
                    "(another transaction holds it); kept as it was, replay it again later: %s",
                    delivery.id,
                    failure.stage,
                    describe(failure.cause),
                )
                return "skipped"
            cause: BaseException = failure.cause
        except Exception as exc:  # noqa: BLE001 -- unwrapping failed: recorded below
            cause = exc
        error = {"error": session.text(describe(cause))[:4000]}
        await session.run("failed_again", {**session.id_params(self.group, delivery.id), **error})
        logger.warning("dead letter %s failed again: %s", delivery.id, error["error"])
        return "failed"

    def _held_object(self, delivery: Delivery) -> str | None:
        """The claim-check object a dead letter of ``delivery`` refers to (as it arrived),
        when this consumer has a store that keeps holds; None otherwise."""
        if self.object_store is None:
            return None
        from outboxer.claimcheck import HEADER_CLAIM_CHECK, ObjectName

        name = (delivery.received or delivery).headers.get(HEADER_CLAIM_CHECK)
        if name is None or ObjectName.parse(name) is None:
            return None  # not claim-checked, or a reference outboxer never wrote
        return name

    async def hold(self, delivery: Delivery) -> None:
        """Hold the object a dead letter of ``delivery`` is about to refer to (claimcheck's
        holds): the sweep then keeps it past retention until the dead letter is replayed or
        purged. A store that refuses it, or does not put it within object_store_timeout,
        raises HoldFailed (counted in claim_check_hold_errors): the dead letter is not
        written without it."""
        name = self._held_object(delivery)
        if name is None:
            return
        from outboxer.claimcheck import put_hold_bounded

        try:
            await put_hold_bounded(
                self.object_store,  # type: ignore[arg-type]
                name,
                self.group,
                timeout=self.object_store_timeout,
            )
        except NotImplementedError:
            logger.warning(
                "consumer %s: %r keeps no holds: the claim-check object %s of dead letter %s "
                "may be deleted by retention before it is replayed",
                self.group,
                self.object_store,
                name,
                delivery.id,
            )
        except Exception as exc:
            self.stats.claim_check_hold_errors += 1
            raise HoldFailed(
                f"holding its claim-check object {name} in {self.object_store!r} failed: "
                f"{describe(exc)}"
            ) from exc

    async def hold_committed(self, delivery: Delivery) -> None:
        try:
            await self.hold(delivery)
        except Exception as exc:  # noqa: BLE001 -- committed already: said, not raised
            logger.error(
                "consumer %s: held-back message %s: %s: retention may delete it before the "
                "message is replayed",
                self.group,
                delivery.id,
                exc,
            )

    async def release_hold(self, delivery: Delivery) -> None:
        """Release this group's hold on the object of ``delivery``'s dead letter, which has
        left the table (replayed, purged). A failure is logged: the object is kept too long."""
        name = self._held_object(delivery)
        if name is None:
            return
        from outboxer.claimcheck import delete_hold_bounded

        try:
            await delete_hold_bounded(
                self.object_store,  # type: ignore[arg-type]
                name,
                self.group,
                timeout=self.object_store_timeout,
            )
        except NotImplementedError:
            return
        except Exception as exc:  # noqa: BLE001 -- the object stays: the sweep keeps it
            logger.warning(
                "consumer %s: releasing the hold on claim-check object %s failed (%s): it is "
                "kept until the hold is deleted",
                self.group,
                name,
                describe(exc),
            )


def _end_tasks_left(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel the tasks left on ``loop`` (``run``'s end, as asyncio.run's) and wait for them
    up to CANCELLED_WAIT, not for ever: those still running then (an abandoned async handler
    ignoring its cancellation, whose connection ``run_async`` closed) are left behind."""
    left = asyncio.all_tasks(loop)
    if not left:
        return
    for task in left:
        task.cancel()
    done, pending = loop.run_until_complete(asyncio.wait(left, timeout=CANCELLED_WAIT))
    for task in done:
        if not task.cancelled() and (exc := task.exception()) is not None:
            loop.call_exception_handler(
                {
                    "message": "unhandled exception during Consumer.run() shutdown",
                    "exception": exc,
                    "task": task,
                }
            )
    if pending:
        logger.warning(
            "%d task(s) still running %gs after their cancellation (abandoned async "
            "handlers ignoring it): left behind",
            len(pending),
            CANCELLED_WAIT,
        )


def _outcome_read(task: asyncio.Task[Any]) -> None:
    """Done callback of a batch's own task: its outcome marked as read, for a task the worker
    left (abandoned, or cancelled at shutdown) ends with nobody to read it, and asyncio would
    log "Task exception was never retrieved" for its BatchFailed."""
    if not task.cancelled():
        task.exception()


class HoldFailed(Exception):
    """The object store did not put a claim-check hold (an error, or no answer within
    object_store_timeout): the dead letter that needs it is not written; tried again."""


class Unreadable(Exception):
    """A payload no retry will make readable: the message is dead-lettered at once."""


def _checked_seconds(name: str, bound: object) -> float | None:
    """``bound`` as ``Consumer``'s ``name`` (a bound in seconds, None: none) takes it, or a
    ConfigError naming it."""
    # 0 or less fired the watchdog every loop turn; NaN cut every round trip at once; inf
    # (None says "no bound") overflows the connect timeout's rounding (math.ceil); True (a
    # switch's value passed on by mistake) would be a one-second bound nobody chose.
    if bound is None:
        return None
    if isinstance(bound, bool) or not isinstance(bound, int | float) or not 0 < bound < math.inf:
        raise ConfigError(f"{name} must be a positive number of seconds or None, not {bound!r}")
    return float(bound)


def _wraps_a_coroutine_function(handler: Handler) -> bool:
    try:
        return inspect.iscoroutinefunction(inspect.unwrap(handler))
    except ValueError:  # a __wrapped__ chain that loops: nothing to warn about
        return False


def _permanent(exc: BaseException) -> bool:
    """Decryption and claim-check failures that the same message meets again."""
    from outboxer.claimcheck import ClaimCheckError, ObjectNotFoundError, ObjectReadTimeoutError
    from outboxer.crypto import DecryptionError, KeyRingUnavailableError

    if isinstance(exc, KeyRingUnavailableError | ObjectNotFoundError | ObjectReadTimeoutError):
        return False  # a KMS or an object store that may answer later
    return isinstance(exc, DecryptionError | ClaimCheckError)


def parse_message_id(value: str) -> uuid.UUID:
    try:
        return uuid.UUID(str(value))
    except ValueError:
        # Cut and escaped: the id comes off the wire (redact.shown_value).
        raise PayloadError(f"not a message id (a UUID): {shown_value(value)}") from None


#: (metric, ConsumerStats attribute, help), one series per group (label ``group``).
_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("outboxer_consumer_received_total", "received", "Messages received from the broker."),
    (
        "outboxer_consumer_applied_total",
        "applied",
        "Messages applied: the handler ran and its transaction committed.",
    ),
    (
        "outboxer_consumer_duplicates_total",
        "duplicates",
        "Redeliveries the inbox recognised: acked without calling the handler.",
    ),
    (
        "outboxer_consumer_failed_total",
        "failed",
        "Handler attempts that raised (rolled back, retried or dead-lettered).",
    ),
    (
        "outboxer_consumer_dead_lettered_total",
        "dead_lettered",
        "Messages written to the dead-letter table and acked (held back ones included).",
    ),
    (
        "outboxer_consumer_held_total",
        "held",
        "Messages dead-lettered without an attempt, behind a dead letter of their key.",
    ),
    (
        "outboxer_consumer_handler_seconds_total",
        "handler_seconds",
        "Seconds spent in the handler.",
    ),
    (
        "outboxer_consumer_transactions_total",
        "transactions",
        "Transactions committed (each applies a batch of messages of different keys).",
    ),
    (
        "outboxer_consumer_database_errors_total",
        "database_errors",
        "Database connections or statements that failed outside the handler.",
    ),
    (
        "outboxer_consumer_database_full_total",
        "database_full",
        "Database errors that said its disk is full (also in database_errors): not acked, "
        "no attempt counted, retried after the outage backoff.",
    ),
    (
        "outboxer_consumer_broker_errors_total",
        "broker_errors",
        "Broker connections that failed or were lost (the consumer reconnects).",
    ),
    (
        "outboxer_consumer_claim_check_timeouts_total",
        "claim_check_timeouts",
        "Claim-checked payloads the object store did not return within the read timeout "
        "(each a failed attempt).",
    ),
    (
        "outboxer_consumer_claim_check_missing_total",
        "claim_check_missing",
        "Claim-checked payloads whose object the store did not have (each a failed attempt).",
    ),
    (
        "outboxer_consumer_claim_check_hold_errors_total",
        "claim_check_hold_errors",
        "Claim-check holds of dead letters the object store refused or did not put within "
        "the timeout (the dead letter waits, not acked).",
    ),
    (
        "outboxer_consumer_suspect_attempts_total",
        "suspect_attempts",
        "Attempts at redelivered messages recorded in the database before their handler "
        "ran (each a message that may have killed a consumer).",
    ),
    (
        "outboxer_consumer_suspects_dead_lettered_total",
        "suspects_dead_lettered",
        "Messages dead-lettered because the consumer died max_attempts times applying them "
        "(also in dead_lettered).",
    ),
    (
        "outboxer_consumer_handler_timeouts_total",
        "handler_timeouts",
        "Handler attempts that had not returned within handler_timeout (each a failed "
        "attempt: async handlers cancelled, sync ones abandoned in their thread).",
    ),
)


class ConsumerCollector:
    """The counters of these consumers, one series per group, for ``GET /metrics``: a
    ``prometheus_client`` collector (``outboxer consume --http`` registers it), read at
    each scrape."""

    def __init__(self, consumers: Sequence[Consumer]) -> None:
        self.consumers = list(consumers)

    def collect(self) -> Iterator[Any]:
        import importlib

        core = importlib.import_module("prometheus_client.core")
        for name, attribute, text in _COUNTERS:
            family = core.CounterMetricFamily(name, text, labels=["group"])
            for consumer in self.consumers:
                family.add_metric([consumer.group], getattr(consumer.stats, attribute))
            yield family
        acked = core.CounterMetricFamily(
            "outboxer_consumer_acked_total",
            "Messages acknowledged to the broker after their transaction committed.",
            labels=["group"],
        )
        held = core.GaugeMetricFamily(
            "outboxer_consumer_in_flight",
            "Messages received and not yet acked (being applied, waiting for their key or a "
            "retry).",
            labels=["group"],
        )
        lag = core.GaugeMetricFamily(
            "outboxer_consumer_lag_messages",
            "Messages the broker holds for the group that no consumer of it was handed yet "
            "(RabbitMQ: the queue's ready messages; NATS: num_pending; Redis: the group's lag; "
            "Kafka: this process's partitions only, sum by group); absent where the broker "
            "does not tell (MQTT).",
            labels=["group"],
        )
        latency = core.HistogramMetricFamily(
            "outboxer_consumer_delivery_seconds",
            "Seconds from a message's creation (its enqueue transaction) to the commit that "
            "applied it, per applied message (the outbox, the relay, the broker and the "
            "consumer's queue together; the two hosts' clocks apart).",
            labels=["group"],
        )
        for consumer in self.consumers:
            if consumer._receiver is not None:
                acked.add_metric([consumer.group], consumer._receiver.stats.acked)
            held.add_metric([consumer.group], consumer.in_flight)
            if consumer.lag is not None:
                lag.add_metric([consumer.group], consumer.lag)
            histogram = consumer.delivery_latency
            latency.add_metric(
                [consumer.group], buckets=histogram.cumulative(), sum_value=histogram.sum
            )
        yield acked
        yield held
        yield lag
        yield latency


__all__ = [
    "Consumer",
    "ConsumerCollector",
    "ConsumerStats",
    "Delivery",
    "Handler",
    "HandlerReturnedAwaitable",
    "HandlerTimeout",
    "HoldFailed",
    "LatencyHistogram",
    "SessionFactory",
    "Unreadable",
    "load_handler",
    "parse_message_id",
]
