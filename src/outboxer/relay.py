"""The relay: claim a batch, publish it, settle it; wake on commit, poll as a fallback.

One relay process serves every configured destination of one outbox table, with
``concurrency`` claim-publish-settle loops per destination. Many relays may run
on one table: the claim query keeps them from owning the same row or overtaking
a key's earlier message.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import signal
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

from outboxer.brokers import Publisher, create_publisher
from outboxer.brokers.base import Outcome, OutcomeKind
from outboxer.config import Settings
from outboxer.envelope import strip_envelope
from outboxer.errors import ConfigError, PublishError, SchemaError
from outboxer.message import Message
from outboxer.redact import get_logger, redact_text
from outboxer.retry import Backoff
from outboxer.stores import Failure, Store, create_store

logger = get_logger("outboxer.relay")

#: Backoff for the relay's own trouble (database or broker unreachable), not per message.
OUTAGE_BACKOFF = Backoff(base=0.2, multiplier=2.0, cap=15.0, jitter=0.25)


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
    broker_reconnects: int = 0
    started_at: float = field(default_factory=time.time)

    def as_dict(self) -> dict[str, float | int]:
        return dict(self.__dict__)


class Relay:
    """Moves committed outbox rows to their brokers: at least once, in order per key."""

    def __init__(
        self,
        store: Store,
        publishers: Mapping[str, Publisher],
        settings: Settings | None = None,
        *,
        envelopes: Mapping[str, str] | None = None,
    ) -> None:
        if not publishers:
            raise ValueError("a relay needs at least one destination publisher")
        self.store = store
        self.publishers = dict(publishers)
        self.settings = settings or Settings()
        self.envelopes = dict(envelopes or {})
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
        self._loops_running = False

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
        return cls(store, publishers, settings, envelopes=envelopes)

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
        failures = 0
        while True:
            try:
                await self.store.connect()
                # Fatal, not retried: claims would fail until an operator upgrades the schema.
                await self.store.check_schema()
                self._outage("database", None)
                return True
            except SchemaError:
                raise
            except Exception as exc:  # noqa: BLE001 -- the database may be starting: keep trying, never exit
                failures += 1
                self.stats.store_errors += 1
                delay = OUTAGE_BACKOFF.delay(failures)
                self._outage("database", f"unreachable ({exc})")
                logger.warning("database unreachable (%s); retrying in %.1fs", exc, delay)
                if await self._sleep(delay):
                    return False

    def _stats(self, destination: str) -> tuple[RelayStats, RelayStats]:
        """The relay's counters and the destination's: both take every count."""
        return self.stats, self.destination_stats[destination]

    async def _ensure_publisher(self, destination: str) -> bool:
        """Connect the destination's publisher, backing off while the broker is down.

        Returns False if the relay was asked to stop meanwhile.
        """
        publisher = self.publishers[destination]
        failures = 0
        while not publisher.connected:
            try:
                await publisher.connect()
                self._outage(f"broker {destination}", None)
                if failures:
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
                failures += 1
                delay = OUTAGE_BACKOFF.delay(failures)
                self._outage(f"broker {destination}", f"unreachable ({exc})")
                logger.warning(
                    "destination %s: broker unreachable (%s); retrying in %.1fs",
                    destination,
                    exc,
                    delay,
                )
                if await self._sleep(delay):
                    return False
        return True

    async def _loop(self, destination: str) -> None:
        settings = self.settings
        store_failures = 0
        while not self.stopping:
            if not await self._ensure_publisher(destination):
                return
            self.store.reset_wakeup(destination)
            started = time.perf_counter()
            try:
                batch = await self.store.claim(
                    destination,
                    self.relay_id,
                    settings.batch_size,
                    settings.lock_timeout,
                    settings.abandoned_blocks_key,
                )
            except Exception as exc:  # noqa: BLE001 -- database outage: log, back off, resume by itself
                store_failures += 1
                for stats in self._stats(destination):
                    stats.store_errors += 1
                delay = OUTAGE_BACKOFF.delay(store_failures)
                self._outage("database", f"claim failed ({exc})")
                logger.warning(
                    "destination %s: claim failed (%s); retrying in %.1fs", destination, exc, delay
                )
                await self._sleep(delay)
                continue
            store_failures = 0
            self._outage("database", None)
            for stats in self._stats(destination):
                stats.claim_seconds += time.perf_counter() - started
            if len(batch) == settings.batch_size:
                self.store.nudge(
                    destination
                )  # a full batch: there is likely more, let another loop help
            if not batch:
                if settings.exit_when_idle and self._in_flight[destination] == 0:
                    return
                await self._wait_for_work(
                    destination, settings.poll_interval if not settings.exit_when_idle else 0.05
                )
                continue
            self._in_flight[destination] += 1
            try:
                await self._process(destination, batch)
            finally:
                self._in_flight[destination] -= 1
            if len(batch) < settings.batch_size and self.store.gathers_batches:
                # Caught up: a claim at once would take the few rows committed meanwhile, at
                # the cost of two transactions. A short wait gathers a larger batch.
                await self._wait_for_work(destination, settings.poll_interval)

    async def _process(self, destination: str, batch: Sequence[Message]) -> None:
        for stats in self._stats(destination):
            stats.claimed += len(batch)
            stats.batches += 1
        publisher = self.publishers[destination]
        outgoing = batch
        if self.envelopes.get(destination) == "stripped":
            outgoing = [strip_envelope(message) for message in batch]
        started = time.perf_counter()
        try:
            outcomes = await publisher.publish_batch(outgoing)
        except asyncio.CancelledError:
            # Cancelled mid-publish (forced shutdown): nothing is known, give the rows back.
            await asyncio.shield(self._settle(destination, batch, [None] * len(batch)))
            raise
        for stats in self._stats(destination):
            stats.publish_seconds += time.perf_counter() - started
        await self._settle(destination, batch, outcomes)

    async def _settle(
        self, destination: str, batch: Sequence[Message], outcomes: Sequence[Outcome | None]
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
                error = outcome.error or "unknown error"
                permanent = not outcome.retryable
                failed.append(
                    Failure(
                        message.stored_seq,
                        error,
                        self.backoff.delay_after(message.attempts + 1, outcome.retry_after),
                        permanent,
                    )
                )
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
            )
        # Settling must not be given up lightly: the broker already has these messages.
        # Retry until the database answers; if this relay dies first, the lock expires and
        # another relay publishes them again (a duplicate, never a loss).
        failures = 0
        started = time.perf_counter()
        while True:
            try:
                result = await self.store.settle(
                    destination,
                    self.relay_id,
                    published,
                    failed,
                    released,
                    self.settings.max_attempts,
                )
                self._outage("database", None)
                break
            except Exception as exc:  # noqa: BLE001 -- database outage during settle
                failures += 1
                for stats in self._stats(destination):
                    stats.store_errors += 1
                delay = OUTAGE_BACKOFF.delay(failures)
                if self.stopping and failures > 3:
                    logger.error(
                        "destination %s: could not record %d outcomes (%s); their locks "
                        "expire and they will be published again",
                        destination,
                        len(batch),
                        exc,
                    )
                    return
                self._outage("database", f"settle failed ({exc})")
                logger.warning(
                    "destination %s: settle failed (%s); retrying in %.1fs", destination, exc, delay
                )
                await asyncio.sleep(delay)
        for stats in self._stats(destination):
            stats.settle_seconds += time.perf_counter() - started
            stats.published += result.published
            stats.failed += result.failed
            stats.released += result.released
            stats.lost += result.lost
        if result.lost:
            logger.warning(
                "destination %s: %d message(s) were taken over by another relay after "
                "this relay's lock expired; raise --lock-timeout if publishing is slow",
                destination,
                result.lost,
            )

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
    return deleted


def _with(settings: Settings, **changes: object) -> Settings:
    import dataclasses

    return dataclasses.replace(settings, **changes)  # type: ignore[arg-type]
