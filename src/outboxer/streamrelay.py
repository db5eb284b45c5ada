"""A relay for outboxes read by offset: PostgreSQL log mode and the WAL outbox.

These outboxes record no per-message status. A *source* hands out entries after its
stored checkpoint, in publish order; the relay publishes them and stores the checkpoint
of the longest prefix it is done with. ``outboxer stream-relay`` runs it
(:mod:`outboxer.stream_cli`).

A failed message stops the stream there (a key's later messages must not overtake it):
its attempt is counted in the stream's failures table, in one statement, and the relay
waits the backoff of that many attempts (``Backoff``, with jitter) before it reads again
from the checkpoint, so messages after a failure may be published twice (at least once),
never skipped. After ``max_attempts`` attempts, or at once when the broker refuses the
message for good, the message becomes a *dead letter*: written to the stream's
dead-letter table, and the checkpoint goes past it. The later messages of its key are
then published as usual or, with ``abandoned_blocks_key``, dead-lettered too (*held*)
until the dead letters of the key are replayed or purged. Log mode writes a dead letter
and moves its offset in one transaction; the WAL outbox writes it first and advances its
slot after (``WalReader.commit`` has the invariant).
"""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from outboxer.brokers.base import Outcome, OutcomeKind, Publisher
from outboxer.errors import (
    BrokerUnavailableError,
    ConfigError,
    PublishError,
    SlotInvalidatedError,
    StoreError,
)
from outboxer.message import Message
from outboxer.payload_relay import PayloadHandling
from outboxer.redact import get_logger, redact_text
from outboxer.retry import Backoff
from outboxer.stores.base import storable_error
from outboxer.stores.pgstream import BACKLOG_LIMIT, Backlog, DeadLetter, StreamBook, StreamFailure

if TYPE_CHECKING:
    from outboxer.metrics import Metrics

logger = get_logger("outboxer.streamrelay")

#: The backoff between tries to reach a database or broker that is down.
OUTAGE_BACKOFF_MAX = 30.0
#: Seconds between an idle relay's checks that its database still takes writes
#: (``StreamRelay._still_writable``): a round trip at most this often while nothing comes.
WRITABLE_CHECK_INTERVAL = 1.0
#: Held keys remembered past this many, and past twice as many as the table had when they
#: were last read, are read again from the table: the keys of dead letters replayed or
#: purged elsewhere (the CLI) go, instead of staying for the life of the process.
HELD_KEYS_RELOAD = 10_000


@dataclass(frozen=True, slots=True)
class Entry:
    """One step of a stream: a message to publish (or None: a step with nothing for this
    relay, such as a transaction without outbox messages) and where reading may resume
    after it (None inside a transaction, which is resumed from its start)."""

    message: Message | None
    checkpoint: object | None
    #: Why ``message`` cannot be published (a WAL outbox message whose envelope cannot be
    #: read): the relay dead-letters it at its turn, untried, instead of stopping for ever.
    poison: str | None = None


class StreamSource(Protocol):
    """Where a stream relay reads: entries after the stored checkpoint, in publish order."""

    name: str
    #: "log" or "wal".
    mode: str
    #: The stream's failures and dead letters.
    book: StreamBook

    @property
    def conn(self) -> Any:
        """The source's database connection (asyncpg), for the stream's own tables."""
        ...

    async def connect(self) -> None: ...

    async def attach(self) -> None:
        """Connect for the stream's own tables only (replay), beside a running relay."""
        ...

    async def close(self) -> None: ...

    async def read(self, limit: int) -> list[Entry]:
        """Up to about ``limit`` entries after the stored checkpoint (whole transactions)."""
        ...

    async def commit(
        self,
        checkpoint: object,
        letters: Sequence[DeadLetter] = (),
        cleared: Iterable[int] = (),
    ) -> None:
        """Store ``checkpoint``: reading resumes after it, also after a restart. Write
        ``letters`` and drop the failure rows of ``cleared`` (seqs) with it."""
        ...

    async def idle(self) -> None:
        """Called when a read found nothing (the WAL source lets its slot move on)."""
        ...

    async def failures(self) -> dict[int, StreamFailure]:
        """The stream's failing messages not yet passed, by seq."""
        ...

    async def record_failure(self, message: Message, error: str) -> int:
        """Count one failed attempt of ``message``; its attempts in all."""
        ...

    async def held_keys(self, keys: Iterable[str] | None = None) -> set[str]:
        """Which of ``keys`` (None: any) have dead letters in the stream."""
        ...

    async def backlog(self, limit: int) -> Backlog:
        """How far the stream is behind its head."""
        ...


@dataclass
class StreamStats:
    #: Messages the broker confirmed and the checkpoint passed.
    published: int = 0
    #: Failed publish attempts counted against a message (each one a failures row update).
    failed: int = 0
    #: Dead letters written (held ones included), and of them the held ones.
    dead_lettered: int = 0
    held: int = 0
    failed_rounds: int = 0
    commits: int = 0
    #: Rounds cut short by a lost database connection (the source then reconnects).
    outages: int = 0
    started_at: float = field(default_factory=time.time)
    #: When (time.time()) the checkpoint last moved; None before the first time.
    checkpoint_at: float | None = None
    #: The last backlog measurement, and when it was taken.
    backlog: Backlog | None = None
    backlog_at: float | None = None


def confirmed_checkpoint(
    entries: Sequence[Entry], outcomes: Sequence[Outcome]
) -> tuple[object | None, int, Outcome | None]:
    """The checkpoint after the longest confirmed prefix of ``entries``, how many messages
    that prefix holds, and the first outcome that was not a publish (None if all were).

    ``outcomes`` has one outcome per entry that holds a message, in order.
    """
    results = iter(outcomes)
    checkpoint: object | None = None
    published = 0
    for entry in entries:
        if entry.message is not None:
            outcome = next(results)
            if not outcome.published:
                return checkpoint, published, outcome
            published += 1
        if entry.checkpoint is not None:
            checkpoint = entry.checkpoint
    return checkpoint, published, None


@dataclass
class _Round:
    """What one read-publish round settled, up to the last checkpoint it reached."""

    checkpoint: object | None = None
    published: list[Message] = field(default_factory=list)
    letters: list[DeadLetter] = field(default_factory=list)
    #: Seqs whose failure rows go with the checkpoint.
    cleared: list[int] = field(default_factory=list)
    #: The message the stream stopped at, its outcome and attempts (None: no failure).
    stopped: tuple[Message, Outcome, int] | None = None
    #: The stream stopped at a message the publisher never sent (no attempt counted).
    unsent: bool = False


class StreamRelay:
    """Publishes one stream (a log reader or a WAL slot) until stopped."""

    def __init__(
        self,
        source: StreamSource,
        publisher: Publisher,
        *,
        batch_size: int = 500,
        poll_interval: float = 0.2,
        max_attempts: int = 10,
        backoff: Backoff | None = None,
        abandoned_blocks_key: bool = False,
        payload: PayloadHandling | None = None,
        probe_interval: float | None = None,
        exit_when_idle: bool = False,
        metrics: Metrics | None = None,
        outage_backoff_max: float = OUTAGE_BACKOFF_MAX,
    ) -> None:
        if batch_size < 1 or poll_interval <= 0 or max_attempts < 1:
            raise ConfigError("batch_size and max_attempts must be >= 1, poll_interval > 0")
        self.source = source
        self.publisher = publisher
        self.batch_size = batch_size
        self.poll_interval = poll_interval
        self.max_attempts = max_attempts
        self.backoff = backoff or Backoff()
        self.abandoned_blocks_key = abandoned_blocks_key
        self.payload = payload or PayloadHandling(source.book.destination)
        self.probe_interval = probe_interval
        self.exit_when_idle = exit_when_idle
        self.metrics = metrics
        self.outage_backoff_max = outage_backoff_max
        self.stats = StreamStats()
        #: Failing messages not yet passed, by seq: loaded at start, kept as they change.
        self._failures: dict[int, StreamFailure] = {}
        #: Keys with dead letters in the stream (a superset: a replay elsewhere may have
        #: emptied one; it is checked against the table before it holds a message).
        self._held_keys: set[str] = set()
        #: How many keys the table had when ``_held_keys`` was last read from it.
        self._held_keys_read = 0
        #: Place -> reason of what is backing off now ("database", "broker NAME"); /health
        #: reads it.
        self._outages: dict[str, str] = {"relay": "starting: not connected yet"}
        #: Why the WAL slot is close to being invalidated, at the last backlog probe (None:
        #: it is not); warned once when it starts, /health reports it without failing.
        self._slot_at_risk: str | None = None
        self._running = False
        #: When ``_still_writable`` last asked (time.monotonic()).
        self._writable_checked = -float("inf")

    @property
    def destination(self) -> str:
        return self.source.book.destination

    @property
    def mode(self) -> str:
        return self.source.mode

    @property
    def failing(self) -> int:
        """Messages that failed and are retried (not yet published or dead-lettered)."""
        return len(self._failures)

    @property
    def _broker(self) -> str:
        """The broker's place in /health, as the table relay names it."""
        return f"broker {self.destination}"

    def health_problems(self) -> list[str]:
        """Why the relay is not healthy now (empty: it is)."""
        problems = [f"{place}: {reason}" for place, reason in sorted(self._outages.items())]
        # As the table relay: a connection the broker closed while the stream idled (seen
        # before the reconnect failed, which a broker that never answers takes its connect
        # timeout to do), or one it blocks (a resource alarm: waves come back unsent).
        if self._running and not {"relay", self._broker} & self._outages.keys():
            problem = self.publisher.problem()
            if problem is not None:
                problems.append(f"{self._broker}: {problem}")
        if not self._running and not problems:
            problems.append("relay: not running")
        return problems

    def health_warnings(self) -> list[str]:
        """What still works but needs an operator soon (/health stays 200, "degraded")."""
        if self._slot_at_risk is None:
            return []
        return [f"slot: {self.source.name}: {self._slot_at_risk}"]

    # ----- the loop ----------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> StreamStats:
        """Publish until ``stop`` is set (or, with ``exit_when_idle``, the stream is read to
        its end). The source must be connected."""
        self._running = True
        try:
            await self._load()
            self._outages.pop("relay", None)
            await self._loop(stop)
        except SlotInvalidatedError as exc:
            # Messages are lost for this destination: an outage retried for ever would hide
            # it. The relay stops (a non-zero exit from the CLI); /health names the slot.
            self._outages["slot"] = redact_text(str(exc))
            logger.error("stream relay stopping: %s", exc)
            raise
        finally:
            self._running = False
        return self.stats

    async def _load(self) -> None:
        self._failures = await self.source.failures()
        if self.abandoned_blocks_key:
            await self._read_held_keys()
        if self._failures:
            logger.info(
                "%s: %d message(s) failed before and are retried with their attempts so far",
                self.source.name,
                len(self._failures),
            )

    async def _loop(self, stop: asyncio.Event) -> None:
        outage = 0.0
        while not stop.is_set():
            if not self.publisher.connected:
                # Before the read, as the table relay before its claim: a batch read on a
                # closed connection would come back unsent, and be read again.
                try:
                    await self.publisher.connect()
                    if not self.publisher.connected:
                        # Lost again before its first use (a broker that closes each new
                        # connection): a failed connect, backed off, not tried again at once.
                        raise BrokerUnavailableError(
                            f"{self.publisher.safe_url} closed the new connection"
                        )
                except PublishError as exc:
                    if not exc.retryable:
                        # Misconfigured (say, an exchange of another type): retrying cannot help.
                        raise ConfigError(
                            f"{self._broker} refuses this configuration: {exc}"
                        ) from exc
                    outage = _next_backoff(outage, self.outage_backoff_max)
                    self._outage(self._broker, exc)
                    logger.warning(
                        "%s: broker unavailable (%s); retrying in %.1fs",
                        self.source.name,
                        exc,
                        outage,
                    )
                    await _sleep(stop, outage)
                    continue
            self._outages.pop(self._broker, None)
            try:
                await self._probe()
                entries = await self.source.read(self.batch_size)
                if not any(entry.message is not None for entry in entries):
                    await self._still_writable()
                done = await self._settle(entries) if entries else _Round()
                self._outages.pop("database", None)
            except Exception as exc:
                if not is_database_outage(exc):
                    raise
                # The round's checkpoint may not be stored: it is read and published again.
                self.stats.outages += 1
                outage = _next_backoff(outage, self.outage_backoff_max)
                self._outage("database", _outage_reason(exc))
                logger.warning(
                    "%s: database unavailable (%s); reconnecting in %.1fs",
                    self.source.name,
                    _outage_reason(exc),
                    outage,
                )
                await _reconnect(
                    self.source,
                    stop,
                    outage,
                    lambda exc: self._outage("database", _outage_reason(exc)),
                    self.outage_backoff_max,
                )
                continue
            outage = 0.0
            if done.stopped is not None:
                await self._wait_after_failure(stop, *done.stopped)
                continue
            if done.unsent:
                # The publisher reconnects at the top of the loop; the pause keeps a
                # publisher that gives messages back unsent while connected from spinning.
                await _sleep(stop, self.poll_interval)
                continue
            if not any(entry.message is not None for entry in entries):
                try:
                    await self.source.idle()
                except Exception as exc:
                    if not is_database_outage(exc):
                        raise
                    continue  # the next read meets the outage and reconnects
                if self.exit_when_idle:
                    return
                await _sleep(stop, self.poll_interval)

    async def _still_writable(self) -> None:
        """While the stream is idle, at most every WRITABLE_CHECK_INTERVAL: StoreError (an
        outage: the relay reconnects) if the source's server refuses writes now. A
        failover that leaves the old primary up, fenced read-only, keeps this connection's
        session there, where reads succeed: an idle relay never wrote (its offset moves
        only with something read), so it read the old primary's rows, nothing new, for
        ever (the log reader until its partition upkeep, hourly), while the writers' rows
        went to the new primary unpublished. Reconnected, a URL naming every host with
        target_session_attrs=read-write (or a DNS name the failover moved) reaches the new
        one; a WAL outbox's slot does not follow a failover, which /health then says."""
        now = time.monotonic()
        if now - self._writable_checked < WRITABLE_CHECK_INTERVAL:
            return
        self._writable_checked = now
        if await self.source.conn.fetchval("SHOW transaction_read_only") == "on":
            raise StoreError(
                "the database refuses writes now (read-only: a failover that left the old "
                "primary up?); reconnecting to find the writable one"
            )

    async def _probe(self) -> None:
        """Measure the backlog (for /metrics) when it is due; on the source's connection,
        between reads, so that it never collides with them."""
        if self.probe_interval is None:
            return
        now = time.monotonic()
        if self.stats.backlog_at is not None and now - self.stats.backlog_at < self.probe_interval:
            return
        self.stats.backlog = await self.source.backlog(BACKLOG_LIMIT)
        self.stats.backlog_at = now
        self._watch_slot(self.stats.backlog)

    def _watch_slot(self, backlog: Backlog) -> None:
        """Warn once when the WAL slot comes close to being invalidated (its messages would
        be lost), not at every probe; say when it is out of danger again."""
        at_risk = backlog.wal_at_risk()
        if at_risk is not None and self._slot_at_risk is None:
            logger.warning(
                "%s is close to being invalidated: %s. Messages not yet published for "
                "destination %r would be lost: get this relay to catch up (is it failing "
                "or down?), or raise max_slot_wal_keep_size",
                self.source.name,
                at_risk,
                self.destination,
            )
        elif at_risk is None and self._slot_at_risk is not None:
            logger.info("%s is no longer close to being invalidated", self.source.name)
        self._slot_at_risk = at_risk

    async def _wait_after_failure(
        self, stop: asyncio.Event, message: Message, outcome: Outcome, attempts: int
    ) -> None:
        self.stats.failed_rounds += 1
        delay = self.backoff.delay_after(attempts, outcome.retry_after)
        logger.warning(
            "%s: message %s (topic %s) failed, attempt %d of %d (%s); the stream waits %.1fs "
            "and goes on from the last confirmed message",
            self.source.name,
            message.id,
            message.topic,
            attempts,
            self.max_attempts,
            outcome.error,
            delay,
        )
        await _sleep(stop, delay)

    async def _settle(self, entries: Sequence[Entry]) -> _Round:
        """Publish the messages of ``entries`` that are not dead already, walk the outcomes
        in stream order, and store the checkpoint past what is done."""
        messages = [entry.message for entry in entries if entry.message is not None]
        poisoned = {
            _seq(entry.message): entry.poison
            for entry in entries
            if entry.message is not None and entry.poison is not None
        }
        held_now = await self._held_among(messages)
        decided: dict[int, DeadLetter] = {}
        outgoing: list[Message] = []
        for message in messages:
            seq = _seq(message)
            known = self._failures.get(seq)
            if seq in poisoned:
                # Unreadable: publishing it cannot succeed, and retrying it would stop the
                # stream (and keep the slot's WAL) for good. Its key, if readable, is held.
                decided[seq] = DeadLetter(message, poisoned[seq], 0)
                self._hold(held_now, message)
            elif known is not None and (known.permanent or known.attempts >= self.max_attempts):
                # Given up before (this process, or one that died before moving past it).
                decided[seq] = DeadLetter(message, known.last_error, known.attempts)
                self._hold(held_now, message)
            elif self._holds(held_now, message):
                decided[seq] = _held_letter(message)
            else:
                outgoing.append(message)
        outcomes = await self.payload.publish(self.publisher, outgoing) if outgoing else []
        outcome_of = {_seq(m): outcome for m, outcome in zip(outgoing, outcomes, strict=True)}
        done = _Round()
        pending = _Round()
        for entry in entries:
            if entry.message is not None and not await self._walk(
                entry.message, decided, outcome_of, held_now, pending
            ):
                break
            if entry.checkpoint is not None:
                done.checkpoint = entry.checkpoint
                done.published += pending.published
                done.letters += pending.letters
                done.cleared += pending.cleared
                pending = _Round(stopped=pending.stopped)
        done.stopped = pending.stopped
        done.unsent = pending.unsent
        if done.checkpoint is not None:
            await self.source.commit(done.checkpoint, done.letters, done.cleared)
            self._committed(done)
        return done

    async def _walk(
        self,
        message: Message,
        decided: dict[int, DeadLetter],
        outcome_of: dict[int, Outcome],
        held_now: set[str],
        pending: _Round,
    ) -> bool:
        """Settle one message of the walk into ``pending``; False where the stream stops."""
        seq = _seq(message)
        if seq in decided:
            pending.letters.append(decided[seq])
            if seq in self._failures:
                pending.cleared.append(seq)
            return True
        outcome = outcome_of[seq]
        if outcome.kind is OutcomeKind.PUBLISHED:
            pending.published.append(message)
            if seq in self._failures:
                pending.cleared.append(seq)
            return True
        if outcome.kind is OutcomeKind.SKIPPED:
            # An earlier message of its key failed in this round and was given up on (a
            # failure that is retried stops the walk before this one).
            if self._holds(held_now, message):
                pending.letters.append(_held_letter(message))
                return True
            return False  # published next round, at once
        if not outcome.attempted:
            # Never sent: the publisher's connection was not open or broke before its turn.
            # Not the message's failure, so no attempt is counted (a flapping broker must
            # not dead-letter messages it never got); the stream stops here and the loop
            # reconnects the publisher before the next read.
            pending.unsent = True
            return False
        error = outcome.error or "unknown error"
        attempts = await self.source.record_failure(message, error)
        self.stats.failed += 1
        failure = StreamFailure(seq, message.id, attempts, error, permanent=not outcome.retryable)
        self._failures[seq] = failure
        if failure.permanent or attempts >= self.max_attempts:
            pending.letters.append(DeadLetter(message, error, attempts))
            pending.cleared.append(seq)
            self._hold(held_now, message)
            return True
        pending.stopped = (message, outcome, attempts)
        return False

    def _committed(self, done: _Round) -> None:
        self.stats.commits += 1
        self.stats.checkpoint_at = time.time()
        self.stats.published += len(done.published)
        for seq in done.cleared:
            self._failures.pop(seq, None)
        for letter in done.letters:
            self.stats.dead_lettered += 1
            self.stats.held += letter.held
            # Only a key that holds its later messages back is remembered: without
            # abandoned_blocks_key nothing reads or prunes the set, which grew by a key per
            # dead letter for the life of the process.
            if self.abandoned_blocks_key and letter.message.key is not None:
                self._held_keys.add(letter.message.key)
            log = logger.info if letter.held else logger.error
            log(
                "%s: message %s (topic %s, key %s) is a dead letter%s: %s",
                self.source.name,
                letter.message.id,
                letter.message.topic,
                letter.message.key,
                "" if letter.held else f" after {letter.attempts} attempt(s)",
                redact_text(letter.error[:500]),
            )
        if self.metrics is not None and done.published:
            self.metrics.observe_confirmed(
                self.destination, [message.created_at for message in done.published]
            )

    async def _held_among(self, messages: Sequence[Message]) -> set[str]:
        """The keys of ``messages`` that have dead letters (abandoned_blocks_key only),
        checked against the table: a replay by the CLI may have emptied some."""
        if not self.abandoned_blocks_key:
            return set()
        if len(self._held_keys) > max(HELD_KEYS_RELOAD, 2 * self._held_keys_read):
            await self._read_held_keys()
        maybe = {m.key for m in messages if m.key is not None and m.key in self._held_keys}
        if not maybe:
            return set()
        still = await self.source.held_keys(maybe)
        self._held_keys -= maybe - still
        return still

    async def _read_held_keys(self) -> None:
        self._held_keys = await self.source.held_keys()
        self._held_keys_read = len(self._held_keys)

    def _holds(self, held_now: set[str], message: Message) -> bool:
        return self.abandoned_blocks_key and message.key is not None and message.key in held_now

    def _hold(self, held_now: set[str], message: Message) -> None:
        if self.abandoned_blocks_key and message.key is not None:
            held_now.add(message.key)

    def _outage(self, place: str, reason: object) -> None:
        self._outages[place] = redact_text(str(reason))[:500]


def _seq(message: Message) -> int:
    return message.stored_seq


def _held_letter(message: Message) -> DeadLetter:
    return DeadLetter(
        message,
        f"held: an earlier message of key {message.key!r} is a dead letter (abandoned_blocks_key)",
        0,
        held=True,
    )


async def run_stream_relay(
    source: StreamSource,
    publisher: Publisher,
    *,
    stop: asyncio.Event,
    batch_size: int = 500,
    poll_interval: float = 0.2,
    max_backoff: float = OUTAGE_BACKOFF_MAX,
    max_attempts: int = 10,
    backoff: Backoff | None = None,
    abandoned_blocks_key: bool = False,
) -> StreamStats:
    """Publish ``source`` through ``publisher`` until ``stop`` is set (see StreamRelay)."""
    relay = StreamRelay(
        source,
        publisher,
        batch_size=batch_size,
        poll_interval=poll_interval,
        max_attempts=max_attempts,
        backoff=backoff or Backoff(0.1, 2.0, max(max_backoff, 0.1), 0.25),
        abandoned_blocks_key=abandoned_blocks_key,
        outage_backoff_max=max_backoff,
    )
    return await relay.run(stop)


def is_database_outage(exc: BaseException) -> bool:
    """Whether ``exc`` means the database connection is gone or refused (the relay waits
    and reconnects), rather than a fault that retrying cannot mend (it propagates)."""
    if isinstance(exc, StoreError | OSError | ConnectionError | TimeoutError):
        return True
    module = type(exc).__module__.split(".", 1)[0]
    if module != "asyncpg":
        return False
    sqlstate = str(getattr(exc, "sqlstate", "") or "")
    name = type(exc).__name__
    # 25006 (read_only_sql_transaction): the server this connection reached is no longer
    # the writable one (a failover that left the old primary up, fenced read-only, or a
    # hot standby): the relay never makes a transaction of its own read-only. The offset's
    # commit (or the partition upkeep) failed there, and the relay stopped with the error;
    # reconnected, a URL naming every host with target_session_attrs=read-write (or a DNS
    # name the failover moved) reaches the new primary, where the offset was replicated.
    if sqlstate == "25006":
        return True
    # 08: connection exceptions; 57P: the server shutting down or not accepting yet.
    return sqlstate.startswith(("08", "57P")) or name in (
        "ConnectionDoesNotExistError",
        "InterfaceError",
        "InternalClientError",
    )


def _outage_reason(exc: BaseException) -> str:
    """What the log and /health say of a database outage. A statement that got no answer
    within its bound ends with asyncpg's TimeoutError, whose text is empty: "database
    unavailable ()" told nobody that the database had stopped answering."""
    if isinstance(exc, TimeoutError) and not str(exc):
        return "the database did not answer in time (TimeoutError)"
    return str(exc)


async def _reconnect(
    source: StreamSource,
    stop: asyncio.Event,
    first_wait: float,
    failed: Callable[[BaseException], None],
    limit: float = OUTAGE_BACKOFF_MAX,
) -> None:
    """Close ``source`` and connect it again, waiting before each try; returns once
    connected or stopped. ``failed`` gets each failed try's error: /health shows why the
    database is out now (a slot dropped meanwhile, a refused login), not the first error
    the lost connection gave (asyncpg's "cannot switch to state …", for ever)."""
    wait = first_wait
    while not stop.is_set():
        try:
            await source.close()
        except Exception as exc:
            if not is_database_outage(exc):
                raise
            logger.info(
                "%s: closing the lost connection failed too: %s",
                source.name,
                _outage_reason(exc),
            )
        await _sleep(stop, wait)
        if stop.is_set():
            return
        try:
            await source.connect()
            logger.warning("%s: reconnected to the database", source.name)
            return
        except Exception as exc:
            if not is_database_outage(exc):
                raise
            failed(exc)
            wait = _next_backoff(wait, limit)  # the relay's outage_backoff_max, not 30 s
            logger.warning(
                "%s: still no database (%s); next try in %.1fs",
                source.name,
                _outage_reason(exc),
                wait,
            )


def _next_backoff(current: float, limit: float) -> float:
    return min(limit, max(0.1, current * 2))


async def _sleep(stop: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except TimeoutError:
        return


def build_source(
    mode: str,
    url: str,
    destination: str,
    *,
    schema: str = "outboxer",
    table: str = "outbox",
    slot_prefix: str | None = None,
    retention_days: int | None = None,
) -> StreamSource:
    """The source of ``mode`` ("log" or "wal") for one destination."""
    if mode == "log":
        from outboxer.stores.pglog import PgLog

        return PgLog(url, schema=schema, table=table).reader(
            destination, retention_days=retention_days
        )
    if mode == "wal":
        from outboxer.stores.pgwal import PgWal

        return PgWal(url, schema=schema, table=table, slot_prefix=slot_prefix).reader(destination)
    raise ConfigError(f"--mode must be log or wal; got {mode!r}")


# ----- dead letters --------------------------------------------------------------------------


@dataclass
class ReplayCounts:
    replayed: int = 0
    failed: int = 0
    #: Chosen letters left for later: behind a letter of their key that failed again (or,
    #: with abandoned_blocks_key, that was not chosen).
    skipped: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"replayed": self.replayed, "failed": self.failed, "skipped": self.skipped}


async def replay_dead_letters(
    source: StreamSource,
    publisher: Publisher,
    *,
    ids: Iterable[str] | None = None,
    abandoned_blocks_key: bool = False,
    payload: PayloadHandling | None = None,
    batch_size: int = 500,
) -> ReplayCounts:
    """Publish a stream's dead letters again, oldest first, and delete each one its broker
    confirmed (one statement each: a crash in between publishes it again, at least once).

    One that fails again stays, with one more attempt and its error, and the later letters
    of its key stay behind it (not attempted: a key's order holds). With
    ``abandoned_blocks_key``, a letter that was not chosen (``ids``) holds back the later
    chosen letters of its key too. The source must be connected (``attach`` is enough); the
    relay of the stream may run meanwhile: a message it holds while the replay runs stays for the next replay.
    """
    book = source.book
    conn = source.conn
    wanted = None if ids is None else {uuid.UUID(str(value)) for value in ids}
    handling = payload or PayloadHandling(book.destination)
    counts = ReplayCounts()
    blocked: set[str] = set()
    letters = await book.letters(conn, 10_000_000)
    chosen: list[Message] = []
    for letter in letters:
        message = letter.message
        picked = wanted is None or message.id in wanted
        if message.key is not None and message.key in blocked:
            counts.skipped += picked
            continue
        if not picked:
            if message.key is not None and abandoned_blocks_key:
                blocked.add(message.key)
            continue
        chosen.append(message)
    if chosen and not publisher.connected:
        await publisher.connect()
    for start in range(0, len(chosen), batch_size):
        batch = [m for m in chosen[start : start + batch_size] if m.key not in blocked]
        counts.skipped += len(chosen[start : start + batch_size]) - len(batch)
        outcomes = await handling.publish(publisher, batch) if batch else []
        for message, outcome in zip(batch, outcomes, strict=True):
            if outcome.kind is OutcomeKind.PUBLISHED:
                await book.execute(conn, "delete_letter", seq=message.seq)
                counts.replayed += 1
                continue
            if outcome.kind is OutcomeKind.SKIPPED:
                counts.skipped += 1
                continue
            error = outcome.error or "unknown error"
            if outcome.attempted:
                await book.execute(
                    conn, "letter_failed_again", seq=message.seq, error=storable_error(error)
                )
            # else never sent (the connection was not open): the letter stays as it was,
            # without an attempt the broker never saw; it still holds its key's later ones.
            counts.failed += 1
            if message.key is not None:
                blocked.add(message.key)
            logger.warning(
                "%s: dead letter %s failed again: %s", source.name, message.id, redact_text(error)
            )
    return counts


# ----- python -m outboxer.streamrelay ---------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m outboxer.streamrelay ARGS``: the same as ``outboxer stream-relay ARGS``
    (``--database`` is accepted for ``--db``)."""
    from outboxer.cli import main as cli_main

    args = [
        "--db" + arg.removeprefix("--database") if arg.partition("=")[0] == "--database" else arg
        for arg in (sys.argv[1:] if argv is None else argv)
    ]
    return cli_main(["stream-relay", *args])


if __name__ == "__main__":
    sys.exit(main())
