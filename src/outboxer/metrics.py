"""Prometheus metrics of a relay or an API process, on ``prometheus_client`` (``outboxer[metrics]``).

One ``Metrics`` object per relay or API process holds its own ``CollectorRegistry`` (never
the library's global one, so two relays in one process, or an application's own metrics,
do not collide). It exposes:

- the relay's counters under the names dashboards already use
  (``outboxer_messages_published_total{destination}`` …), read from the relay's
  ``RelayStats`` when scraped, so the relay keeps counting in one place;
- histograms per destination of the latency from a message's ``created_at`` (its
  transaction) to the broker's confirm, and of the claim and settle statements' durations;
- gauges per destination of the messages in flight (claimed, not yet settled), and, from
  the outbox table, the rows by status and the oldest pending message's age.

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
from typing import TYPE_CHECKING, Protocol

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
#: (metric, RelayStats attribute, help), one series per destination (label ``destination``).
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
#: Counters of the relay as a whole (no label).
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
)


def prometheus_client() -> ModuleType:
    """The ``prometheus_client`` module, or MissingDependencyError naming the extra."""
    try:
        return importlib.import_module("prometheus_client")
    except ImportError as exc:
        raise MissingDependencyError("prometheus_client", "metrics") from exc


class RelayCounters(Protocol):
    """What ``Metrics`` reads from a relay at scrape time (``outboxer.Relay`` has it)."""

    @property
    def stats(self) -> RelayStats: ...

    @property
    def destination_stats(self) -> Mapping[str, RelayStats]: ...

    def health_problems(self) -> list[str]: ...


class _RelayCollector:
    """The relay's counters and health, read from its ``RelayStats`` at each scrape."""

    def __init__(self, relay: RelayCounters) -> None:
        self.relay = relay

    def collect(self) -> Iterator[Metric]:
        core = importlib.import_module("prometheus_client.core")
        per_destination = sorted(self.relay.destination_stats.items())
        for name, attribute, text in DESTINATION_COUNTERS:
            family = core.CounterMetricFamily(name, text, labels=["destination"])
            for destination, counts in per_destination:
                family.add_metric([destination], getattr(counts, attribute))
            yield family
        stats = self.relay.stats
        for name, attribute, text in RELAY_COUNTERS:
            yield core.CounterMetricFamily(name, text, value=getattr(stats, attribute))
        yield core.GaugeMetricFamily(
            "outboxer_relay_uptime_seconds",
            "Seconds since this relay started.",
            value=max(time.time() - stats.started_at, 0.0),
        )
        yield core.GaugeMetricFamily(
            "outboxer_relay_healthy",
            "1 while the relay's loops run and nothing is in an outage backoff (as /health).",
            value=int(not self.relay.health_problems()),
        )


class _StoreCollector:
    """Gauges from the last outbox status query (``Metrics.observe_store_status``)."""

    def __init__(self) -> None:
        self.statuses: Sequence[DestinationStatus] | None = None

    def collect(self) -> Iterator[Metric]:
        core = importlib.import_module("prometheus_client.core")
        statuses = self.statuses
        yield core.GaugeMetricFamily(
            "outboxer_store_up",
            "1 if the last outbox status query succeeded (it is cached for a few seconds).",
            value=int(statuses is not None),
        )
        if statuses is None:
            return
        counts = core.GaugeMetricFamily(
            "outboxer_messages",
            "Rows in the outbox, by destination and status.",
            labels=["destination", "status"],
        )
        ages = core.GaugeMetricFamily(
            "outboxer_oldest_pending_age_seconds",
            "Age of the oldest unfinished (PENDING, FAILED, PROCESSING) message; 0 when none.",
            labels=["destination"],
        )
        for entry in statuses:
            # Every status of every destination, zeros included: a series never vanishes.
            for status in ALL_STATUSES:
                counts.add_metric([entry.destination, status], entry.counts.get(status, 0))
            ages.add_metric([entry.destination], entry.oldest_pending_age or 0.0)
        yield counts
        yield ages


class Metrics:
    """The metrics of one relay or API process, in a registry of its own."""

    def __init__(self, destinations: Iterable[str] = (), *, process_metrics: bool = True) -> None:
        client = prometheus_client()
        self.registry = client.CollectorRegistry()
        self.publish_latency = client.Histogram(
            "outboxer_publish_latency_seconds",
            "Seconds from a message's creation (its enqueue transaction) to the broker's "
            "confirm, per published message.",
            ["destination"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.claim_duration = client.Histogram(
            "outboxer_claim_duration_seconds",
            "Seconds per claim statement (a claim that found nothing included).",
            ["destination"],
            buckets=STATEMENT_BUCKETS,
            registry=self.registry,
        )
        self.settle_duration = client.Histogram(
            "outboxer_settle_duration_seconds",
            "Seconds per settle (recording a batch's outcomes), retries after errors included.",
            ["destination"],
            buckets=STATEMENT_BUCKETS,
            registry=self.registry,
        )
        self.in_flight = client.Gauge(
            "outboxer_messages_in_flight",
            "Messages this relay claimed and has not settled yet.",
            ["destination"],
            registry=self.registry,
        )
        # Series of every configured destination exist from the start, at zero.
        for destination in destinations:
            for family in (
                self.publish_latency,
                self.claim_duration,
                self.settle_duration,
                self.in_flight,
            ):
                family.labels(destination)
        self._store = _StoreCollector()
        self.registry.register(self._store)
        if process_metrics:
            client.ProcessCollector(registry=self.registry)
            client.PlatformCollector(registry=self.registry)

    def watch_relay(self, relay: RelayCounters) -> None:
        """Expose ``relay``'s counters and health (read at each scrape)."""
        self.registry.register(_RelayCollector(relay))

    # ----- what the relay reports ------------------------------------------------------------

    def observe_claim(self, destination: str, seconds: float, claimed: int) -> None:
        """A claim statement took ``seconds`` and took ``claimed`` messages into flight."""
        self.claim_duration.labels(destination).observe(seconds)
        if claimed:
            self.in_flight.labels(destination).inc(claimed)

    def observe_confirmed(
        self,
        destination: str,
        created: Iterable[datetime | None],
        confirmed_at: float | None = None,
    ) -> None:
        """The broker confirmed messages created at ``created`` at ``confirmed_at`` (now)."""
        now = time.time() if confirmed_at is None else confirmed_at
        histogram = self.publish_latency.labels(destination)
        for created_at in created:
            if created_at is None:
                continue
            if created_at.tzinfo is None:  # stores write UTC
                created_at = created_at.replace(tzinfo=UTC)
            # The database's clock wrote created_at: a skew must not make a latency negative.
            histogram.observe(max(now - created_at.timestamp(), 0.0))

    def observe_settle(self, destination: str, seconds: float, settled: int) -> None:
        """Settling ``settled`` messages took ``seconds``: they are no longer in flight."""
        self.settle_duration.labels(destination).observe(seconds)
        if settled:
            self.in_flight.labels(destination).dec(settled)

    def observe_store_status(self, statuses: Sequence[DestinationStatus] | None) -> None:
        """The outbox status query's answer (None: it failed), shown until the next one."""
        self._store.statuses = statuses

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
