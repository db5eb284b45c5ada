"""The relay's and the API's Prometheus metrics on prometheus_client (outboxer.metrics)."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import pytest
from prometheus_client.parser import text_string_to_metric_families

from outboxer.errors import MissingDependencyError
from outboxer.metrics import Metrics
from outboxer.relay import RelayStats
from outboxer.stores import DestinationStatus

#: The names dashboards and alert rules use: a rename breaks them, so it must break this test.
COUNTERS_PER_DESTINATION = (
    "outboxer_messages_claimed_total",
    "outboxer_messages_published_total",
    "outboxer_messages_failed_total",
    "outboxer_messages_abandoned_total",
    "outboxer_messages_released_total",
    "outboxer_messages_lost_total",
    "outboxer_batches_total",
    "outboxer_claim_seconds_total",
    "outboxer_publish_seconds_total",
    "outboxer_settle_seconds_total",
    "outboxer_broker_connects_total",
    "outboxer_lease_renewals_total",
    "outboxer_leases_lost_total",
    "outboxer_messages_recovered_total",
    "outboxer_settles_refused_total",
    "outboxer_outcomes_unrecorded_total",
)


@dataclass
class FakeRelay:
    stats: RelayStats = field(default_factory=RelayStats)
    destination_stats: dict[str, RelayStats] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    database: str = "default"

    def health_problems(self) -> list[str]:
        return self.problems


def samples(metrics: Metrics, accept: str | None = None) -> dict[tuple[str, frozenset], float]:
    """Every sample of a scrape, parsed back by prometheus_client's own parser."""
    body, _ = metrics.render(accept)
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(body.decode())
        for sample in family.samples
    }


def labels(**given: str) -> frozenset:
    return frozenset(given.items())


def test_the_relay_counters_keep_their_names_labels_and_values() -> None:
    relay = FakeRelay(
        stats=RelayStats(published=7, cleaned=4, store_errors=2, started_at=0.0),
        destination_stats={
            "internal": RelayStats(published=5, failed=1, claim_seconds=0.25, broker_reconnects=1),
            "partner": RelayStats(
                published=2, abandoned_now=3, lost=1, renewals=6, leases_lost=1, recovered=2
            ),
        },
    )
    metrics = Metrics(["internal", "partner"])
    metrics.watch_relay(relay)
    scraped = samples(metrics)
    for name in COUNTERS_PER_DESTINATION:
        for destination in ("internal", "partner"):
            assert (name, labels(database="default", destination=destination)) in scraped, name
    assert (
        scraped[
            "outboxer_messages_published_total", labels(database="default", destination="internal")
        ]
        == 5
    )
    assert (
        scraped[
            "outboxer_messages_published_total", labels(database="default", destination="partner")
        ]
        == 2
    )
    assert (
        scraped[
            "outboxer_messages_failed_total", labels(database="default", destination="internal")
        ]
        == 1
    )
    assert (
        scraped[
            "outboxer_messages_abandoned_total", labels(database="default", destination="partner")
        ]
        == 3
    )
    assert (
        scraped["outboxer_messages_lost_total", labels(database="default", destination="partner")]
        == 1
    )
    assert (
        scraped["outboxer_claim_seconds_total", labels(database="default", destination="internal")]
        == 0.25
    )
    assert (
        scraped[
            "outboxer_broker_connects_total", labels(database="default", destination="internal")
        ]
        == 1
    )
    assert (
        scraped["outboxer_lease_renewals_total", labels(database="default", destination="partner")]
        == 6
    )
    assert (
        scraped["outboxer_leases_lost_total", labels(database="default", destination="partner")]
        == 1
    )
    assert (
        scraped[
            "outboxer_messages_recovered_total", labels(database="default", destination="partner")
        ]
        == 2
    )
    assert scraped["outboxer_messages_cleaned_total", labels(database="default")] == 4
    assert scraped["outboxer_store_errors_total", labels(database="default")] == 2
    assert scraped["outboxer_relay_uptime_seconds", labels()] > 1e9  # started at the epoch
    assert scraped["outboxer_relay_healthy", labels(database="default")] == 1

    # Read at each scrape: the relay's counting shows without any call on Metrics.
    relay.destination_stats["internal"].published += 10
    relay.problems.append("database: unreachable")
    scraped = samples(metrics)
    assert (
        scraped[
            "outboxer_messages_published_total", labels(database="default", destination="internal")
        ]
        == 15
    )
    assert scraped["outboxer_relay_healthy", labels(database="default")] == 0


def test_latency_from_creation_to_confirm_goes_into_buckets_per_destination() -> None:
    metrics = Metrics(["internal", "partner"], process_metrics=False)
    confirmed = datetime(2030, 1, 1, 12, 0, 0, tzinfo=UTC)
    metrics.observe_confirmed(
        "internal",
        [
            confirmed - timedelta(seconds=0.3),
            confirmed.replace(tzinfo=None) - timedelta(seconds=40),  # naive: the stores' UTC
            confirmed + timedelta(seconds=2),  # the database's clock runs ahead: 0, not -2
            None,  # a message without a creation time is not counted
        ],
        confirmed_at=confirmed.timestamp(),
    )
    scraped = samples(metrics)

    def bucket(le: str, destination: str = "internal") -> float:
        return scraped[
            "outboxer_publish_latency_seconds_bucket",
            labels(database="default", destination=destination, le=le),
        ]

    assert bucket("0.005") == 1  # the skewed one, at 0
    assert bucket("0.25") == 1
    assert bucket("0.5") == 2
    assert bucket("30.0") == 2
    assert bucket("60.0") == 3
    assert (
        scraped[
            "outboxer_publish_latency_seconds_count",
            labels(database="default", destination="internal"),
        ]
        == 3
    )
    assert scraped[
        "outboxer_publish_latency_seconds_sum", labels(database="default", destination="internal")
    ] == pytest.approx(40.3)
    # A configured destination shows zeros before its first message.
    assert bucket("+Inf", "partner") == 0


def test_claim_and_settle_durations_and_messages_in_flight() -> None:
    metrics = Metrics(["internal"], process_metrics=False)
    metrics.observe_claim("internal", 0.004, 5)
    metrics.observe_claim("internal", 0.0002, 0)  # found nothing
    metrics.observe_claim("internal", 0.03, 3)
    in_flight = ("outboxer_messages_in_flight", labels(database="default", destination="internal"))
    assert samples(metrics)[in_flight] == 8
    metrics.observe_settle("internal", 0.002, 5)
    scraped = samples(metrics)
    assert scraped[in_flight] == 3
    claim = "outboxer_claim_duration_seconds"
    assert scraped[f"{claim}_count", labels(database="default", destination="internal")] == 3
    assert (
        scraped[f"{claim}_bucket", labels(database="default", destination="internal", le="0.0005")]
        == 1
    )
    assert (
        scraped[f"{claim}_bucket", labels(database="default", destination="internal", le="0.005")]
        == 2
    )
    assert (
        scraped[f"{claim}_bucket", labels(database="default", destination="internal", le="0.05")]
        == 3
    )
    settle = "outboxer_settle_duration_seconds"
    assert scraped[f"{settle}_count", labels(database="default", destination="internal")] == 1
    assert (
        scraped[f"{settle}_bucket", labels(database="default", destination="internal", le="0.0025")]
        == 1
    )


def test_table_gauges_show_every_status_and_the_oldest_pending_age() -> None:
    metrics = Metrics(database="default", process_metrics=False)
    scraped = samples(metrics)
    assert scraped["outboxer_store_up", labels(database="default")] == 0  # no answer yet
    assert not any(name == "outboxer_messages" for name, _ in scraped)

    metrics.observe_store_status(
        [
            DestinationStatus("internal", {"PENDING": 4, "PUBLISHED": 90}, 12.5),
            DestinationStatus("partner", {}, None, published_estimated=True),
        ]
    )
    scraped = samples(metrics)
    assert scraped["outboxer_store_up", labels(database="default")] == 1
    estimated = "outboxer_messages_published_estimated"
    assert scraped[estimated, labels(database="default", destination="internal")] == 0
    assert scraped[estimated, labels(database="default", destination="partner")] == 1
    for status in ("PENDING", "PROCESSING", "PUBLISHED", "FAILED", "ABANDONED"):
        assert (
            "outboxer_messages",
            labels(database="default", destination="partner", status=status),
        ) in scraped
    assert (
        scraped[
            "outboxer_messages",
            labels(database="default", destination="internal", status="PENDING"),
        ]
        == 4
    )
    assert (
        scraped[
            "outboxer_messages", labels(database="default", destination="internal", status="FAILED")
        ]
        == 0
    )
    assert (
        scraped[
            "outboxer_oldest_pending_age_seconds",
            labels(database="default", destination="internal"),
        ]
        == 12.5
    )
    assert (
        scraped[
            "outboxer_oldest_pending_age_seconds", labels(database="default", destination="partner")
        ]
        == 0
    )

    metrics.observe_store_status(None)  # the query failed: up 0, no stale numbers
    scraped = samples(metrics)
    assert scraped["outboxer_store_up", labels(database="default")] == 0
    assert (
        "outboxer_messages",
        labels(database="default", destination="internal", status="PENDING"),
    ) not in scraped


def test_openmetrics_when_the_scraper_asks_for_it_else_the_text_format() -> None:
    metrics = Metrics(["internal"])
    metrics.watch_relay(FakeRelay(destination_stats={"internal": RelayStats(published=1)}))
    body, content_type = metrics.render(None)
    assert content_type.startswith("text/plain; version=0.0.4")
    assert not body.endswith(b"# EOF\n")
    assert b"process_cpu_seconds_total" in body  # the process's own metrics come along

    # What Prometheus sends when it prefers OpenMetrics.
    accept = (
        "application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
        "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
    )
    body, content_type = metrics.render(accept)
    assert content_type.startswith("application/openmetrics-text; version=1.0.0")
    assert body.endswith(b"# EOF\n")
    assert (
        b'outboxer_messages_published_total{database="default",destination="internal"} 1.0' in body
    )
    assert b"# TYPE outboxer_messages_published counter" in body


def test_two_relays_in_one_process_keep_their_own_registries() -> None:
    first, second = Metrics(["internal"]), Metrics(["internal"])
    first.observe_claim("internal", 0.01, 2)
    assert (
        samples(first)[
            "outboxer_messages_in_flight", labels(database="default", destination="internal")
        ]
        == 2
    )
    assert (
        samples(second)[
            "outboxer_messages_in_flight", labels(database="default", destination="internal")
        ]
        == 0
    )


def test_the_relays_of_several_databases_share_one_registry_each_labelled() -> None:
    metrics = Metrics(process_metrics=False)
    orders = FakeRelay(
        stats=RelayStats(store_errors=1, started_at=100.0),
        destination_stats={"default": RelayStats(published=3)},
        database="orders",
    )
    billing = FakeRelay(
        stats=RelayStats(started_at=50.0),
        destination_stats={"default": RelayStats(published=8)},
        problems=["database: unreachable"],
        database="billing",
    )
    for relay in (orders, billing):
        metrics.add_series(relay.database, relay.destination_stats)
        metrics.watch_relay(relay)
    metrics.observe_claim("default", 0.01, 2, database="orders")
    metrics.observe_store_status([DestinationStatus("default", {"PENDING": 1})], "orders")
    scraped = samples(metrics)
    published = "outboxer_messages_published_total"
    assert scraped[published, labels(database="orders", destination="default")] == 3
    assert scraped[published, labels(database="billing", destination="default")] == 8
    assert scraped["outboxer_store_errors_total", labels(database="orders")] == 1
    assert scraped["outboxer_relay_healthy", labels(database="orders")] == 1
    assert scraped["outboxer_relay_healthy", labels(database="billing")] == 0
    in_flight = "outboxer_messages_in_flight"
    assert scraped[in_flight, labels(database="orders", destination="default")] == 2
    assert scraped[in_flight, labels(database="billing", destination="default")] == 0
    assert scraped["outboxer_store_up", labels(database="orders")] == 1
    assert scraped["outboxer_store_up", labels(database="billing")] == 0, "no answer yet"
    assert (
        scraped[
            "outboxer_messages", labels(database="orders", destination="default", status="PENDING")
        ]
        == 1
    )
    assert not any(dict(labelset).get("database") == "default" for _, labelset in scraped), (
        "no series of a database that is not there"
    )
    uptime = scraped["outboxer_relay_uptime_seconds", labels()]
    assert uptime > 1e9, "one uptime for the process: since its first relay started"


def test_without_prometheus_client_the_error_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import raises ImportError
    with pytest.raises(MissingDependencyError, match=r"pip install 'outboxer\[metrics\]'"):
        Metrics()
