"""The relay: claim a batch, publish it, settle it; wake on commit, poll as a fallback.

One relay process serves every configured destination of one outbox table, with
``concurrency`` claim-publish-settle loops per destination. Many relays may run
on one table: the claim query keeps them from owning the same row or overtaking
a key's earlier message.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import signal
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from outboxer import logjson, payload_admin, tracing
from outboxer.brokers import Publisher, create_publisher
from outboxer.brokers.base import Outcome, OutcomeKind
from outboxer.config import Settings
from outboxer.errors import ConfigError, PublishError, SchemaError
from outboxer.message import Message
from outboxer.payload_relay import PayloadHandling
from outboxer.redact import get_logger, redact_text
from outboxer.retry import Backoff

if TYPE_CHECKING:
    from outboxer.metrics import Metrics
from outboxer.stores import (
    Claim,
    Failure,
    Lease,
    SettleResult,
    Store,
    StoreDataError,
    create_store,
)

logger = get_logger("outboxer.relay")

#: Backoff for the relay's own trouble (database or broker unreachable), not per message.
OUTAGE_BACKOFF = Backoff(base=0.2, multiplier=2.0, cap=15.0, jitter=0.25)
#: Recorded instead of a failure's own error text when the database refused to store the
#: outcomes with it (the relay's log has the original).
UNRECORDABLE_ERROR = (
    "publishing failed; the database refused to record the error text (see the relay's log)"
)
#: How long ``health_problems`` names a settle the database refused.
REFUSAL_SHOWN_SECONDS = 300.0
#: A batch's lease is renewed every third of the lock timeout while it is published ...
RENEW_EVERY = 1 / 3
#: ... and its publishing stops once a tenth of the lease is left without a renewal.
LEASE_MARGIN = 1 / 10


@dataclass
class RelayStats:
    claimed: int = 0
    published: int = 0
    failed: int = 0
    abandoned_now: int = 0
    released: int = 0
    lost: int = 0
    batches: int = 0
    cleaned: int = 0
    claim_seconds: float = 0.0
    publish_seconds: float = 0.0
    settle_seconds: float = 0.0
    store_errors: int = 0
    #: Settles the database refused for their values (not an outage); each is retried with
    #: a generic error text, then row by row.
    settles_refused: int = 0
    #: Lease renewals of batches in flight.
    renewals: int = 0
    #: Batches whose publishing stopped because their lease was lost (see Relay._process).
    leases_lost: int = 0
    #: Rows taken over from an expired lease (their relay died or stalled), each alone.
    recovered: int = 0
    #: Outcomes not recorded even row by row: their rows wait for their lease to expire.
    unrecorded: int = 0
    broker_reconnects: int = 0
    started_at: float = field(default_factory=time.time)

    def as_dict(self) -> dict[str, float | int]:
        return dict(self.__dict__)


class Outage:
    """The back-off of one kind of trouble the relay rides out (the database or a broker
    unreachable): it counts consecutive failures, reports each one (a health problem under
    ``place``, a warning line) and waits the outage back-off before the next try.

    ``counts`` are the stats whose ``store_errors`` each failure adds to (none for a broker).
    """

    def __init__(
        self,
        relay: Relay,
        place: str,
        reason: str,
        *,
        log_as: str,
        counts: Sequence[RelayStats] = (),
    ) -> None:
        self.relay = relay
        self.place = place
        self.reason = reason
        self.log_as = log_as
        self.counts = counts
        self.failures = 0

    def count(self) -> float:
        """Count one more failure; return the back-off before the next try."""
        self.failures += 1
        for stats in self.counts:
            stats.store_errors += 1
        return OUTAGE_BACKOFF.delay(self.failures)

    async def back_off(self, exc: BaseException, *, through_stop: bool = False) -> bool:
        """Count and report a failure, then wait the back-off; return whether the relay is
        stopping. The wait ends early when it stops, unless ``through_stop``."""
        delay = self.count()
        self.relay._outage(self.place, f"{self.reason} ({exc})")
        logger.warning("%s (%s); retrying in %.1fs", self.log_as, exc, delay)
        if through_stop:
            await asyncio.sleep(delay)
            return self.relay.stopping
        return await self.relay._sleep(delay)

    def over(self) -> int:
        """The trouble is over: clear the health problem; return how many tries failed."""
        failures, self.failures = self.failures, 0
        self.relay._outage(self.place, None)
        return failures


class RecoveryGate:
    """What this relay holds, so that a row taken over from an expired lease is held alone.

    Its relay may have died because of it. If it kills this relay too, it must die alone:
    only its attempt is counted, not those of rows held beside it (recovered after each
    death in the same order, they would share its fate until their attempts were used up
    too). So a relay that holds a recovered row holds nothing else, any destination, from
    its claim to its settle:

    * a claim may recover only while the relay holds nothing else (``enter_claim``);
    * a claim that may not, and finds a row to recover, takes nothing and says so: the
      relay drains, claiming nothing more until the batches it holds are settled;
    * while a recovered row is held, nobody claims, and it is published only once every
      batch claimed before it is settled (``alone``). One recovered row at a time.
    """

    def __init__(self, stopping: asyncio.Event) -> None:
        self._stopping = stopping
        self._changed = asyncio.Event()
        #: Batches claimed and not yet settled, with claims under way.
        self.held = 0
        self.recovering = False
        self.draining = False

    async def enter_claim(self) -> bool | None:
        """Wait until a claim may run; return whether it may recover (None: stopping)."""
        while self.recovering or (self.draining and self.held):
            if not await self._wait_for_change():
                return None
        self.held += 1
        return self.held == 1

    def claimed(self, batch: Claim | None, recover: bool) -> None:
        """After a claim that was allowed to recover or not (``batch`` None: it failed)."""
        if batch is not None and batch.recovery_waiting:
            self.draining = True
        elif recover:
            self.draining = False  # recovered, or the row is gone: another relay took it
        if batch is not None and batch.recovered:
            self.recovering = True
        if not batch:
            self.settled(recovered=False)

    def settled(self, recovered: bool) -> None:
        """A batch (or a claim that took nothing) holds nothing any more."""
        self.held -= 1
        if recovered:
            self.recovering = False
        self._changed.set()
        self._changed = asyncio.Event()

    async def alone(self) -> None:
        """Wait until the recovered row is the only batch this relay holds."""
        while self.held > 1:
            await self._changed.wait()

    async def _wait_for_change(self) -> bool:
        """Wait for the next change (True) or for the relay to stop (False)."""
        changed = asyncio.create_task(self._changed.wait())
        stopping = asyncio.create_task(self._stopping.wait())
        await asyncio.wait({changed, stopping}, return_when=asyncio.FIRST_COMPLETED)
        await _cancel(changed, stopping)
        return not self._stopping.is_set()


class LeaseKeeper:
    """Keeps a batch's lease while the batch is published, and stops the publish once it is lost.

    The lease counts from when the last renewal (or the claim) was sent: the database's
    clock started it no earlier. It is renewed every third of the lock timeout, one
    statement for the batch. It is lost when a renewal finds rows taken over (the relay
    stalled past its lease), or when a tenth of it is left and no renewal got through: the
    next holder may take the rows over once it ends, and this relay must have stopped
    publishing them by then. A timer on the event loop cancels the publish at that moment,
    before the publishing task can take another step (after a stall, too).
    """

    RAN_OUT = "its lease ran out before a renewal got through"

    def __init__(
        self,
        relay: Relay,
        destination: str,
        batch: Claim,
        claimed_at: float,
        publish: asyncio.Task[Any],
    ) -> None:
        self.relay = relay
        self.destination = destination
        self.batch = batch
        self.publish = publish
        self.lock_timeout = relay.settings.lock_timeout
        #: When the claim or the last renewal that got through was sent (time.monotonic()).
        self.renewed_at = claimed_at
        #: Why the lease was lost, once it is.
        self.lost: str | None = None
        self._deadline: asyncio.TimerHandle | None = None

    @property
    def give_up_at(self) -> float:
        """When this relay stops publishing the batch unless a renewal got through."""
        return self.renewed_at + self.lock_timeout * (1 - LEASE_MARGIN)

    async def keep(self) -> None:
        """Renew until cancelled (the publish ended) or the lease is lost."""
        relay, destination = self.relay, self.destination
        seqs = [message.stored_seq for message in self.batch]
        self._set_deadline()
        next_renewal = self.renewed_at + self.lock_timeout * RENEW_EVERY
        renewals = relay._database_outage(destination, "lease renewal failed")
        try:
            while self.lost is None:
                await asyncio.sleep(max(min(next_renewal, self.give_up_at) - time.monotonic(), 0))
                sent_at = time.monotonic()
                if sent_at >= self.give_up_at:
                    self._lose(self.RAN_OUT)
                    return
                try:
                    renewed = await asyncio.wait_for(
                        relay.store.renew(destination, self.batch.lease, seqs, self.lock_timeout),
                        self.give_up_at - sent_at,
                    )
                except Exception as exc:  # noqa: BLE001 -- database outage: retry while the lease lasts
                    # Not Outage.back_off: the next try must come before the lease runs out.
                    delay = renewals.count()
                    reason = str(exc) or type(exc).__name__
                    relay._outage(renewals.place, f"{renewals.reason} ({reason})")
                    logger.warning(
                        "destination %s: lease renewal failed (%s); %.1fs of the lease left",
                        destination,
                        reason,
                        self.renewed_at + self.lock_timeout - time.monotonic(),
                    )
                    next_renewal = time.monotonic() + delay
                    continue
                if renewed < len(seqs):
                    self._lose(
                        f"{len(seqs) - renewed} of its rows were taken over after its lease "
                        "expired (this relay stalled)"
                    )
                    return
                renewals.over()
                for stats in relay._stats(destination):
                    stats.renewals += 1
                self.renewed_at = sent_at
                self._set_deadline()
                next_renewal = sent_at + self.lock_timeout * RENEW_EVERY
        finally:
            if self._deadline is not None:
                self._deadline.cancel()

    def _set_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        # A delay, not loop.call_at: an event loop's clock need not be time.monotonic().
        self._deadline = asyncio.get_running_loop().call_later(
            max(self.give_up_at - time.monotonic(), 0), self._lose, self.RAN_OUT
        )

    def _lose(self, reason: str) -> None:
        if self.lost is None:
            self.lost = reason
            self.publish.cancel()


@dataclass(frozen=True)
class Settlement:
    """The outcomes one settle records: rows published, failed, and released untried."""

    published: Sequence[int] = ()
    failed: Sequence[Failure] = ()
    released: Sequence[int] = ()

    def __len__(self) -> int:
        return len(self.published) + len(self.failed) + len(self.released)

    def seqs(self) -> list[int]:
        return [*self.published, *(f.seq for f in self.failed), *self.released]

    def with_error(self, text: str) -> Settlement:
        """The same outcomes, every failure recording ``text`` instead of its own error."""
        failed = [dataclasses.replace(f, error=text) for f in self.failed]
        return Settlement(self.published, failed, self.released)

    def rows(self) -> list[Settlement]:
        """One settlement per row, the last row first."""
        rows = [
            *(Settlement(published=[seq]) for seq in self.published),
            *(Settlement(failed=[failure]) for failure in self.failed),
            *(Settlement(released=[seq]) for seq in self.released),
        ]
        return sorted(rows, key=lambda row: row.seqs()[0], reverse=True)


class Relay:
    """Moves committed outbox rows to their brokers: at least once, in order per key."""

    def __init__(
        self,
        store: Store,
        publishers: Mapping[str, Publisher],
        settings: Settings | None = None,
        *,
        envelopes: Mapping[str, str] | None = None,
        payloads: Mapping[str, PayloadHandling] | None = None,
        metrics: Metrics | None = None,
        messaging_systems: Mapping[str, str] | None = None,
    ) -> None:
        if not publishers:
            raise ValueError("a relay needs at least one destination publisher")
        self.store = store
        self.publishers = dict(publishers)
        self.settings = settings or Settings()
        self.envelopes = dict(envelopes or {})
        #: Per destination: decrypt or forward encrypted rows, then the envelope.
        self.payloads = {
            name: (payloads or {}).get(name)
            or PayloadHandling(name, envelope=self.envelopes.get(name, "full"))
            for name in self.publishers
        }
        self.backoff = self.settings.backoff
        self.stats = RelayStats()
        #: The same counters per destination; ``stats`` holds their sums plus what no
        #: destination owns (connecting to the database, cleanup).
        self.destination_stats = {name: RelayStats() for name in self.publishers}
        self._stopping = asyncio.Event()
        self._in_flight: dict[str, int] = dict.fromkeys(self.publishers, 0)
        self._fatal: ConfigError | None = None
        #: What is backing off now, by place ("database", "broker <destination>"): health reads it.
        self._outages: dict[str, str] = {}
        #: Per destination, when the database last refused a settle, and why.
        self._refusals: dict[str, tuple[float, str]] = {}
        self._loops_running = False
        self._gate = RecoveryGate(self._stopping)
        #: Prometheus histograms and gauges (outboxer[metrics]); None without prometheus_client.
        self.metrics = metrics
        if metrics is not None:
            metrics.watch_relay(self)
        #: ``messaging.system`` of each destination's spans, from its broker URL.
        self._systems = dict(messaging_systems or {})

    @classmethod
    def from_settings(cls, settings: Settings) -> Relay:
        store = create_store(settings.require_db(), schema=settings.schema, table=settings.table)
        if not settings.destinations:
            raise ConfigError(
                "no broker: pass --broker URL, set OUTBOXER_BROKER, or name destinations in outboxer.toml"
            )
        publishers = {
            name: create_publisher(
                dest.broker,
                routes=dest.routes,
                publish_timeout=settings.publish_timeout,
                **dest.options,
            )
            for name, dest in settings.destinations.items()
        }
        envelopes = {name: dest.envelope for name, dest in settings.destinations.items()}
        keyring = payload_admin.keyring(settings)
        payloads = {
            name: PayloadHandling(name, dest.payload, keyring, dest.envelope)
            for name, dest in settings.destinations.items()
        }
        systems = {
            name: tracing.messaging_system(dest.broker)
            for name, dest in settings.destinations.items()
        }
        return cls(
            store,
            publishers,
            settings,
            envelopes=envelopes,
            payloads=payloads,
            metrics=_metrics_if_installed(publishers),
            messaging_systems=systems,
        )

    @property
    def relay_id(self) -> str:
        return self.settings.relay_id

    # ----- lifecycle -------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop claiming; batches in flight are published and settled, then ``run`` returns."""
        if not self._stopping.is_set():
            logger.info("relay %s stopping: finishing batches in flight", self.relay_id)
        self._stopping.set()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def health_problems(self) -> list[str]:
        """Why this relay is not publishing right now (empty when its loops run unhindered)."""
        problems = [f"{place}: {reason}" for place, reason in sorted(self._outages.items())]
        for destination, (at, reason) in sorted(self._refusals.items()):
            ago = time.monotonic() - at
            if ago < REFUSAL_SHOWN_SECONDS:
                problems.append(
                    f"destination {destination}: the database refused to record outcomes "
                    f"{ago:.0f}s ago ({reason})"
                )
        if self.stopping:
            problems.append("relay is stopping")
        elif not self._loops_running:
            problems.append("relay is starting: not connected to the database yet")
        return problems

    def _outage(self, place: str, reason: object | None) -> None:
        """Record (reason given) or clear (None) an outage the relay is backing off from."""
        if reason is None:
            self._outages.pop(place, None)
        else:
            self._outages[place] = redact_text(str(reason))  # /health shows it

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop)

    async def run(self) -> RelayStats:
        """Run until ``stop()`` (or, with ``exit_when_idle``, until nothing is due)."""
        if not await self._connect_store():
            return self.stats
        logger.info(
            "relay %s started: destinations %s, batch %d, concurrency %d",
            self.relay_id,
            ", ".join(self.publishers),
            self.settings.batch_size,
            self.settings.concurrency,
        )
        loops = [
            asyncio.create_task(self._loop(name), name=f"outboxer-{name}-{n}")
            for name in self.publishers
            for n in range(self.settings.concurrency)
        ]
        cleanup = asyncio.create_task(self._cleanup_loop(), name="outboxer-cleanup")
        self._loops_running = True
        try:
            await asyncio.gather(*loops)
        finally:
            self._loops_running = False
            self._stopping.set()
            for task in loops:
                task.cancel()
            cleanup.cancel()
            await asyncio.gather(*loops, cleanup, return_exceptions=True)
            for publisher in self.publishers.values():
                with contextlib.suppress(Exception):
                    await publisher.close()
            await self.store.close()
            logger.info("relay %s stopped: %s", self.relay_id, self.stats.as_dict())
        if self._fatal is not None:
            raise self._fatal
        return self.stats

    async def drain(self) -> RelayStats:
        """Publish everything that is due now, then return (``--exit-when-idle``)."""
        self.settings = _with(self.settings, exit_when_idle=True)
        return await self.run()

    # ----- the loop --------------------------------------------------------------------------

    async def _connect_store(self) -> bool:
        """Connect, backing off while the database is down; False if stopped meanwhile."""
        outage = Outage(
            self, "database", "unreachable", log_as="database unreachable", counts=[self.stats]
        )
        while True:
            try:
                await self.store.connect()
                # Fatal, not retried: claims would fail until an operator upgrades the schema.
                await self.store.check_schema()
                outage.over()
                return True
            except SchemaError:
                raise
            except Exception as exc:  # noqa: BLE001 -- the database may be starting: keep trying, never exit
                if await outage.back_off(exc):
                    return False

    def _stats(self, destination: str) -> tuple[RelayStats, RelayStats]:
        """The relay's counters and the destination's: both take every count."""
        return self.stats, self.destination_stats[destination]

    def _database_outage(self, destination: str, reason: str) -> Outage:
        """The back-off of one of a destination's statements while the database is down."""
        return Outage(
            self,
            "database",
            reason,
            log_as=f"destination {destination}: {reason}",
            counts=self._stats(destination),
        )

    async def _ensure_publisher(self, destination: str) -> bool:
        """Connect the destination's publisher, backing off while the broker is down.

        Returns False if the relay was asked to stop meanwhile.
        """
        publisher = self.publishers[destination]
        outage = Outage(
            self,
            f"broker {destination}",
            "unreachable",
            log_as=f"destination {destination}: broker unreachable",
        )
        while not publisher.connected:
            try:
                await publisher.connect()
                if outage.over():
                    logger.info(
                        "destination %s: broker %s is back", destination, publisher.safe_url
                    )
                for stats in self._stats(destination):
                    stats.broker_reconnects += 1
            except Exception as exc:  # noqa: BLE001 -- broker outage: log, back off, try again
                if isinstance(exc, PublishError) and not exc.retryable:
                    # Misconfigured (say, an exchange of another type): retrying cannot help.
                    logger.error(
                        "destination %s: broker refuses this configuration: %s", destination, exc
                    )
                    self._fatal = ConfigError(f"destination {destination}: {exc}")
                    self.stop()
                    return False
                if await outage.back_off(exc):
                    return False
        return True

    async def _loop(self, destination: str) -> None:
        settings = self.settings
        claims = self._database_outage(destination, "claim failed")
        while not self.stopping:
            if not await self._ensure_publisher(destination):
                return
            recover = await self._gate.enter_claim()
            if recover is None:
                return
            self.store.reset_wakeup(destination)
            started = time.perf_counter()
            claimed_at = time.monotonic()  # the lease runs from no later than this
            try:
                batch = await self.store.claim(
                    destination,
                    self.relay_id,
                    settings.batch_size,
                    settings.lock_timeout,
                    settings.abandoned_blocks_key,
                    max_attempts=settings.max_attempts,
                    recover=recover,
                )
            except Exception as exc:  # noqa: BLE001 -- database outage: log, back off, resume by itself
                self._gate.claimed(None, recover)
                await claims.back_off(exc)
                continue
            self._gate.claimed(batch, recover)
            claims.over()
            claim_seconds = time.perf_counter() - started
            for stats in self._stats(destination):
                stats.claim_seconds += claim_seconds
            if self.metrics is not None:
                self.metrics.observe_claim(destination, claim_seconds, len(batch))
            self._log_abandoned(destination, batch)
            if len(batch) == settings.batch_size or batch.recovered:
                # A full batch: there is likely more. A recovered row: its batch-mates are
                # likely next, one a claim. Let another loop help.
                self.store.nudge(destination)
            if not batch:
                if batch.abandoned or batch.recovery_waiting:
                    continue  # their keys' next rows may be due now; or drain, then recover
                if settings.exit_when_idle and self._in_flight[destination] == 0:
                    return
                await self._wait_for_work(
                    destination, settings.poll_interval if not settings.exit_when_idle else 0.05
                )
                continue
            self._in_flight[destination] += 1
            try:
                await self._process(destination, batch, claimed_at)
            finally:
                self._in_flight[destination] -= 1
                self._gate.settled(batch.recovered)
            if (
                len(batch) < settings.batch_size
                and not batch.recovered
                and self.store.gathers_batches
            ):
                # Caught up: a claim at once would take the few rows committed meanwhile, at
                # the cost of two transactions. A short wait gathers a larger batch.
                await self._wait_for_work(destination, settings.poll_interval)

    def _log_abandoned(self, destination: str, batch: Claim) -> None:
        """Say what the claim gave up, and that it recovers a row alone."""
        for row in batch.abandoned:
            for stats in self._stats(destination):
                stats.abandoned_now += 1
            logger.error(
                "destination %s: message %s (topic %s, key %s) abandoned: %s",
                destination,
                row.id,
                row.topic,
                row.key,
                row.error,
                extra=logjson.fields(
                    message_id=row.id,
                    destination=destination,
                    topic=row.topic,
                    error=row.error,
                    relay_id=self.relay_id,
                ),
            )
        if batch.recovered:
            for stats in self._stats(destination):
                stats.recovered += len(batch)
            for message in batch:
                logger.warning(
                    "destination %s: message %s (topic %s) was in flight when its relay died "
                    "or stalled (lease expired); publishing it alone, attempt %d of %d",
                    destination,
                    message.id,
                    message.topic,
                    message.attempts + 1,
                    self.settings.max_attempts,
                )

    async def _process(self, destination: str, batch: Claim, claimed_at: float) -> None:
        """Publish the batch while its lease is kept, then settle it.

        If the lease is lost (taken over, or run out while the database did not answer),
        the publish is cancelled at once, so this loop never publishes a row that its next
        holder publishes too: that would interleave a key's messages. The rows still held
        are then given back; what the broker got meanwhile may be published again.
        """
        for stats in self._stats(destination):
            stats.claimed += len(batch)
            stats.batches += 1
        # Decryption and the stripped envelope come later, per message (PayloadHandling).
        spans = tracing.start_publish_spans(
            batch,
            system=self._systems.get(destination, "unknown"),
            destination_name=lambda message: message.topic,
        )
        publish = asyncio.create_task(self._publish(destination, batch.recovered, spans.messages))
        lease = LeaseKeeper(self, destination, batch, claimed_at, publish)
        keeper = asyncio.create_task(lease.keep())
        try:
            await asyncio.wait({publish})
        except asyncio.CancelledError:
            # Cancelled mid-publish (forced shutdown): nothing is known, give the rows back.
            await _cancel(publish, keeper)
            spans.end([None] * len(batch))
            await asyncio.shield(self._settle(destination, batch, [None] * len(batch)))
            raise
        await _cancel(keeper)
        if publish.cancelled():
            for stats in self._stats(destination):
                stats.leases_lost += 1
            logger.warning(
                "destination %s: stopped publishing a batch of %d: %s; the rows still held "
                "go back to the queue",
                destination,
                len(batch),
                lease.lost or "publishing was cancelled",
            )
            spans.end([None] * len(batch))
            await self._settle(destination, batch, [None] * len(batch))
            return
        outcomes = publish.result()
        spans.end(outcomes)
        if self.metrics is not None:
            self.metrics.observe_confirmed(
                destination,
                [
                    message.created_at
                    for message, outcome in zip(batch, outcomes, strict=True)
                    if outcome is not None and outcome.kind is OutcomeKind.PUBLISHED
                ],
            )
        await self._settle(destination, batch, outcomes)

    async def _publish(
        self, destination: str, recovered: bool, outgoing: Sequence[Message]
    ) -> list[Outcome]:
        """Publish a batch; a recovered row once it is all this relay holds (RecoveryGate)."""
        if recovered:
            await self._gate.alone()
        started = time.perf_counter()
        # Decrypted (or forwarded) and enveloped per destination; a key error fails its
        # message, never the batch.
        outcomes = await self.payloads[destination].publish(self.publishers[destination], outgoing)
        for stats in self._stats(destination):
            stats.publish_seconds += time.perf_counter() - started
        return outcomes

    async def _settle(
        self, destination: str, batch: Claim, outcomes: Sequence[Outcome | None]
    ) -> None:
        published: list[int] = []
        failed: list[Failure] = []
        released: list[int] = []
        retrying: dict[str, list[Message]] = {}
        for message, outcome in zip(batch, outcomes, strict=True):
            if outcome is None or outcome.kind is OutcomeKind.SKIPPED:
                released.append(message.stored_seq)
            elif outcome.kind is OutcomeKind.PUBLISHED:
                published.append(message.stored_seq)
            else:
                permanent = not outcome.retryable
                failure = Failure(
                    message.stored_seq,
                    outcome.error or "unknown error",
                    self.backoff.delay_after(message.attempts + 1, outcome.retry_after),
                    permanent,
                )
                failed.append(failure)
                error = failure.error  # storable: bounded, no NUL, for the log line too
                if permanent or message.attempts + 1 >= self.settings.max_attempts:
                    for stats in self._stats(destination):
                        stats.abandoned_now += 1
                    logger.error(
                        "destination %s: message %s (topic %s) abandoned after %d attempt(s): %s",
                        destination,
                        message.id,
                        message.topic,
                        message.attempts + 1,
                        error,
                        extra=logjson.fields(
                            message_id=message.id,
                            destination=destination,
                            topic=message.topic,
                            attempt=message.attempts + 1,
                            error=error,
                            relay_id=self.relay_id,
                        ),
                    )
                else:
                    retrying.setdefault(error, []).append(message)
        # One line per distinct error, not per message: an outage fails whole batches.
        for error, messages in retrying.items():
            shown = ", ".join(str(m.id) for m in messages[:3]) + (" …" if len(messages) > 3 else "")
            logger.warning(
                "destination %s: %d message(s) failed and will be retried (%s): %s",
                destination,
                len(messages),
                shown,
                error,
                extra=logjson.fields(
                    message_id=messages[0].id if len(messages) == 1 else None,
                    destination=destination,
                    error=error,
                    relay_id=self.relay_id,
                ),
            )
        started = time.perf_counter()
        keys = {message.stored_seq: message.key for message in batch}
        result = await self._record(
            destination, batch.lease, Settlement(published, failed, released), keys
        )
        settle_seconds = time.perf_counter() - started
        if self.metrics is not None:  # the batch is out of this relay's hands either way
            self.metrics.observe_settle(destination, settle_seconds, len(batch))
        if result is None:
            return
        for stats in self._stats(destination):
            stats.settle_seconds += settle_seconds
            stats.published += result.published
            stats.failed += result.failed
            stats.released += result.released
            stats.lost += result.lost
        if result.lost:
            logger.warning(
                "destination %s: %d message(s) were taken over after this relay's lease "
                "expired: it stalled, or could not reach the database to renew it",
                destination,
                result.lost,
            )

    async def _record(
        self,
        destination: str,
        lease: Lease,
        outcomes: Settlement,
        keys: Mapping[int, str | None],
    ) -> SettleResult | None:
        """Settle, riding out outages; None if the relay stopped before the database answered.

        A settle the database refuses for its values (StoreDataError) is not retried as it
        is: the failures' error texts are the likeliest cause, so it is tried once more
        with a generic text, then row by row, so that one row the database refuses cannot
        hold back the others. A row refused even alone stays in flight until its lease
        expires, and so do the earlier rows of its key in the batch (the rows go last
        first): a row of a key must never be PENDING before one in flight, which is
        recovered in seq order (see Store.claim).
        """
        try:
            return await self._settle_answered(destination, lease, outcomes)
        except StoreDataError as exc:
            self._refused(destination, exc, len(outcomes))
        outcomes = outcomes.with_error(UNRECORDABLE_ERROR)
        try:
            return await self._settle_answered(destination, lease, outcomes)
        except StoreDataError as exc:
            self._refused(destination, exc, len(outcomes))
        total = SettleResult()
        refused_keys: set[str] = set()
        for row in outcomes.rows():
            [seq] = row.seqs()
            key = keys.get(seq)
            if key is not None and key in refused_keys:
                for stats in self._stats(destination):
                    stats.unrecorded += 1
                continue
            try:
                result = await self._settle_answered(destination, lease, row)
            except StoreDataError as exc:
                for stats in self._stats(destination):
                    stats.unrecorded += 1
                if key is not None:
                    refused_keys.add(key)
                logger.error(
                    "destination %s: the database refuses to record the outcome of the row "
                    "with seq %d (%s); it stays in flight until its lease expires, with the "
                    "earlier rows of its key (%s) in this batch",
                    destination,
                    seq,
                    exc,
                    key,
                )
                continue
            if result is None:
                return None
            total.published += result.published
            total.failed += result.failed
            total.released += result.released
            total.lost += result.lost
        return total

    def _refused(self, destination: str, exc: StoreDataError, outcomes: int) -> None:
        for stats in self._stats(destination):
            stats.settles_refused += 1
        self._refusals[destination] = (time.monotonic(), redact_text(str(exc)))
        logger.error(
            "destination %s: the database refused to record %d outcome(s): %s",
            destination,
            outcomes,
            exc,
        )

    async def _settle_answered(
        self, destination: str, lease: Lease, outcomes: Settlement
    ) -> SettleResult | None:
        """One settle, retried while the database is unreachable; None if the relay stopped
        first. StoreDataError (refused values) is raised at once: retrying cannot help."""
        # Settling must not be given up lightly: the broker already has these messages.
        # Retry until the database answers; if this relay dies first, the lock expires and
        # another relay publishes them again (a duplicate, never a loss).
        outage = self._database_outage(destination, "settle failed")
        while True:
            try:
                result = await self.store.settle(
                    destination,
                    lease,
                    outcomes.published,
                    outcomes.failed,
                    outcomes.released,
                    self.settings.max_attempts,
                )
                outage.over()
                return result
            except StoreDataError:
                raise
            except Exception as exc:  # noqa: BLE001 -- database outage during settle
                if self.stopping and outage.failures >= 3:
                    outage.count()
                    logger.error(
                        "destination %s: could not record %d outcomes (%s); their locks "
                        "expire and they will be published again",
                        destination,
                        len(outcomes),
                        exc,
                    )
                    return None
                await outage.back_off(exc, through_stop=True)

    async def _wait_for_work(self, destination: str, timeout: float) -> None:
        waiter = asyncio.create_task(self.store.wait_for_wakeup(destination, timeout))
        stopper = asyncio.create_task(self._stopping.wait())
        try:
            await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (waiter, stopper):
                task.cancel()
            await asyncio.gather(waiter, stopper, return_exceptions=True)
        if waiter.done() and not waiter.cancelled() and waiter.exception() is not None:
            logger.warning("waiting for wake-ups failed: %s", waiter.exception())
            await self._sleep(timeout)

    async def _sleep(self, seconds: float) -> bool:
        """Sleep, or return early (True) when the relay is asked to stop."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)
        return self.stopping

    # ----- retention -------------------------------------------------------------------------

    async def _cleanup_loop(self) -> None:
        while not self.stopping:
            try:
                self.stats.cleaned += await cleanup(self.store, self.settings)
            except Exception as exc:  # noqa: BLE001 -- retention can wait for the next round
                logger.warning("cleanup failed: %s", exc)
            if await self._sleep(self.settings.cleanup_interval):
                return


async def cleanup(store: Store, settings: Settings, max_batches: int = 100) -> int:
    """Delete finished rows past their retention in bounded batches; return how many."""
    deleted = 0
    steps: list[Callable[[], Awaitable[int]]] = [
        functools.partial(
            store.cleanup, "PUBLISHED", settings.published_retention, settings.cleanup_batch
        ),
        functools.partial(
            store.cleanup, "ABANDONED", settings.abandoned_retention, settings.cleanup_batch
        ),
        functools.partial(store.cleanup_inbox, settings.inbox_retention, settings.cleanup_batch),
    ]
    for step in steps:
        for _ in range(max_batches):
            count = await step()
            deleted += count
            if count < settings.cleanup_batch:
                break
            await asyncio.sleep(0)  # let the relay's loops run between batches
    if deleted:
        logger.info("cleanup deleted %d finished message(s)", deleted)
    # The claim-check objects no row refers to any more: those of the rows just deleted.
    objects = await asyncio.to_thread(payload_admin.sweep_claim_checks, settings)
    if objects:
        logger.info("cleanup deleted %d claim-check object(s)", objects)
    return deleted


async def _cancel(*tasks: asyncio.Task[Any]) -> None:
    """Cancel ``tasks`` and wait until they have ended."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _with(settings: Settings, **changes: object) -> Settings:
    return dataclasses.replace(settings, **changes)  # type: ignore[arg-type]


def _metrics_if_installed(publishers: Mapping[str, Publisher]) -> Metrics | None:
    """A ``Metrics`` of the relay's destinations, or None without prometheus_client."""
    from outboxer.errors import MissingDependencyError
    from outboxer.metrics import Metrics

    try:
        return Metrics(publishers)
    except MissingDependencyError:
        return None
