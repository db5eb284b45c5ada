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
import json
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from outboxer import logjson, payload_admin, tracing
from outboxer.brokers import Publisher, create_publisher
from outboxer.brokers.base import Outcome, OutcomeKind, describe
from outboxer.claimcheck import ClaimCheckSweepTimeoutError, in_daemon_thread
from outboxer.config import DEFAULT_DATABASE, DestinationSettings, Settings
from outboxer.errors import ConfigError, InsecureConnectionError, PublishError, SchemaError
from outboxer.message import Message
from outboxer.payload_relay import PayloadHandling
from outboxer.redact import Log, get_logger, redact_text
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
from outboxer.stores.pgpartitions import PartitionPolicy

logger = get_logger("outboxer.relay")
_T = TypeVar("_T")


class DatabaseLog(logging.LoggerAdapter[logging.Logger]):
    """The log of a relay beside others in one process: each line starts ``database NAME:``
    and carries the ``database`` field (``--log-format json``)."""

    def __init__(self, base: logging.Logger, database: str) -> None:
        super().__init__(base, {"database": database})
        self.database = database

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        kwargs["extra"] = {**(kwargs.get("extra") or {}), "database": self.database}
        return f"database {self.database}: {msg}", kwargs


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
#: A recovered row given back unpublished: the relay stopped before it was alone.
NOT_ALONE = Outcome(
    OutcomeKind.SKIPPED, "not attempted: the relay stopped before the recovered row was alone"
)
#: After a batch whose keys a claim may have passed over: how long the batch's loop leaves
#: the claim that takes their next rows to another loop (see Relay._loop).
FREED_KEY_GRACE = 0.01
#: A claim of one of several databases still unanswered after this long is taken for hung
#: (its database stopped answering): the RecoveryGate stops counting it (park_claim).
#: Claims answer in milliseconds, a slow one under lock waits in a few hundred.
HUNG_CLAIM = 1.0
#: Likewise a settle of one of several databases (its batch published already): the
#: RecoveryGate stops counting its batch (park) before the first failure, which a database
#: that hangs gives only after the driver's timeout (a minute), or never. Settles answer in
#: milliseconds; one parked while merely slow costs nothing: its batch is published already.
HUNG_SETTLE = 1.0
#: How long a forced shutdown waits for the answer of a claim it cut short, to give back
#: what the claim took (Relay._give_back_cut_claim): a claim answers in milliseconds, and a
#: forced shutdown must end at once, a database that hangs or not.
CUT_CLAIM_WAIT = 0.25
#: A batch given back unpublished: claimed while another database's recovered row was held.
BESIDE_RECOVERY = Outcome(
    OutcomeKind.SKIPPED, "not attempted: another database's recovered row is published alone"
)


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
    #: Claim-check sweeps of the cleanup that failed (the object store did not answer in
    #: time, or erred): orphaned objects wait for the next round; rows' retention went on.
    claim_check_sweep_failures: int = 0
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
        self.relay.log.warning("%s (%s); retrying in %.1fs", self.log_as, exc, delay)
        if through_stop:
            await asyncio.sleep(delay)
            return self.relay.stopping
        return await self.relay._sleep(delay)

    def over(self) -> int:
        """The trouble is over: clear the health problem; return how many tries failed."""
        failures, self.failures = self.failures, 0
        self.relay._outage(self.place, None)
        return failures


@dataclass
class HeldBatch:
    """A batch a relay holds from its claim to its settle, as the RecoveryGate counts it."""

    database: str
    recovered: bool
    #: Its settle is waiting for its database to answer (see RecoveryGate.park).
    parked: bool = False
    #: Until when (time.monotonic()) its lease surely holds in the database: nobody can
    #: have taken its rows over before (see Relay._settle_answered).
    lease_until: float | None = None


class RecoveryGate:
    """What the relays of a process hold, so that a row taken over from an expired lease is
    held alone.

    Its relay may have died because of it. If it kills this process too, it must die alone:
    only its attempt is counted, not those of rows held beside it (recovered after each
    death in the same order, they would share its fate until their attempts were used up
    too). So a process that holds a recovered row holds nothing else, any destination, any
    database, from its claim to its settle:

    * a claim may recover only while its database's relay holds nothing else
      (``enter_claim``);
    * a claim that may not, and finds a row to recover, takes nothing and says so: that
      relay drains, claiming nothing more until the batches it holds are settled;
    * while a recovered row is held, nobody claims, in any database, and it is published
      only once every batch claimed before it, in any database, is settled (``alone``).
      One recovered row at a time: one claim in the process at a time may recover
      (``recovery_claim``), so two databases cannot each recover a row at once and then
      wait for each other in ``alone``.

    A batch whose settle waits for an unreachable database is *parked*: its publishing is
    over, and it no longer counts as held. Otherwise one database that is down with a batch
    unsettled would stop the others' recoveries, and a recovered row whose database went
    down before its settle would stop every database's claims, until it came back. Only a
    gate of several databases parks (``parks``): a relay alone has no others to hold up.

    A claim unanswered for ``HUNG_CLAIM`` is parked too (``park_claim``): its database may
    be hanging, and the claim with it for the driver's timeout (a minute) or for ever. It
    no longer counts as held nor holds the recovery slot, or one database that hangs would
    stop every other's recoveries, and with them their claims. What a parked claim brings
    back while a recovered row is held or may be claimed is never held beside it: it is
    given back unpublished (``claimed`` returns False).
    """

    def __init__(self, stopping: asyncio.Event | None = None, *, parks: bool = False) -> None:
        #: What ends a wait in ``enter_claim`` when the caller gives no event of its own.
        self._stopping = stopping if stopping is not None else asyncio.Event()
        self.parks = parks
        self._changed = asyncio.Event()
        #: Per database: claims under way and batches claimed and not yet settled ...
        self._held: dict[str, int] = {}
        #: ... and of those, the batches parked.
        self._parked: dict[str, int] = {}
        #: A recovered row is held (and not parked).
        self.recovering = False
        #: A claim allowed to recover is under way (from ``enter_claim`` to ``claimed``).
        #: Counted per process, not per database: two databases each allowed a recovery at
        #: once (both woken by one settle) would each hold a recovered row, and each
        #: ``alone`` would wait for the other's forever.
        self.recovery_claim = False
        #: Databases where a row waits to be recovered: their relays drain.
        self._waiting: set[str] = set()

    @property
    def held(self) -> int:
        """Claims under way and batches not yet settled, every database."""
        return sum(self._held.values())

    @property
    def draining(self) -> bool:
        return bool(self._waiting)

    def active(self, database: str | None = None) -> int:
        """What is held and not parked: in ``database``, or in every one (None)."""
        if database is not None:
            return self._held.get(database, 0) - self._parked.get(database, 0)
        return self.held - sum(self._parked.values())

    async def enter_claim(
        self, database: str = DEFAULT_DATABASE, stopping: asyncio.Event | None = None
    ) -> bool | None:
        """Wait until a claim in ``database`` may run; return whether it may recover (None:
        ``stopping`` was set)."""
        while self.recovering or (
            # A database that drains for a recovery waits until it holds nothing and no
            # other claim of the process may recover: then its next claim may.
            database in self._waiting and (self.active(database) or self.recovery_claim)
        ):
            if not await self._wait_for_change(stopping or self._stopping):
                return None
        self._held[database] = self._held.get(database, 0) + 1
        recover = self.active(database) == 1 and not self.recovery_claim
        if recover:
            self.recovery_claim = True
        return recover

    def park_claim(self, claim: HeldBatch, recover: bool) -> None:
        """``claim`` (under way) is taken for hung: it stops counting, and gives up the
        recovery slot if it held it (once)."""
        if claim.parked or not self.parks:
            return
        claim.parked = True
        self._parked[claim.database] = self._parked.get(claim.database, 0) + 1
        if recover:
            self.recovery_claim = False
        self._notify()

    def claimed(
        self,
        batch: Claim | None,
        recover: bool,
        database: str = DEFAULT_DATABASE,
        claim: HeldBatch | None = None,
    ) -> bool:
        """After a claim that was allowed to recover or not (``batch`` None: it failed or
        was cancelled). Every claim ``enter_claim`` let run reports here, exactly once,
        with the ``claim`` given to ``park_claim`` if any.

        Returns whether the batch may be published. False: the claim was parked, and a
        recovered row is held meanwhile, or may be (a recovery claim is under way); the
        caller gives the batch back unpublished, then calls ``settled(recovered=False)``."""
        if claim is not None and claim.parked:
            claim.parked = False
            self._parked[database] -= 1
            if bool(batch) and (self.recovering or self.recovery_claim):
                # Nobody waited for it: held now, it would be beside that recovered row.
                if batch is not None and batch.recovery_waiting:
                    self._waiting.add(database)
                self._notify()
                return False
            recover = False  # its slot was given up: it is not this claim's to release
        if recover:
            self.recovery_claim = False
            if not (batch is not None and batch.recovered):
                self._notify()  # a draining database may recover now
        if batch is not None and batch.recovery_waiting:
            self._waiting.add(database)
        elif recover:
            # Recovered, or the row is gone (another relay took it), or the claim failed.
            self._waiting.discard(database)
        if batch is not None and batch.recovered:
            self.recovering = True
        if not batch:
            self.settled(recovered=False, database=database)
        return True

    def park(self, held: HeldBatch) -> None:
        """``held``'s settle waits for its database: it stops counting (once)."""
        if held.parked or not self.parks:
            return
        held.parked = True
        self._parked[held.database] = self._parked.get(held.database, 0) + 1
        if held.recovered:
            self.recovering = False
        self._notify()

    def settled(
        self, recovered: bool, database: str = DEFAULT_DATABASE, *, parked: bool = False
    ) -> None:
        """A batch (or a claim that took nothing) holds nothing any more."""
        self._held[database] -= 1
        if parked:
            self._parked[database] -= 1
        elif recovered:
            self.recovering = False
        self._notify()

    async def alone(self, stopping: asyncio.Event | None = None) -> bool:
        """Wait until the recovered row is the only batch the process holds (True), or
        until ``stopping`` is set (False: the caller gives the row back unpublished)."""
        stopping = stopping or self._stopping
        while self.active() > 1:
            if not await self._wait_for_change(stopping):
                return False
        return True

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait_for_change(self, stopping: asyncio.Event) -> bool:
        """Wait for the next change (True) or for ``stopping`` (False)."""
        changed = asyncio.create_task(self._changed.wait())
        stopped = asyncio.create_task(stopping.wait())
        await asyncio.wait({changed, stopped}, return_when=asyncio.FIRST_COMPLETED)
        await _cancel(changed, stopped)
        return not stopping.is_set()


class LeaseKeeper:
    """Keeps a batch's lease while the batch is published, and stops the publish once it is lost.

    The lease counts from when the last renewal (or the claim) was sent: the database's
    clock started it no earlier. It is renewed every third of the lock timeout, one
    statement for the batch. It is lost when a renewal finds rows taken over (the relay
    stalled past its lease), or when a tenth of it is left and no renewal got through: the
    next holder may take the rows over once it ends, and this relay must have stopped
    publishing them by then. A timer on the event loop cancels the publish at that moment,
    before the publishing task can take another step (after a stall, too).

    Most batches are published long before their first renewal: until then the keeper is
    one timer (``start``), and its renewing task starts only when that timer fires. The
    timer fires before the deadline would, and checks it: after a stall past the deadline
    it cancels the publish as the deadline's timer would have. ``stop`` disarms it all
    before the publishing task takes its next step, so a lease lost once the publish has
    ended cancels nothing (the publish may be the relay loop's own task).
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
        self._first_renewal: asyncio.TimerHandle | None = None
        self._renewing: asyncio.Task[None] | None = None
        self._stopped = False

    @property
    def give_up_at(self) -> float:
        """When this relay stops publishing the batch unless a renewal got through."""
        return self.renewed_at + self.lock_timeout * (1 - LEASE_MARGIN)

    def start(self) -> None:
        """Arm the first renewal (a delay, as in ``_set_deadline``)."""
        due = self.renewed_at + self.lock_timeout * RENEW_EVERY
        self._first_renewal = asyncio.get_running_loop().call_later(
            max(due - time.monotonic(), 0), self._renewal_due
        )

    def _renewal_due(self) -> None:
        self._first_renewal = None
        if time.monotonic() >= self.give_up_at:  # stalled past the lease: stop right now
            self._lose(self.RAN_OUT)
            return
        self._renewing = asyncio.get_running_loop().create_task(self.keep())

    def stop(self) -> asyncio.Task[None] | None:
        """The publish ended (or is being abandoned): no more renewals, nothing cancelled
        from now on. Returns the renewing task, if one started, for the caller to await
        its end."""
        self._stopped = True
        if self._first_renewal is not None:
            self._first_renewal.cancel()
            self._first_renewal = None
        if self._deadline is not None:
            self._deadline.cancel()
        if self._renewing is not None:
            self._renewing.cancel()
        return self._renewing

    async def keep(self) -> None:
        """Renew until cancelled (the publish ended) or the lease is lost."""
        relay, destination = self.relay, self.destination
        seqs = [message.stored_seq for message in self.batch]
        self._set_deadline()
        next_renewal = self.renewed_at + self.lock_timeout * RENEW_EVERY
        renewals = relay._database_outage(destination, "lease renewal failed")
        try:
            # ``_stopped`` as well as the cancellation: Python 3.11's ``asyncio.wait_for``
            # drops a cancellation that arrives as its awaitable ends, and a keeper that
            # missed its stop renewed for ever while its relay loop waited for it to end.
            while self.lost is None and not self._stopped:
                await asyncio.sleep(max(min(next_renewal, self.give_up_at) - time.monotonic(), 0))
                sent_at = time.monotonic()
                if sent_at >= self.give_up_at:
                    self._lose(self.RAN_OUT)
                    return
                try:
                    # asyncio.timeout, not wait_for: it never swallows a cancellation.
                    async with asyncio.timeout(self.give_up_at - sent_at):
                        renewed = await relay.store.renew(
                            destination, self.batch.lease, seqs, self.lock_timeout
                        )
                except Exception as exc:  # noqa: BLE001 -- database outage: retry while the lease lasts
                    # Not Outage.back_off: the next try must come before the lease runs out.
                    delay = renewals.count()
                    reason = str(exc) or type(exc).__name__
                    relay._outage(renewals.place, f"{renewals.reason} ({reason})")
                    relay.log.warning(
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
        if self.lost is None and not self._stopped:
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
        gate: RecoveryGate | None = None,
        owns_publishers: bool = True,
    ) -> None:
        """``gate`` and ``owns_publishers``: for a relay beside others in one process (see
        outboxer.relay_group), the process's RecoveryGate, and whether ``run`` closes the
        publishers when it ends (not when they are shared)."""
        if not publishers:
            raise ValueError("a relay needs at least one destination publisher")
        self.store = store
        self.publishers = dict(publishers)
        self.settings = settings or Settings()
        #: The database's name (the ``database`` label of its metrics).
        self.database = self.settings.database_name
        #: Log lines name the database once it has a name (several in one process).
        self.log: Log = (
            DatabaseLog(logger, self.database) if self.settings.database is not None else logger
        )
        self.owns_publishers = owns_publishers
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
        self.store.configure_wakeups(
            wake_on_commit_below=self.settings.wake_on_commit_below,
            busy_poll_interval=self.settings.busy_poll_interval,
        )
        self._stopping = asyncio.Event()
        #: Loops waiting for work (see _wait_for_work), and whether stop() ended the wait.
        self._waiting: dict[asyncio.Task[Any], bool] = {}
        self._in_flight: dict[str, int] = dict.fromkeys(self.publishers, 0)
        #: Per destination: claims that found nothing while a batch of it was in flight.
        #: Such a claim may have passed over a row whose key that batch held (a key's rows
        #: go in order), and no NOTIFY may come for that row again: see _loop.
        self._empty_while_in_flight: dict[str, int] = dict.fromkeys(self.publishers, 0)
        self._claims_sent: dict[str, int] = dict.fromkeys(self.publishers, 0)
        self._fatal: ConfigError | None = None
        #: What is backing off now, by place ("database", "broker <destination>"): health reads it.
        self._outages: dict[str, str] = {}
        #: Per destination, when the database last refused a settle, and why.
        self._refusals: dict[str, tuple[float, str]] = {}
        self._loops_running = False
        #: The claim-publish-settle loops while ``run`` runs (``force_stop`` cancels them).
        self._loops: list[asyncio.Task[None]] = []
        #: ``force_stop`` was called: a loop cancelled by it ends quietly once its batch
        #: has been given back.
        self._forced = False
        #: Loops whose claim is under way (force_stop lets it answer: CUT_CLAIM_WAIT).
        self._claiming: set[asyncio.Task[Any] | None] = set()
        #: Cuts the batches in flight short ``shutdown_timeout`` after ``stop``.
        self._deadline: asyncio.TimerHandle | None = None
        self._gate = gate if gate is not None else RecoveryGate(self._stopping)
        #: Prometheus histograms and gauges (outboxer[metrics]); None without prometheus_client.
        self.metrics = metrics
        if metrics is not None:
            metrics.add_series(self.database, self.publishers)
            metrics.watch_relay(self)
        #: ``messaging.system`` of each destination's spans, from its broker URL.
        self._systems = dict(messaging_systems or {})

    @classmethod
    def from_settings(
        cls,
        settings: Settings,
        *,
        pool: PublisherPool | None = None,
        gate: RecoveryGate | None = None,
        metrics: Metrics | None = None,
    ) -> Relay:
        """The relay of one database's settings. Beside others in one process (RelayGroup),
        the process's publishers (``pool``, which closes them), RecoveryGate and metrics;
        alone, publishers and metrics of its own."""
        store = create_store(settings.require_db(), schema=settings.schema, table=settings.table)
        if not settings.destinations:
            raise ConfigError(
                "no broker: pass --broker URL, set OUTBOXER_BROKER, or name destinations in outboxer.toml"
            )
        if pool is None:  # a publisher per destination, as ever
            publishers = {
                name: PublisherPool().publisher(dest, settings.publish_timeout)
                for name, dest in settings.destinations.items()
            }
            metrics = metrics_if_installed()
        else:
            publishers = {
                name: pool.publisher(dest, settings.publish_timeout)
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
            metrics=metrics,
            messaging_systems=systems,
            gate=gate,
            owns_publishers=pool is None,
        )

    @property
    def relay_id(self) -> str:
        return self.settings.relay_id

    # ----- lifecycle -------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop claiming; batches in flight are published and settled, then ``run`` returns.

        Those still in flight ``shutdown_timeout`` later are cut short (``force_stop``): a
        batch may take several ``publish_timeout`` to publish, longer than an orchestrator
        waits before SIGKILL, which would leave its rows in flight until their lease
        expires, and charge them an attempt."""
        if not self._stopping.is_set():
            self.log.info(
                "relay %s stopping: finishing batches in flight (at most %.0fs)",
                self.relay_id,
                self.settings.shutdown_timeout,
            )
            with contextlib.suppress(RuntimeError):  # no event loop: nothing runs to cut short
                self._deadline = asyncio.get_running_loop().call_later(
                    self.settings.shutdown_timeout, self._shutdown_timed_out
                )
        self._stopping.set()
        for task, interrupted in self._waiting.items():
            if not interrupted:
                self._waiting[task] = True
                task.cancel()

    def force_stop(self) -> None:
        """Stop at once: the batches in flight are cut short; the outcomes the broker gave
        for their waves that ended are recorded (published, failed), and the rest (the
        wave in flight, the later ones) is given back with no attempt counted (what the
        broker got of them may be published again, as at-least-once allows); then ``run``
        returns."""
        self.stop()
        if self._forced:
            return
        self._forced = True
        busy = [task for task in self._loops if not task.done()]
        if busy:
            self.log.warning(
                "relay %s: shutting down now; batches in flight go back to the queue",
                self.relay_id,
            )
        for task in busy:
            if task in self._claiming:
                # Its claim may commit whatever we do: let it answer, and give back what it
                # took (_claim_publish_settle), unless it does not answer in time.
                asyncio.get_running_loop().call_later(CUT_CLAIM_WAIT, self._cut_claim, task)
            else:
                task.cancel()

    def _shutdown_timed_out(self) -> None:
        if any(not task.done() for task in self._loops):
            self.log.warning(
                "relay %s: batches still in flight %.0fs after stopping (shutdown_timeout)",
                self.relay_id,
                self.settings.shutdown_timeout,
            )
        self.force_stop()

    def signalled(self) -> None:
        """SIGTERM or SIGINT: the first stops the relay, the next one forces it."""
        if self.stopping:
            self.force_stop()
        else:
            self.stop()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def health_problems(self) -> list[str]:
        """Why this relay is not publishing right now (empty when its loops run unhindered)."""
        problems = [f"{place}: {reason}" for place, reason in sorted(self._outages.items())]
        for destination, publisher in self.publishers.items():
            # Known down (its connection closed) before a reconnect has failed: that takes
            # the broker's connect timeout where it accepts connections but never answers.
            # Blocked (a RabbitMQ resource alarm): connected, but its waves come back unsent.
            place = f"broker {destination}"
            problem = publisher.problem()
            if self._loops_running and place not in self._outages and problem is not None:
                problems.append(f"{place}: {problem}")
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
            loop.add_signal_handler(sig, self.signalled)

    async def run(self) -> RelayStats:
        """Run until ``stop()`` (or, with ``exit_when_idle``, until nothing is due)."""
        if not await self._connect_store():
            return self.stats
        self.log.info(
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
        self._loops = loops
        self._loops_running = True
        if self._forced:  # forced before the loops started
            for task in loops:
                task.cancel()
        try:
            await asyncio.gather(*loops)
        finally:
            self._loops_running = False
            self._stopping.set()
            if self._deadline is not None:
                self._deadline.cancel()
            for task in loops:
                task.cancel()
            cleanup.cancel()
            await asyncio.gather(*loops, cleanup, return_exceptions=True)
            if self.owns_publishers:
                for publisher in self.publishers.values():
                    with contextlib.suppress(Exception):
                        await publisher.close()
            await self.store.close()
            self.log.info("relay %s stopped: %s", self.relay_id, self.stats.as_dict())
        if self._fatal is not None:
            raise self._fatal
        return self.stats

    async def drain(self) -> RelayStats:
        """Publish everything that is due now, then return (``--exit-when-idle``)."""
        self.settings = _with(self.settings, exit_when_idle=True)
        return await self.run()

    # ----- the loop --------------------------------------------------------------------------

    async def _connect_store(self) -> bool:
        """Connect, backing off while the database is down; False if stopped meanwhile.

        A stop abandons a connect under way: it has nothing to finish, and a database that
        does not answer (a stalled network) held the shutdown for the driver's timeout (a
        minute), through ``shutdown_timeout`` and a second SIGTERM."""
        outage = Outage(
            self, "database", "unreachable", log_as="database unreachable", counts=[self.stats]
        )
        while True:
            attempt = await self._unless_stopped(self._connect_checked())
            if attempt.cancelled():
                await self.store.close()  # what the attempt opened (bounded)
                return False
            try:
                attempt.result()
                outage.over()
                return True
            except (SchemaError, InsecureConnectionError):  # no outage: retrying cannot help
                # run() closes the store only once the loops ran: without this, aiomysql's
                # pool outlived the event loop and its finalizer printed a traceback
                # ("Event loop is closed") after the refusal, as if the relay had crashed.
                try:
                    await self.store.close()
                except Exception as close_error:  # noqa: BLE001 -- the refusal is what to report
                    self.log.warning(
                        "closing the database connections after the refusal failed: %s",
                        describe(close_error),
                    )
                raise
            except Exception as exc:  # noqa: BLE001 -- the database may be starting: keep trying, never exit
                if await outage.back_off(exc):
                    return False

    async def _connect_checked(self) -> None:
        await self.store.connect()
        # Fatal, not retried: claims would fail until an operator upgrades the schema.
        await self.store.check_schema()

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
                connected = await self._connect_unless_stopped(publisher)
                if connected is None:
                    return False
                if not publisher.connected:
                    # Lost again before its first use (a broker that closes each new
                    # connection): a failed connect, backed off, not tried again at once.
                    raise ConnectionError(f"{publisher.safe_url} closed the new connection")
                if outage.over():
                    self.log.info(
                        "destination %s: broker %s is back", destination, publisher.safe_url
                    )
                # Only the loop that connected counts: the others (``concurrency``, or
                # another database's relay sharing the publisher) waited for it.
                for stats in self._stats(destination) if connected else ():
                    stats.broker_reconnects += 1
            except Exception as exc:  # noqa: BLE001 -- broker outage: log, back off, try again
                if isinstance(exc, PublishError) and not exc.retryable:
                    # Misconfigured (say, an exchange of another type): retrying cannot help.
                    self.log.error(
                        "destination %s: broker refuses this configuration: %s", destination, exc
                    )
                    self._fatal = ConfigError(f"destination {destination}: {exc}")
                    self.stop()
                    return False
                if await outage.back_off(exc):
                    return False
        return True

    async def _connect_unless_stopped(self, publisher: Publisher) -> bool | None:
        """``publisher.connect()``, abandoned once the relay stops (None), as a timeout
        abandons it: the loop asking holds no batch, so it has nothing to finish.

        A connect to a broker that accepts and never answers, or whose name the resolver
        holds, lasts ``publish_timeout``; each loop sharing the publisher (``concurrency``)
        then tried one more after the stop, one after another under the publisher's lock,
        and the relay exited only when ``shutdown_timeout`` forced it, cutting the other
        destinations' batches in flight short too."""
        if self.stopping:
            return None
        attempt = await self._unless_stopped(publisher.connect())
        if attempt.cancelled():
            return None
        return attempt.result()

    async def _unless_stopped(self, call: Coroutine[Any, Any, _T]) -> asyncio.Future[_T]:
        """``call`` run until it ends or the relay stops, whichever comes first: its future,
        cancelled (and ended) if the stop came first."""
        attempt = asyncio.ensure_future(call)
        stopped = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait({attempt, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            await _cancel(stopped, attempt)  # the attempt only if it is still under way
        return attempt

    async def _connect_once(self, destination: str) -> bool:
        """One connect of the destination's publisher, no back-off: False if the broker
        refuses the configuration (the relay stops, as ``_ensure_publisher`` would) or the
        relay stopped meanwhile."""
        publisher = self.publishers[destination]
        if publisher.connected:
            return True
        try:
            if await self._connect_unless_stopped(publisher) is None:
                return False
        except PublishError as exc:
            if not exc.retryable:
                return await self._ensure_publisher(destination)  # records it, stops the relay
            self.log.warning(
                "destination %s: broker unreachable: %s; looking for due messages first",
                destination,
                exc,
            )
        except Exception as exc:  # noqa: BLE001 -- down: looked for due rows all the same
            self.log.warning(
                "destination %s: broker unreachable: %s; looking for due messages first",
                destination,
                describe(exc),
            )
        return True

    async def _loop(self, destination: str) -> None:
        try:
            await self._claim_publish_settle(destination)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self._forced and task is not None and task.cancelling() == 1:
                # Cut short by force_stop, its batch given back (_process): this loop is
                # done. Ending quietly lets run() wait for the other loops' releases too.
                task.uncancel()
                return
            raise

    async def _claim_publish_settle(self, destination: str) -> None:
        settings = self.settings
        claims = self._database_outage(destination, "claim failed")
        looked_without_broker = False
        while not self.stopping:
            if settings.exit_when_idle and not looked_without_broker:
                # A run from cron must end when nothing is due, broker up or not: one connect
                # without waiting, then one claim all the same. Nothing due: it returns below.
                # Rows due go back untried (publish_batch: not connected), then this waits.
                looked_without_broker = True
                if not await self._connect_once(destination):
                    return
            elif not await self._ensure_publisher(destination):
                return
            recover = await self._gate.enter_claim(self.database, self._stopping)
            if recover is None:
                return
            under_way = HeldBatch(self.database, recovered=False)
            # Only a gate of several databases sets a hung claim aside: a relay alone
            # spends no timer a claim on it.
            hung = (
                asyncio.get_running_loop().call_later(
                    HUNG_CLAIM, self._gate.park_claim, under_way, recover
                )
                if self._gate.parks
                else None
            )
            self.store.reset_wakeup(destination)
            self._claims_sent[destination] += 1
            started = time.perf_counter()
            claimed_at = time.monotonic()  # the lease runs from no later than this
            # A forced shutdown lets a claim under way answer (force_stop, CUT_CLAIM_WAIT), so
            # that what it took is given back, not left in flight (see _give_back_cut_claim).
            me = asyncio.current_task()
            self._claiming.add(me)
            try:
                batch = await self.store.claim(
                    destination,
                    self.relay_id,
                    settings.batch_size,
                    settings.lock_timeout,
                    settings.abandoned_blocks_key,
                    max_attempts=settings.max_attempts,
                    recover=recover,
                    max_bytes=settings.claim_max_bytes,
                )
            except asyncio.CancelledError:
                # A forced shutdown: the gate must not keep this claim's recovery slot.
                if hung is not None:
                    hung.cancel()
                self._gate.claimed(None, recover, self.database, under_way)
                raise
            except Exception as exc:  # noqa: BLE001 -- database outage: log, back off, resume by itself
                if hung is not None:
                    hung.cancel()
                self._gate.claimed(None, recover, self.database, under_way)
                await claims.back_off(exc)
                continue
            finally:
                self._claiming.discard(me)
            if hung is not None:
                hung.cancel()
            if self._forced:
                # Forced while the claim was under way: its rows go back, untried.
                self._gate.claimed(None, recover, self.database, under_way)
                await self._give_back_cut_claim(destination, batch)
                return
            if not self._gate.claimed(batch, recover, self.database, under_way):
                claims.over()
                await self._give_back(destination, batch)
                continue
            claims.over()
            claim_seconds = time.perf_counter() - started
            for stats in self._stats(destination):
                stats.claim_seconds += claim_seconds
            if self.metrics is not None:
                self.metrics.observe_claim(
                    destination, claim_seconds, len(batch), database=self.database
                )
            self._log_abandoned(destination, batch)
            # Full: batch_size rows, or the byte budget reached (the claim stopped there).
            full = len(batch) == settings.batch_size or (
                sum(len(message.payload) for message in batch) >= settings.claim_max_bytes
            )
            if full or batch.recovered:
                # A full batch: there is likely more. A recovered row: its batch-mates are
                # likely next, one a claim. Let another loop help.
                self.store.nudge(destination)
            if not batch:
                if batch.abandoned or batch.recovery_waiting:
                    continue  # their keys' next rows may be due now; or drain, then recover
                if self._in_flight[destination]:
                    self._empty_while_in_flight[destination] += 1
                if settings.exit_when_idle and self._in_flight[destination] == 0:
                    return
                await self._wait_for_work(
                    destination, settings.poll_interval if not settings.exit_when_idle else 0.05
                )
                continue
            self._in_flight[destination] += 1
            empty_before = self._empty_while_in_flight[destination]
            held = HeldBatch(self.database, batch.recovered)
            try:
                await self._process(destination, batch, claimed_at, held)
            finally:
                self._in_flight[destination] -= 1
                self._gate.settled(batch.recovered, self.database, parked=held.parked)
            if self._empty_while_in_flight[destination] != empty_before:
                # A claim found nothing while this batch was in flight: it may have passed
                # over the next row of one of this batch's keys, whose NOTIFY it used up.
                # Now that the batch is settled, that row is due. Any claim sent from now
                # on takes it; if none is within FREED_KEY_GRACE, this loop claims (a key's
                # second commit, made while its first was published, waited for the next
                # commit or the fallback poll). Not at once: under a steady stream another
                # loop's claim comes first, and a claim of its own cost 17% more CPU per
                # message at 200 commits/s (bench/paced_relay.py --rate 200).
                claims_before = self._claims_sent[destination]
                await self._wait_for_work(destination, FREED_KEY_GRACE)
                if self._claims_sent[destination] == claims_before:
                    continue
            if not full and not batch.recovered and self.store.gathers_batches:
                # Caught up: a claim at once would take the few rows committed meanwhile, at
                # the cost of two transactions. A short wait gathers a larger batch.
                await self._wait_for_work(destination, settings.poll_interval)

    async def _give_back(self, destination: str, batch: Claim) -> None:
        """Give back, unpublished, a batch of a claim that hung while a recovered row was
        claimed or held (RecoveryGate.park_claim)."""
        self.log.info(
            "destination %s: a claim answered after %.0fs, while a recovered message is "
            "published alone: its %d message(s) go back to the queue",
            destination,
            HUNG_CLAIM,
            len(batch),
        )
        given_back = HeldBatch(self.database, recovered=False)
        try:
            if batch.recovered:
                await asyncio.shield(
                    self._end_recovered_lease(destination, batch, "given back unpublished")
                )
                return
            settle = asyncio.ensure_future(
                self._settle(destination, batch, [BESIDE_RECOVERY] * len(batch), given_back)
            )
            try:
                # A forced shutdown lets it finish: cut short, its rows would stay in flight
                # until their lease expires, and be charged an attempt.
                await asyncio.shield(settle)
            except asyncio.CancelledError:
                await settle
                raise
        finally:
            self._gate.settled(False, self.database, parked=given_back.parked)

    def _cut_claim(self, task: asyncio.Task[None]) -> None:
        """CUT_CLAIM_WAIT after a forced shutdown, a loop whose claim has still not answered
        is cancelled: a database that hangs must not hold the shutdown. What the claim took
        (SQLite's worker thread goes on) then waits for its lease to expire."""
        if task in self._claiming and not task.done():
            self.log.warning(
                "a claim under way at the forced shutdown did not answer within %.2fs; what "
                "it took waits for its lease to expire",
                CUT_CLAIM_WAIT,
            )
            task.cancel()

    async def _give_back_cut_claim(self, destination: str, batch: Claim) -> None:
        """Give back, unpublished, what a claim under way at a forced shutdown took.

        Cancelled, the claim's statement may commit all the same (SQLite runs it in a worker
        thread, and any driver may have sent it whole already): its rows stayed in flight
        under a relay that had stopped until their lease expired, then each was recovered
        alone and charged an attempt it never had (ABANDONED, unpublished, at max_attempts
        1). So force_stop lets a claim answer, for CUT_CLAIM_WAIT at most, and its rows are
        released as a batch cut short is (see _process)."""
        if not batch:
            return
        if batch.recovered:
            await self._end_recovered_lease(destination, batch, "cut short by the shutdown")
            return
        await self._settle(destination, batch, [None] * len(batch))

    async def _end_recovered_lease(self, destination: str, batch: Claim, why: str) -> None:
        """A recovered row given back unpublished: released, it would be claimed again as an
        ordinary row, beside others; its lease ends now instead, and it is recovered again,
        alone. If the database does not answer, the lease ends by itself."""
        try:
            await self.store.renew(destination, batch.lease, [m.stored_seq for m in batch], 0)
        except Exception as exc:  # noqa: BLE001 -- the lease then ends by itself
            self.log.warning(
                "destination %s: could not end the lease of recovered message(s) %s %s (%s); "
                "recovered again when it expires",
                destination,
                ", ".join(str(m.id) for m in batch),
                why,
                describe(exc),
            )

    def _log_abandoned(self, destination: str, batch: Claim) -> None:
        """Say what the claim gave up, and that it recovers a row alone."""
        for row in batch.abandoned:
            for stats in self._stats(destination):
                stats.abandoned_now += 1
            self.log.error(
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
                self.log.warning(
                    "destination %s: message %s (topic %s) was in flight when its relay died "
                    "or stalled (lease expired); publishing it alone, attempt %d of %d",
                    destination,
                    message.id,
                    message.topic,
                    message.attempts + 1,
                    self.settings.max_attempts,
                )

    async def _process(
        self, destination: str, batch: Claim, claimed_at: float, held: HeldBatch | None = None
    ) -> None:
        """Publish the batch while its lease is kept, then settle it.

        If the lease is lost (taken over, or run out while the database did not answer),
        the publish is cancelled at once, so this loop never publishes a row that its next
        holder publishes too: that would interleave a key's messages. A forced shutdown
        cancels it too. Either way the outcomes known by then (the waves the broker had
        answered, the messages that failed to decrypt) are recorded as a settle records
        them, and only the rest (the wave in flight, the later ones) is given back, no
        attempt counted. Waves keep that in key order: a key's message is confirmed only
        after its earlier ones were. The settle is fenced by the claim's lease token, so
        after a lost lease it changes only the rows nobody took over; there, a key's
        confirmation behind an earlier row of its key is given back (after_lost_lease).
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
        # The publish runs in this task (one task fewer per batch): a lost lease cancels
        # this task, and that cancellation is taken back (uncancel), as asyncio.timeout
        # does. One asked for by anyone else is a forced shutdown.
        task = asyncio.current_task()
        assert task is not None
        lease = LeaseKeeper(self, destination, batch, claimed_at, task)
        outcomes: list[Outcome] | None = None
        #: Filled in as the publish learns them: what a cancelled publish leaves known.
        known: list[Outcome | None] = [None] * len(batch)
        if held is not None:
            held.lease_until = lease.give_up_at
        if time.monotonic() >= lease.give_up_at:
            # The claim answered after its lease would have ended (it waited that long for
            # a lock, or this relay stalled): another relay may be publishing the rows
            # already. Not one is published, not even the first wave (a publish can reach
            # the broker before its first await gives the lease's timer a turn).
            lease.lost = LeaseKeeper.RAN_OUT
        else:
            lease.start()
            try:
                outcomes = await self._publish(destination, batch.recovered, spans.messages, known)
            except asyncio.CancelledError:
                renewing = lease.stop()
                if renewing is not None:
                    await asyncio.gather(renewing, return_exceptions=True)
                if lease.lost is not None:
                    task.uncancel()
                if task.cancelling():
                    # Cancelled mid-publish (forced shutdown): what the broker answered is
                    # recorded (confirmed rows published again after the restart would be
                    # duplicates; a failure would lose its attempt and error), the rest
                    # goes back. The lease may have been lost in the same turn (a stall
                    # made both timers overdue): then fenced by key as after a loss.
                    self._published(destination, batch, spans, known)
                    if lease.lost is not None:
                        known = after_lost_lease(batch, known)
                    await asyncio.shield(self._settle(destination, batch, known, held))
                    raise
            else:
                renewing = lease.stop()
                if lease.lost is not None:
                    task.uncancel()  # the publish swallowed the cancellation: its outcomes stand
                if renewing is not None:
                    await _cancel(renewing)
        if held is not None:
            held.lease_until = lease.give_up_at  # renewals moved it
        if outcomes is None:
            for stats in self._stats(destination):
                stats.leases_lost += 1
            self.log.warning(
                "destination %s: stopped publishing a batch of %d: %s; the outcomes known "
                "are recorded, the rows still held and unanswered go back to the queue",
                destination,
                len(batch),
                lease.lost or "publishing was cancelled",
            )
            self._published(destination, batch, spans, known)
            await self._settle(destination, batch, after_lost_lease(batch, known), held)
            return
        self._published(destination, batch, spans, outcomes)
        recorded: Sequence[Outcome | None] = outcomes
        if lease.lost is not None:
            # The publish swallowed the lease's cancellation: its outcomes stand, fenced
            # by key as a cut-short publish's are.
            recorded = after_lost_lease(batch, outcomes)
        settle = asyncio.ensure_future(self._settle(destination, batch, recorded, held))
        try:
            await asyncio.shield(settle)
        except asyncio.CancelledError:
            # Cut short once the batch was published (force_stop): its outcomes are known,
            # so they are recorded rather than left in flight until the lease expires.
            # (A settle that waits for a database that is down ends once stopping.)
            await settle
            raise

    def _published(
        self,
        destination: str,
        batch: Claim,
        spans: tracing.PublishSpans,
        outcomes: Sequence[Outcome | None],
    ) -> None:
        """A publish ended, or was cut short: its spans end and its confirmations are
        observed, with its outcomes (None: not known, given back)."""
        spans.end(outcomes)
        if self.metrics is not None:
            self.metrics.observe_confirmed(
                destination,
                [
                    message.created_at
                    for message, outcome in zip(batch, outcomes, strict=True)
                    if outcome is not None and outcome.kind is OutcomeKind.PUBLISHED
                ],
                database=self.database,
            )

    async def _publish(
        self,
        destination: str,
        recovered: bool,
        outgoing: Sequence[Message],
        known: list[Outcome | None],
    ) -> list[Outcome]:
        """Publish a batch; a recovered row once it is all this relay holds (RecoveryGate).
        ``known`` gets each outcome as soon as it is known (see PayloadHandling.publish)."""
        if recovered and not await self._gate.alone(self._stopping):
            # Stopping while other batches were still held: publishing the recovered row
            # beside them would defeat its isolation, and waiting for them need not end.
            # It goes back to the queue unpublished, no attempt counted for this relay.
            return [NOT_ALONE] * len(outgoing)
        started = time.perf_counter()
        # Decrypted (or forwarded) and enveloped per destination; a key error fails its
        # message, never the batch.
        outcomes = await self.payloads[destination].publish(
            self.publishers[destination], outgoing, known
        )
        for stats in self._stats(destination):
            stats.publish_seconds += time.perf_counter() - started
        return outcomes

    async def _settle(
        self,
        destination: str,
        batch: Claim,
        outcomes: Sequence[Outcome | None],
        held: HeldBatch | None = None,
    ) -> None:
        published: list[int] = []
        failed: list[Failure] = []
        released: list[int] = []
        retrying: dict[str, list[Message]] = {}
        for message, outcome in zip(batch, outcomes, strict=True):
            if outcome is None or outcome.kind is OutcomeKind.SKIPPED or not outcome.attempted:
                # Never sent (an earlier row of its key failed, the publisher was not
                # connected, the publish was cut short): back to the queue, no attempt counted.
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
                    self.log.error(
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
            self.log.warning(
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
            destination, batch.lease, Settlement(published, failed, released), keys, held
        )
        settle_seconds = time.perf_counter() - started
        if self.metrics is not None:  # the batch is out of this relay's hands either way
            self.metrics.observe_settle(
                destination, settle_seconds, len(batch), database=self.database
            )
        if result is None:
            return
        for stats in self._stats(destination):
            stats.settle_seconds += settle_seconds
            stats.published += result.published
            stats.failed += result.failed
            stats.released += result.released
            stats.lost += result.lost
        if result.lost:
            self.log.warning(
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
        held: HeldBatch | None = None,
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
            return await self._settle_answered(destination, lease, outcomes, held)
        except StoreDataError as exc:
            self._refused(destination, exc, len(outcomes))
        outcomes = outcomes.with_error(UNRECORDABLE_ERROR)
        try:
            return await self._settle_answered(destination, lease, outcomes, held)
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
                result = await self._settle_answered(destination, lease, row, held)
            except StoreDataError as exc:
                for stats in self._stats(destination):
                    stats.unrecorded += 1
                if key is not None:
                    refused_keys.add(key)
                self.log.error(
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
        self.log.error(
            "destination %s: the database refused to record %d outcome(s): %s",
            destination,
            outcomes,
            exc,
        )

    async def _settle_answered(
        self,
        destination: str,
        lease: Lease,
        outcomes: Settlement,
        held: HeldBatch | None = None,
    ) -> SettleResult | None:
        """One settle, retried while the database is unreachable; None if the relay stopped
        first. StoreDataError (refused values) is raised at once: retrying cannot help."""
        # Settling must not be given up lightly: the broker already has these messages.
        # Retry until the database answers; if this relay dies first, the lock expires and
        # another relay publishes them again (a duplicate, never a loss).
        outage = self._database_outage(destination, "settle failed")
        # Only a gate of several databases sets a hung settle aside: a relay alone spends
        # no timer a settle on it. park counts a batch once; its settled() says parked.
        hung = (
            asyncio.get_running_loop().call_later(HUNG_SETTLE, self._gate.park, held)
            if held is not None and self._gate.parks and not held.parked
            else None
        )
        try:
            return await self._settle_retried(destination, lease, outcomes, held, outage)
        finally:
            if hung is not None:
                hung.cancel()

    async def _settle_retried(
        self,
        destination: str,
        lease: Lease,
        outcomes: Settlement,
        held: HeldBatch | None,
        outage: Outage,
    ) -> SettleResult | None:
        """``_settle_answered``'s tries."""
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
                if (
                    outage.over()
                    and result.lost == len(outcomes)
                    and held is not None
                    and held.lease_until is not None
                    and time.monotonic() < held.lease_until
                ):
                    # An earlier try got no answer, and now every row is gone from the lease,
                    # which nobody could take over yet: that try committed (a settle is one
                    # transaction, all or nothing). Its outcomes were recorded, none lost.
                    return SettleResult(
                        published=len(outcomes.published),
                        failed=len(outcomes.failed),
                        released=len(outcomes.released),
                    )
                return result
            except StoreDataError:
                raise
            except Exception as exc:  # noqa: BLE001 -- database outage during settle
                if self.stopping and outage.failures >= 3:
                    outage.count()
                    self.log.error(
                        "destination %s: could not record %d outcomes (%s); their locks "
                        "expire and they will be published again",
                        destination,
                        len(outcomes),
                        exc,
                    )
                    return None
                if held is not None:
                    # Published already: while its database is away, it must not hold
                    # back the other databases' recoveries (RecoveryGate).
                    self._gate.park(held)
                await outage.back_off(exc, through_stop=True)

    async def _wait_for_work(self, destination: str, timeout: float) -> None:
        """Wait in the store's ``wait_for_wakeup``, or until the relay is asked to stop.

        The wait runs in the loop's own task (no task of its own, nor one watching for the
        stop: this runs after nearly every claim): ``stop`` cancels it, and that
        cancellation is taken back here (uncancel), as asyncio.timeout does.
        """
        if self.stopping:
            return
        task = asyncio.current_task()
        assert task is not None
        self._waiting[task] = False
        try:
            await self.store.wait_for_wakeup(destination, timeout)
        except asyncio.CancelledError:
            if self._waiting.get(task) and task.uncancel() == 0:
                return  # stop() ended the wait
            raise
        except Exception as exc:  # noqa: BLE001 -- waiting can fall back to sleeping
            failure: Exception | None = exc
        else:
            failure = None
        finally:
            del self._waiting[task]
        if failure is not None:
            self.log.warning("waiting for wake-ups failed: %s", failure)
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
                self.stats.cleaned += await delete_finished(self.store, self.settings, log=self.log)
            except Exception as exc:  # noqa: BLE001 -- retention can wait for the next round
                self.log.warning("cleanup failed: %s", exc)
            else:
                # Apart from the rows' retention: a failed sweep neither hides the round's
                # deleted rows nor makes a second warning of the one the sweep logged.
                await self._sweep_claim_checks()
            await self._bound_sqlite_wal()
            if await self._sleep(self.settings.cleanup_interval):
                return

    async def _bound_sqlite_wal(self) -> None:
        """SQLite: truncate a -wal file a burst grew, which nothing else shrinks while the
        application keeps a connection open (Store.bound_wal)."""
        try:
            size = await self.store.bound_wal(log=self.log)
        except Exception as exc:  # noqa: BLE001 -- the next round tries again
            self.log.warning("SQLite -wal checkpoint failed: %s; the next cleanup tries again", exc)
            return
        if size is not None and self.metrics is not None:
            self.metrics.observe_sqlite_wal(size, database=self.database)

    async def _sweep_claim_checks(self) -> None:
        try:
            await sweep_claim_checks(self.settings, log=self.log)
        except ClaimCheckSweepTimeoutError:
            # Logged by the sweep already (and counted in claimcheck.sweep_failures(), the
            # process's count; this one is the database's, for /metrics).
            self.stats.claim_check_sweep_failures += 1
        except Exception as exc:  # noqa: BLE001 -- the next round sweeps again
            self.stats.claim_check_sweep_failures += 1
            self.log.warning("claim-check sweep failed: %s; the next cleanup tries again", exc)


async def cleanup(
    store: Store, settings: Settings, max_batches: int = 100, *, log: Log = logger
) -> int:
    """Delete finished rows past their retention in bounded batches, then the claim-check
    objects no row refers to any more; return how many rows (see :func:`delete_finished`).

    A failed sweep is raised, after the rows' deletes (``outboxer cleanup`` exits with it);
    the relay runs the two steps apart and counts a failed sweep instead."""
    deleted = await delete_finished(store, settings, max_batches, log=log)
    await sweep_claim_checks(settings, log=log)
    return deleted


async def delete_finished(
    store: Store, settings: Settings, max_batches: int = 100, *, log: Log = logger
) -> int:
    """Delete finished rows past their retention in bounded batches; return how many.

    A partitioned outbox drops whole partitions instead (and makes the coming ones): its
    rows count as PostgreSQL's statistics estimate them."""
    deleted = 0
    steps: list[Callable[[], Awaitable[int]]] = []
    if await store.is_partitioned():
        report = await store.maintain_partitions(
            PartitionPolicy(
                ahead=settings.partitions_ahead,
                interval=settings.partition_interval,
                published_retention=settings.published_retention,
                abandoned_retention=settings.abandoned_retention,
            )
        )
        deleted += report.dropped_rows
    else:
        steps += [
            functools.partial(
                store.cleanup, "PUBLISHED", settings.published_retention, settings.cleanup_batch
            ),
            functools.partial(
                store.cleanup, "ABANDONED", settings.abandoned_retention, settings.cleanup_batch
            ),
        ]
    steps.append(
        functools.partial(store.cleanup_inbox, settings.inbox_retention, settings.cleanup_batch)
    )
    for step in steps:
        for _ in range(max_batches):
            count = await step()
            deleted += count
            if count < settings.cleanup_batch:
                break
            await asyncio.sleep(0)  # let the relay's loops run between batches
    if deleted:
        log.info("cleanup deleted %d finished message(s)", deleted)
    return deleted


async def sweep_claim_checks(settings: Settings, *, log: Log = logger) -> int | None:
    """The claim-check objects no row refers to any more (those of the rows retention just
    deleted, of rolled-back enqueues), deleted by ``payload_admin.sweep_claim_checks``;
    how many (None without a store). A store that does not answer in time raises
    ClaimCheckSweepTimeoutError, already logged to ``log``: the relay's names its database.

    The sweep runs in a daemon thread, not ``asyncio.to_thread``: a relay stopped mid-sweep
    cancels the wait and exits at once, where the default executor's thread held its exit
    (``asyncio.run`` joins it) until the store call in progress gave up, up to
    ``claim_check_read_timeout``. The abandoned sweep finishes or gives up on its own, or
    dies with the process. Either way nothing is left that the next sweep cannot redo: it
    only reads rows and deletes objects no row refers to (and leftovers of interrupted
    puts), and a delete is idempotent, so an object deleted already is skipped and one not
    yet deleted is still an orphan next time."""
    # No slot: the sweep bounds its own store calls with claimcheck's sweep slots, and a
    # relay's cleanup loop awaits one sweep before the next.
    objects = await in_daemon_thread(
        functools.partial(payload_admin.sweep_claim_checks, settings, log=log),
        None,
        "outboxer-claim-check-sweep-run",
    )
    if objects:
        log.info("cleanup deleted %d claim-check object(s)", objects)
    return objects


def after_lost_lease(
    batch: Sequence[Message], known: Sequence[Outcome | None]
) -> list[Outcome | None]:
    """What a batch whose lease was lost records of ``known``: the same, except a
    confirmation of a key's message that follows another of its key in the batch, which
    is given back instead (published again: a duplicate).

    The settle is fenced (only rows still under the claim's lease change), but an earlier
    row of the key may have been taken over by then, and its new holder may give it back
    or abandon it: its successor must not be PUBLISHED meanwhile, a key's later message
    recorded as out before an earlier one that is not. A key's first row, a keyless row
    and a failure are recorded: nothing of their key comes before them in the batch."""
    kept: list[Outcome | None] = []
    keys: set[str] = set()
    for message, outcome in zip(batch, known, strict=True):
        if message.key is not None:
            if message.key in keys and outcome is not None and outcome.published:
                outcome = None
            keys.add(message.key)
        kept.append(outcome)
    return kept


async def _cancel(*tasks: asyncio.Task[Any]) -> None:
    """Cancel ``tasks`` and wait until they have ended."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _with(settings: Settings, **changes: object) -> Settings:
    return dataclasses.replace(settings, **changes)  # type: ignore[arg-type]


def metrics_if_installed() -> Metrics | None:
    """A ``Metrics`` for the process's relays, or None without prometheus_client."""
    from outboxer.errors import MissingDependencyError
    from outboxer.metrics import Metrics

    try:
        return Metrics()
    except MissingDependencyError:
        return None


class PublisherPool:
    """The publishers of the relays of one process: one per broker URL and configuration.

    Relays of several databases whose destinations go to the same broker, with the same
    routes and options, share one publisher, so one broker client. Sharing is safe: one relay
    already shares each publisher among its loops (``concurrency``) on one event loop, a
    publisher connects under its own lock, and per-key order is a batch's own (a key's
    messages live in one database, so in one relay's batches). The pool closes them once
    every relay has ended (``close``).
    """

    def __init__(self) -> None:
        self._publishers: dict[str, Publisher] = {}

    def publisher(self, destination: DestinationSettings, publish_timeout: float) -> Publisher:
        key = json.dumps(
            [destination.broker, destination.routes, destination.options, publish_timeout],
            sort_keys=True,
            default=repr,
        )
        publisher = self._publishers.get(key)
        if publisher is None:
            publisher = self._publishers[key] = create_publisher(
                destination.broker,
                routes=destination.routes,
                publish_timeout=publish_timeout,
                **destination.options,
            )
        return publisher

    def __len__(self) -> int:
        return len(self._publishers)

    async def close(self) -> None:
        for publisher in self._publishers.values():
            with contextlib.suppress(Exception):
                await publisher.close()
