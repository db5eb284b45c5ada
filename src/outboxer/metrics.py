"""Prometheus metrics of a relay or an API process, on ``prometheus_client`` (``outboxer[metrics]``).

One ``Metrics`` object per relay or API process holds its own ``CollectorRegistry`` (never
the library's global one, so two relays in one process, or an application's own metrics,
do not collide). It exposes:

- the relay's counters under the names dashboards already use
  (``outboxer_messages_published_total{database, destination}`` …), read from the relay's
  ``RelayStats`` when scraped, so the relay keeps counting in one place;
- histograms per destination of the latency from a message's ``created_at`` (its
  transaction) to the broker's confirm, and of the claim and settle statements' durations;
- gauges per destination of the messages in flight (claimed, not yet settled), and, from
  the outbox table, the rows by status and the oldest pending message's age;
- on SQLite, a gauge of the -wal file's bytes after each cleanup round (which truncates it
  when a burst grew it: SqliteStore.bound_wal).

Every series but the process's own carries a ``database`` label: the name of the
database its relay serves, ``default`` for a relay of one ``db`` (so a process serving
several databases, outboxer.relay_group, reports each apart, and dashboards that sum by
destination keep working). One ``Metrics`` serves every relay of a process.

The relay feeds the histograms and the in-flight gauge through the ``observe_*`` methods;
``render`` answers a scrape in the Prometheus text format, or in OpenMetrics when the
scraper's ``Accept`` header asks for it.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import UTC, datetime
from types import ModuleType
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from outboxer.config import DEFAULT_DATABASE
from outboxer.errors import MissingDependencyError
from outboxer.message import Status

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

    from outboxer.relay import RelayStats
    from outboxer.stores import DestinationStatus

#: Seconds from a message's commit to its broker's confirm: milliseconds when the relay keeps
#: up, up to an hour when a broker was down or a message backed off.
LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0,
)  # fmt: skip
#: Seconds a claim or a settle statement takes: one round trip, or a lock wait.
STATEMENT_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip

ALL_STATUSES = tuple(status.value for status in Status)

# The relay's counters: dashboards and alert rules use these names, keep them.
#: (metric, RelayStats attribute, help), one series per database and destination.
DESTINATION_COUNTERS: tuple[tuple[str, str, str], ...] = (
    (
        "outboxer_messages_claimed_total",
        "claimed",
        "Messages this relay claimed (a message claimed again after a failure counts again).",
    ),
    (
        "outboxer_messages_published_total",
        "published",
        "Messages the broker confirmed and this relay marked PUBLISHED.",
    ),
    (
        "outboxer_messages_failed_total",
        "failed",
        "Failed publish attempts this relay recorded (retried later, or abandoned).",
    ),
    (
        "outboxer_messages_abandoned_total",
        "abandoned_now",
        "Messages this relay gave up on (ABANDONED): attempts used up or rejected for good.",
    ),
    (
        "outboxer_messages_released_total",
        "released",
        "Claimed messages given back without an attempt (behind a failed message of their key, or at shutdown).",
    ),
    (
        "outboxer_messages_lost_total",
        "lost",
        "Messages another relay took over after this relay's lock expired.",
    ),
    ("outboxer_batches_total", "batches", "Batches this relay claimed and processed."),
    ("outboxer_claim_seconds_total", "claim_seconds", "Seconds spent in claim statements."),
    (
        "outboxer_publish_seconds_total",
        "publish_seconds",
        "Seconds spent publishing batches and waiting for confirms.",
    ),
    (
        "outboxer_settle_seconds_total",
        "settle_seconds",
        "Seconds spent recording outcomes (settle statements).",
    ),
    (
        "outboxer_broker_connects_total",
        "broker_reconnects",
        "Successful broker connections: the first one of each destination and every reconnect.",
    ),
    (
        "outboxer_lease_renewals_total",
        "renewals",
        "Lease renewals of batches still being published.",
    ),
    (
        "outboxer_leases_lost_total",
        "leases_lost",
        "Batches whose publishing stopped because their lease was lost (relay stalled or cut off).",
    ),
    (
        "outboxer_messages_recovered_total",
        "recovered",
        "Messages taken over, each alone, from a relay whose lease expired (it died or stalled).",
    ),
    (
        "outboxer_settles_refused_total",
        "settles_refused",
        "Settles the database refused for their values (retried with a generic error, then row by row).",
    ),
    (
        "outboxer_outcomes_unrecorded_total",
        "unrecorded",
        "Outcomes not recorded even row by row: their rows wait for their lease to expire.",
    ),
)
#: Counters of a database's relay as a whole (label ``database``).
RELAY_COUNTERS: tuple[tuple[str, str, str], ...] = (
    (
        "outboxer_messages_cleaned_total",
        "cleaned",
        "Finished messages and inbox entries this relay's retention deleted.",
    ),
    (
        "outboxer_store_errors_total",
        "store_errors",
        "Database statements or connections that failed (the relay backs off and retries).",
    ),
    (
        "outboxer_claim_check_sweep_failures_total",
        "claim_check_sweep_failures",
        "Claim-check sweeps of this relay's cleanup that failed (the object store did not answer in time, or erred): orphaned objects wait for the next sweep.",
    ),
)


def prometheus_client() -> ModuleType:
    """The ``prometheus_client`` module, or MissingDependencyError naming the extra."""
    try:
        return importlib.import_module("prometheus_client")
    except ImportError as exc:
        raise MissingDependencyError("prometheus_client", "metrics") from exc


class RelayCounters(Protocol):
    """What ``Metrics`` reads from a relay at scrape time (``outboxer.Relay`` has it, and a
    ``database`` name; without one, ``default``)."""

    @property
    def stats(self) -> RelayStats: ...

    @property
    def destination_stats(self) -> Mapping[str, RelayStats]: ...

    def health_problems(self) -> list[str]: ...


def database_of(relay: object) -> str:
    """The name of the database ``relay`` serves (``default`` if it has none)."""
    name = getattr(relay, "database", None)
    return name if isinstance(name, str) else DEFAULT_DATABASE


class _RelayCollector:
    """The relays' counters and health, read from their ``RelayStats`` at each scrape."""

    def __init__(self) -> None:
        self.relays: list[RelayCounters] = []

    def collect(self) -> Iterator[Metric]:
        core = importlib.import_module("prometheus_client.core")
        relays = sorted(self.relays, key=database_of)
        for name, attribute, text in DESTINATION_COUNTERS:
            family = core.CounterMetricFamily(name, text, labels=["database", "destination"])
            for relay in relays:
                for destination, counts in sorted(relay.destination_stats.items()):
                    family.add_metric([database_of(relay), destination], getattr(counts, attribute))
            yield family
        for name, attribute, text in RELAY_COUNTERS:
            family = core.CounterMetricFamily(name, text, labels=["database"])
            for relay in relays:
                family.add_metric([database_of(relay)], getattr(relay.stats, attribute))
            yield family
        started = min((relay.stats.started_at for relay in relays), default=time.time())
        yield core.GaugeMetricFamily(
            "outboxer_relay_uptime_seconds",
            "Seconds since this relay process started.",
            value=max(time.time() - started, 0.0),
        )
        healthy = core.GaugeMetricFamily(
            "outboxer_relay_healthy",
            "1 while the database's relay loops run and nothing is in an outage backoff "
            "(as /health).",
            labels=["database"],
        )
        for relay in relays:
            healthy.add_metric([database_of(relay)], int(not relay.health_problems()))
        yield healthy


class _StoreCollector:
    """Gauges from the last outbox status query of each database (``observe_store_status``)."""

    def __init__(self) -> None:
        #: Per database: the last answer, None if it failed.
        self.statuses: dict[str, Sequence[DestinationStatus] | None] = {}

    def collect(self) -> Iterator[Metric]:
        core = importlib.import_module("prometheus_client.core")
        answers = sorted(self.statuses.items())
        up = core.GaugeMetricFamily(
            "outboxer_store_up",
            "1 if the last outbox status query succeeded (it is cached for a few seconds).",
            labels=["database"],
        )
        for database, statuses in answers:
            up.add_metric([database], int(statuses is not None))
        yield up
        counts = core.GaugeMetricFamily(
            "outboxer_messages",
            "Rows in the outbox, by database, destination and status; PUBLISHED is an estimate "
            "on a big table (outboxer_messages_published_estimated).",
            labels=["database", "destination", "status"],
        )
        estimated = core.GaugeMetricFamily(
            "outboxer_messages_published_estimated",
            "1 when outboxer_messages{status=PUBLISHED} is an estimate (a big table), 0 when "
            "it is exact; the other statuses are always exact.",
            labels=["database", "destination"],
        )
        ages = core.GaugeMetricFamily(
            "outboxer_oldest_pending_age_seconds",
            "Age of the oldest unfinished (PENDING, FAILED, PROCESSING) message; 0 when none.",
            labels=["database", "destination"],
        )
        for database, statuses in answers:
            for entry in statuses or ():
                # Every status of every destination, zeros included: a series never vanishes.
                for status in ALL_STATUSES:
                    counts.add_metric(
                        [database, entry.destination, status], entry.counts.get(status, 0)
                    )
                ages.add_metric([database, entry.destination], entry.oldest_pending_age or 0.0)
                estimated.add_metric([database, entry.destination], int(entry.published_estimated))
        if any(statuses is not None for _, statuses in answers):
            yield counts
            yield estimated
            yield ages


class _Series(NamedTuple):
    """One destination's series of the relay's histograms and gauge."""

    publish_latency: Any
    claim_duration: Any
    settle_duration: Any
    in_flight: Any


class Metrics:
    """The metrics of one relay or API process, in a registry of its own."""

    def __init__(
        self,
        destinations: Iterable[str] = (),
        *,
        database: str | None = None,
        process_metrics: bool = True,
        store_gauges: bool = True,
    ) -> None:
        """``destinations`` of ``database`` (``default`` when destinations are given) have
        series from the start (``add_series``); a relay adds its own when it is made.
        ``store_gauges``: the outbox table's gauges (``outboxer_store_up`` …), which a
        process without an outbox table (the stream relay) leaves out."""
        client = prometheus_client()
        self.registry = client.CollectorRegistry()
        self.publish_latency = client.Histogram(
            "outboxer_publish_latency_seconds",
            "Seconds from a message's creation (its enqueue transaction) to the broker's "
            "confirm, per published message.",
            ["database", "destination"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.claim_duration = client.Histogram(
            "outboxer_claim_duration_seconds",
            "Seconds per claim statement (a claim that found nothing included).",
            ["database", "destination"],
            buckets=STATEMENT_BUCKETS,
            registry=self.registry,
        )
        self.settle_duration = client.Histogram(
            "outboxer_settle_duration_seconds",
            "Seconds per settle (recording a batch's outcomes), retries after errors included.",
            ["database", "destination"],
            buckets=STATEMENT_BUCKETS,
            registry=self.registry,
        )
        self.in_flight = client.Gauge(
            "outboxer_messages_in_flight",
            "Messages this relay claimed and has not settled yet.",
            ["database", "destination"],
            registry=self.registry,
        )
        self.sqlite_wal_bytes = client.Gauge(
            "outboxer_sqlite_wal_bytes",
            "Bytes of a SQLite database's -wal file after the relay's last cleanup round, "
            "which truncates it when larger than 8 MiB; it grows without bound while a "
            "connection holds an old snapshot (logged as a warning).",
            ["database"],
            registry=self.registry,
        )
        #: Per database and destination, its series of the four families above, looked
        #: up once: the relay reports to them several times per batch (``labels`` locks).
        self._series: dict[tuple[str, str], _Series] = {}
        self._store = _StoreCollector()
        if store_gauges:
            self.registry.register(self._store)
        destinations = list(destinations)
        if destinations or database is not None:
            self.add_series(database or DEFAULT_DATABASE, destinations)
        #: Registered with the first relay: an API without one exports no relay counters.
        self._relays: _RelayCollector | None = None
        if process_metrics:
            client.ProcessCollector(registry=self.registry)
            client.PlatformCollector(registry=self.registry)

    def add_series(self, database: str, destinations: Iterable[str]) -> None:
        """Series of these destinations of ``database`` exist from now on, at zero (and its
        ``outboxer_store_up``, until a status query answers)."""
        self._store.statuses.setdefault(database, None)
        for destination in destinations:
            self._of(database, destination)

    def _of(self, database: str, destination: str) -> _Series:
        series = self._series.get((database, destination))
        if series is None:
            series = self._series[database, destination] = _Series(
                self.publish_latency.labels(database, destination),
                self.claim_duration.labels(database, destination),
                self.settle_duration.labels(database, destination),
                self.in_flight.labels(database, destination),
            )
        return series

    def watch_relay(self, relay: RelayCounters) -> None:
        """Expose ``relay``'s counters and health (read at each scrape), labelled with its
        database; several relays (one per database) may be watched."""
        if self._relays is None:
            self._relays = _RelayCollector()
            self.registry.register(self._relays)
        self._relays.relays.append(relay)

    # ----- what the relay reports ------------------------------------------------------------

    def observe_claim(
        self, destination: str, seconds: float, claimed: int, *, database: str = DEFAULT_DATABASE
    ) -> None:
        """A claim statement took ``seconds`` and took ``claimed`` messages into flight."""
        series = self._of(database, destination)
        series.claim_duration.observe(seconds)
        if claimed:
            series.in_flight.inc(claimed)

    def observe_confirmed(
        self,
        destination: str,
        created: Iterable[datetime | None],
        confirmed_at: float | None = None,
        *,
        database: str = DEFAULT_DATABASE,
    ) -> None:
        """The broker confirmed messages created at ``created`` at ``confirmed_at`` (now)."""
        now = time.time() if confirmed_at is None else confirmed_at
        histogram = self._of(database, destination).publish_latency
        for created_at in created:
            if created_at is None:
                continue
            if created_at.tzinfo is None:  # stores write UTC
                created_at = created_at.replace(tzinfo=UTC)
            # The database's clock wrote created_at: a skew must not make a latency negative.
            histogram.observe(max(now - created_at.timestamp(), 0.0))

    def observe_settle(
        self, destination: str, seconds: float, settled: int, *, database: str = DEFAULT_DATABASE
    ) -> None:
        """Settling ``settled`` messages took ``seconds``: they are no longer in flight."""
        series = self._of(database, destination)
        series.settle_duration.observe(seconds)
        if settled:
            series.in_flight.dec(settled)

    def observe_sqlite_wal(self, size: int, *, database: str = DEFAULT_DATABASE) -> None:
        """The SQLite database's -wal file is ``size`` bytes after a cleanup round."""
        self.sqlite_wal_bytes.labels(database).set(size)

    def observe_store_status(
        self, statuses: Sequence[DestinationStatus] | None, database: str = DEFAULT_DATABASE
    ) -> None:
        """The outbox status query's answer (None: it failed), shown until the next one."""
        self._store.statuses[database] = statuses

    # ----- scrapes ---------------------------------------------------------------------------

    def render(self, accept: str | None = None) -> tuple[bytes, str]:
        """The registry in the format ``accept`` asks for: (body, content type)."""
        exposition = importlib.import_module("prometheus_client.exposition")
        encoder, content_type = exposition.choose_encoder(accept or "")
        body: bytes = encoder(self.registry)
        return body, str(content_type)


__all__ = [
    "DESTINATION_COUNTERS",
    "LATENCY_BUCKETS",
    "RELAY_COUNTERS",
    "STATEMENT_BUCKETS",
    "Metrics",
    "RelayCounters",
    "prometheus_client",
]
