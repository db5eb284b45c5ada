"""The stream relay's HTTP API and Prometheus metrics (``outboxer stream-relay --http``).

The table relay's server (:class:`outboxer.http.HttpServer`: uvicorn, request deadlines,
bounded heads, JSON errors) serves :class:`StreamApi`, which answers ``GET /health``,
``GET /metrics`` and ``GET /status`` from the relay's own counters and its last backlog
measurement: no endpoint queries the database or changes anything, so the API needs no
token on any address.
"""

from __future__ import annotations

import http
import importlib
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from outboxer.config import parse_http_address
from outboxer.http import HttpError as _HttpError
from outboxer.http import (
    MethodNotAllowed,
    NotFound,
    Request,
    Response,
    error_response,
    json_response,
    metrics_accept,
)
from outboxer.streamrelay import StreamRelay

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

    from outboxer.http import HttpServer
    from outboxer.metrics import Metrics

#: (metric, StreamStats attribute, help): counters labelled destination and mode.
STREAM_COUNTERS: tuple[tuple[str, str, str], ...] = (
    (
        "outboxer_stream_messages_published_total",
        "published",
        "Messages the broker confirmed and the stream's checkpoint passed.",
    ),
    (
        "outboxer_stream_messages_failed_total",
        "failed",
        "Failed publish attempts counted against a message (retried, or dead-lettered).",
    ),
    (
        "outboxer_stream_dead_letters_total",
        "dead_lettered",
        "Messages the stream went past without publishing them (dead letters, held ones included).",
    ),
    (
        "outboxer_stream_messages_held_total",
        "held",
        "Dead letters held behind an earlier dead letter of their key (abandoned_blocks_key).",
    ),
    ("outboxer_stream_checkpoints_total", "commits", "Checkpoints the relay stored."),
    (
        "outboxer_stream_database_outages_total",
        "outages",
        "Rounds cut short by a lost database connection (the relay reconnects).",
    ),
)


#: pg_replication_slots.wal_status's values (PostgreSQL 13 and later).
WAL_STATUSES = ("reserved", "extended", "unreserved", "lost")


class StreamCollector:
    """The relay's counters and gauges, read at each scrape."""

    def __init__(self, relay: StreamRelay) -> None:
        self.relay = relay

    def collect(self) -> Iterator[Metric]:
        core = importlib.import_module("prometheus_client.core")
        relay, stats = self.relay, self.relay.stats
        labels = [relay.destination, relay.mode]
        names = ["destination", "mode"]
        for name, attribute, text in STREAM_COUNTERS:
            family = core.CounterMetricFamily(name, text, labels=names)
            family.add_metric(labels, getattr(stats, attribute))
            yield family

        def gauge(name: str, text: str, value: float | None) -> Any:
            family = core.GaugeMetricFamily(name, text, labels=names)
            if value is not None:
                family.add_metric(labels, value)
            return family

        now = time.time()
        backlog = stats.backlog
        yield gauge(
            "outboxer_stream_entries_behind",
            "Messages after the stream's checkpoint, counted up to 100,000 at the last backlog "
            "probe (every probe_interval).",
            backlog.entries if backlog is not None else None,
        )
        yield gauge(
            "outboxer_stream_lag_seconds",
            "Age of the oldest message after the checkpoint at the last backlog probe; 0 "
            "when there was none.",
            backlog.age() if backlog is not None else None,
        )
        yield gauge(
            "outboxer_stream_checkpoint_age_seconds",
            "Seconds since the relay last moved the stream's checkpoint (or started).",
            max(now - (stats.checkpoint_at or stats.started_at), 0.0),
        )
        yield gauge(
            "outboxer_stream_failing_messages",
            "Messages that failed and are being retried (not yet published or dead-lettered).",
            relay.failing,
        )
        if relay.mode == "wal":
            yield gauge(
                "outboxer_stream_wal_retained_bytes",
                "WAL the destination's slot keeps (from its restart_lsn to the WAL's end).",
                backlog.wal_retained_bytes if backlog is not None else None,
            )
            yield gauge(
                "outboxer_stream_wal_behind_bytes",
                "WAL between the slot's confirmed position and the WAL's end.",
                backlog.wal_behind_bytes if backlog is not None else None,
            )
            yield gauge(
                "outboxer_stream_wal_safe_bytes",
                "WAL that may still be written before the server invalidates the slot "
                "(safe_wal_size; <= 0 once unreserved); absent without max_slot_wal_keep_size.",
                backlog.wal_safe_bytes if backlog is not None else None,
            )
            yield gauge(
                "outboxer_stream_wal_keep_limit_bytes",
                "The server's max_slot_wal_keep_size in bytes; absent when it is -1 (no limit).",
                backlog.wal_keep_limit_bytes if backlog is not None else None,
            )
            # A state set (one series per state, 1 for the current one): every series is
            # always there, so an alert's `for` and a dashboard see 0 -> 1, not a series
            # that appears; a status label on a single series would change its identity.
            status = core.GaugeMetricFamily(
                "outboxer_stream_wal_status",
                "1 for the slot's wal_status at the last backlog probe (unreserved: the next "
                "checkpoint may invalidate it; lost: invalidated), 0 for the others.",
                labels=[*names, "status"],
            )
            if backlog is not None and backlog.wal_status is not None:
                for state in WAL_STATUSES:
                    status.add_metric([*labels, state], int(backlog.wal_status == state))
            yield status
        yield gauge(
            "outboxer_stream_relay_healthy",
            "1 while the stream relay runs and nothing is in an outage backoff (as /health).",
            int(not relay.health_problems()),
        )
        yield gauge(
            "outboxer_stream_relay_uptime_seconds",
            "Seconds since this stream relay started.",
            max(now - stats.started_at, 0.0),
        )


def stream_metrics(relay: StreamRelay) -> Metrics:
    """The relay's registry, set as its ``metrics``: its counters and gauges, the publish
    latency histogram it feeds, process metrics; no outbox table gauges (there is no table)."""
    from outboxer.metrics import Metrics

    metrics = Metrics(store_gauges=False)
    metrics.registry.register(StreamCollector(relay))
    relay.metrics = metrics
    return metrics


def status_view(relay: StreamRelay) -> dict[str, Any]:
    """What ``GET /status`` answers: the relay's own view, no query."""
    stats = relay.stats
    backlog = stats.backlog
    return {
        "mode": relay.mode,
        "destination": relay.destination,
        "healthy": not relay.health_problems(),
        "problems": relay.health_problems(),
        "warnings": relay.health_warnings(),
        "published": stats.published,
        "failed_attempts": stats.failed,
        "dead_letters": stats.dead_lettered,
        "held": stats.held,
        "failing": relay.failing,
        "checkpoint_age_seconds": round(time.time() - (stats.checkpoint_at or stats.started_at), 3),
        "entries_behind": backlog.entries if backlog is not None else None,
        "entries_behind_capped": backlog.capped if backlog is not None else None,
        "oldest_unpublished_age_seconds": round(backlog.age(), 3) if backlog is not None else None,
        "wal_retained_bytes": backlog.wal_retained_bytes if backlog is not None else None,
        "wal_status": backlog.wal_status if backlog is not None else None,
        "wal_safe_bytes": backlog.wal_safe_bytes if backlog is not None else None,
    }


class StreamApi:
    """``/health``, ``/metrics`` and ``/status`` of one stream relay (read only)."""

    writes = False

    def __init__(self, relay: StreamRelay, metrics: Metrics) -> None:
        self.relay = relay
        self.metrics = metrics
        self.token: str | None = None
        self.routes = {"/health": self.health, "/metrics": self.render, "/status": self.status}

    async def handle(self, request: Request) -> Response:
        try:
            handler = self.routes.get(request.path)
            if handler is None:
                raise NotFound(f"no endpoint {request.path}; try one of {', '.join(self.routes)}")
            if request.method != "GET":
                raise MethodNotAllowed(
                    f"{request.path} accepts GET, not {request.method}", headers={"Allow": "GET"}
                )
            return await handler(request)
        except _HttpError as exc:
            return error_response(exc)

    async def health(self, request: Request) -> Response:
        problems = self.relay.health_problems()
        # Working but at risk (a slot close to invalidation): "degraded" and 200, as the
        # table relay's API for one database down of several: failing the probe would have
        # an orchestrator restart the one process that can still save the slot.
        warnings = self.relay.health_warnings()
        status = "unavailable" if problems else "degraded" if warnings else "ok"
        body: dict[str, object] = {
            "status": status,
            "mode": self.relay.mode,
            "destination": self.relay.destination,
        }
        if problems or warnings:
            body["reasons"] = problems + warnings
        if problems:
            return json_response(http.HTTPStatus.SERVICE_UNAVAILABLE, body)
        return json_response(http.HTTPStatus.OK, body)

    async def render(self, request: Request) -> Response:
        body, content_type = self.metrics.render(metrics_accept(request))
        return Response(http.HTTPStatus.OK, body, content_type)

    async def status(self, request: Request) -> Response:
        return json_response(http.HTTPStatus.OK, status_view(self.relay))

    async def sample_forever(self) -> None:
        """No dashboard here: nothing to sample."""

    async def close(self) -> None:
        """No store of its own to close."""


async def start_stream_api(
    address: str,
    relay: StreamRelay,
    metrics: Metrics,
    allowed_hosts: Sequence[str] | None = None,
) -> HttpServer:
    """Listen on ``address`` (``HOST:PORT``), answering for ``allowed_hosts`` (see
    ``check_host``); ConfigError if it cannot."""
    from outboxer.http import _HTTP_EXTRA, HttpServer, _require

    host, port = parse_http_address(address, "--http")
    for module in _HTTP_EXTRA:
        _require(module)
    return await HttpServer(
        StreamApi(relay, metrics), host, port, allowed_hosts=allowed_hosts
    ).start()


__all__ = [
    "STREAM_COUNTERS",
    "WAL_STATUSES",
    "StreamApi",
    "StreamCollector",
    "start_stream_api",
    "stream_metrics",
]
