"""The HTTP API: health, Prometheus metrics, status, messages and requeue.

It runs inside the relay (``outboxer relay --http HOST:PORT``) or alone
(``outboxer serve --http HOST:PORT``, the same endpoints without the relay's
counters).

DESIGN: a small HTTP/1.1 server on ``asyncio.start_server``, so the API adds no
dependency. One request per connection (``Connection: close``): probes,
scrapers and operators send a request every few seconds at most, so keep-alive
would buy nothing and would let idle clients hold connections. Every read has a
deadline and every response is written with one, so a slow or silent client
holds one small task, never the relay's loops. The API has its own store
(its own connection or pool): a slow status query cannot take a connection the
relay's claims are waiting for, and the relay closing its store on shutdown
cannot pull one out from under a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import http
import json
import math
import re
import signal
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, unquote

from outboxer.config import Settings, is_loopback, parse_http_address
from outboxer.errors import ConfigError, PayloadError, StoreError
from outboxer.message import Status, check_text
from outboxer.redact import get_logger, redact_text
from outboxer.relay import Relay, RelayStats
from outboxer.stores import DestinationStatus, Store, create_store

logger = get_logger("outboxer.http")

MAX_BODY_BYTES = 64 * 1024
MAX_HEAD_BYTES = 16 * 1024
MAX_HEADERS = 100
#: Seconds a client has to send its whole request (and to take the response).
READ_TIMEOUT = 10.0
MAX_CONNECTIONS = 64
#: Seconds ``/metrics`` reuses one status query: it is a GROUP BY over the outbox.
STATUS_CACHE_SECONDS = 5.0
#: Seconds ``/health`` and ``/metrics`` wait for the database before saying it did not answer.
STORE_TIMEOUT = 5.0
#: Seconds ``/status`` and ``/messages`` wait for their queries.
QUERY_TIMEOUT = 30.0
#: Shortest bearer token accepted: a short token can be guessed over the network.
MIN_TOKEN_LENGTH = 16
MESSAGES_DEFAULT_LIMIT = 50
MESSAGES_MAX_LIMIT = 1000
REQUEUE_STATUSES = (Status.ABANDONED.value, Status.FAILED.value)
ALL_STATUSES = tuple(status.value for status in Status)
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
JSON_CONTENT_TYPE = "application/json"

#: After an error response to a request whose body was not read, read (and drop) what the
#: client still sends before closing: closing a socket with unread input makes the kernel
#: send a reset, and the client may lose the response before it reads it.
_LINGER_SECONDS = 2.0
_LINGER_BYTES = 1024 * 1024

# Matched with fullmatch: ``$`` would also accept a trailing newline. Digits are ASCII only:
# ``\d``, ``str.isdigit()`` and ``int()`` also take "²" or "٣", which HTTP never means.
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_VERSION = re.compile(r"HTTP/([0-9])\.([0-9])")
_ASCII_DIGITS = re.compile(r"[0-9]+")
#: A serialized origin (RFC 6454, 6.1): scheme, host and port only.
_ORIGIN = re.compile(r"https?://([^/?#@\s]+)", re.IGNORECASE)
#: Characters no request target or field value may hold (RFC 9110, 5.5): controls but HTAB.
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
_METRIC_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
#: What ``parse_ascii_int`` returns for a number of more digits than any limit here needs.
_HUGE = 10**18


# ----- errors that become responses --------------------------------------------------------


class HttpError(Exception):
    """A request the API answers with an error status and ``{"error", "type"}``."""

    status = http.HTTPStatus.INTERNAL_SERVER_ERROR

    def __init__(self, message: str, *, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.headers = dict(headers or {})


class BadRequest(HttpError):
    status = http.HTTPStatus.BAD_REQUEST


class Unauthorized(HttpError):
    status = http.HTTPStatus.UNAUTHORIZED


class Forbidden(HttpError):
    status = http.HTTPStatus.FORBIDDEN


class MisdirectedRequest(HttpError):
    status = http.HTTPStatus.MISDIRECTED_REQUEST


class UnsupportedMediaType(HttpError):
    status = http.HTTPStatus.UNSUPPORTED_MEDIA_TYPE


class NotFound(HttpError):
    status = http.HTTPStatus.NOT_FOUND


class MethodNotAllowed(HttpError):
    status = http.HTTPStatus.METHOD_NOT_ALLOWED


class RequestTimeout(HttpError):
    status = http.HTTPStatus.REQUEST_TIMEOUT


class LengthRequired(HttpError):
    status = http.HTTPStatus.LENGTH_REQUIRED


class PayloadTooLarge(HttpError):
    status = http.HTTPStatus.REQUEST_ENTITY_TOO_LARGE


class HeadersTooLarge(HttpError):
    status = http.HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE


class ServiceUnavailable(HttpError):
    status = http.HTTPStatus.SERVICE_UNAVAILABLE


class VersionNotSupported(HttpError):
    status = http.HTTPStatus.HTTP_VERSION_NOT_SUPPORTED


class _ClientGone(Exception):
    """The client closed the connection without sending a request: nothing to answer."""


# ----- requests and responses --------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    method: str
    #: Percent-decoded path, without the query string.
    path: str
    query: dict[str, list[str]] = field(default_factory=dict)
    #: Names lower-cased; a repeated header's values joined with ", " (RFC 9110, 5.3).
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes
    content_type: str = JSON_CONTENT_TYPE
    headers: Mapping[str, str] = field(default_factory=dict)


def parse_ascii_int(text: str) -> int | None:
    """A whole number in ASCII digits (leading zeros allowed), else None.

    Numbers of more than 18 digits come back as 10**18, above every limit here: ``int()``
    refuses strings of over 4300 digits with a ValueError.
    """
    if not _ASCII_DIGITS.fullmatch(text):
        return None
    digits = text.lstrip("0") or "0"
    return int(digits) if len(digits) <= 18 else _HUGE


def parse_head(head: bytes) -> Request:
    """The request line and header fields of ``head`` (up to and including the blank line)."""
    lines = head.decode("latin-1").split("\r\n")
    while lines and lines[-1] == "":
        lines.pop()
    if not lines:
        raise BadRequest("empty request")
    parts = lines[0].split(" ")
    if len(parts) != 3:
        raise BadRequest(f"malformed request line {lines[0][:100]!r}")
    method, target, version = parts
    if not _TOKEN.fullmatch(method):
        raise BadRequest(f"malformed method {method[:40]!r}")
    match = _VERSION.fullmatch(version)
    if match is None:
        raise BadRequest(f"malformed HTTP version {version[:40]!r}")
    if match.group(1) != "1":
        raise VersionNotSupported(
            f"HTTP/{match.group(1)}.{match.group(2)} is not supported; use HTTP/1.1"
        )
    if not target.startswith("/") or _CONTROL.search(target):
        raise BadRequest(
            f"the request target must be a path starting with '/'; got {target[:100]!r}"
        )
    if len(lines) - 1 > MAX_HEADERS:
        raise HeadersTooLarge(f"more than {MAX_HEADERS} header fields")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line[:1] in (" ", "\t"):
            raise BadRequest("folded header lines are not accepted (RFC 9112, 5.2)")
        name, sep, value = line.partition(":")
        if not sep or not _TOKEN.fullmatch(name) or _CONTROL.search(value):
            raise BadRequest(f"malformed header line {line[:100]!r}")
        name, value = name.lower(), value.strip(" \t")
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    # Split by hand, not with urlsplit: a target such as "//[x" is a path here, not a
    # network location to parse (urlsplit raises on it).
    path, _, query_text = target.partition("#")[0].partition("?")
    try:
        query = parse_qs(query_text, keep_blank_values=True, max_num_fields=50)
    except ValueError as exc:
        raise BadRequest(f"malformed query string: {exc}") from None
    return Request(method=method, path=unquote(path), query=query, headers=headers)


def body_length(headers: Mapping[str, str], max_body: int = MAX_BODY_BYTES) -> int:
    """Bytes of body the request announces; raise when it cannot or must not be read."""
    if "transfer-encoding" in headers:
        raise LengthRequired("chunked or encoded bodies are not accepted: send Content-Length")
    announced = headers.get("content-length")
    if announced is None:
        return 0
    # "5, 5" is one length sent twice (RFC 9110, 8.6); "5, 6" cannot be read safely.
    lengths = {parse_ascii_int(value.strip()) for value in announced.split(",")}
    length = lengths.pop() if len(lengths) == 1 else None
    if length is None:
        raise BadRequest(f"malformed Content-Length {announced[:40]!r}")
    if length > max_body:
        raise PayloadTooLarge(
            f"the request body (Content-Length {announced[:40]}) is over the limit "
            f"of {max_body} bytes"
        )
    return length


async def read_request(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter | None = None,
    max_body: int = MAX_BODY_BYTES,
) -> Request:
    """Read one request; ``writer`` answers ``Expect: 100-continue`` before the body is read."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.LimitOverrunError:
        raise HeadersTooLarge(
            f"the request line and headers exceed {MAX_HEAD_BYTES} bytes"
        ) from None
    except asyncio.IncompleteReadError as exc:
        if not exc.partial.strip():
            raise _ClientGone from None
        raise BadRequest("the connection ended inside the request headers") from None
    request = parse_head(head)
    length = body_length(request.headers, max_body)
    if not length:
        return request
    if writer is not None and request.headers.get("expect", "").lower() == "100-continue":
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    try:
        body = await reader.readexactly(length)
    except asyncio.IncompleteReadError:
        raise BadRequest(f"the body ended before its Content-Length of {length} bytes") from None
    return dataclasses.replace(request, body=body)


# ----- requests from browsers ----------------------------------------------------------------
# A web page can make a browser send requests to 127.0.0.1, or, by pointing its own DNS name
# at 127.0.0.1 (DNS rebinding), read the answers. Browsers always say which page sent a
# request (Origin, on every POST) and which host they think they talk to (Host); curl,
# scrapers and probes send no Origin. A POST a page can send without asking the server first
# (a CORS preflight) cannot carry Content-Type: application/json, so requiring it stops
# the rest.


def check_origin(request: Request, server_authority: str) -> None:
    """Refuse a request sent by a page of another origin than this server's own."""
    origin = request.headers.get("origin")
    if origin is None:
        return
    own = request.headers.get("host", server_authority)
    match = _ORIGIN.fullmatch(origin)
    if match is None or match.group(1).lower() != own.lower():
        raise Forbidden(
            f"cross-origin request refused: Origin {origin[:100]!r} is not this API's own "
            f"origin (http://{own[:100]}); send the request without an Origin header"
        )


def check_host(request: Request, bind_host: str) -> None:
    """On loopback, refuse a Host that is not a loopback name: a DNS rebinding page sends its own."""
    host = request.headers.get("host")
    if host is None or not is_loopback(bind_host):
        return
    name = host_name(host)
    if name is None or not (is_loopback(name) or name.lower() == bind_host.lower()):
        raise MisdirectedRequest(
            f"this API listens on a loopback address and answers requests for localhost, "
            f"127.0.0.1 or [::1] only; got Host {host[:100]!r}"
        )


def host_name(host: str) -> str | None:
    """The name or address of a Host field (``name``, ``name:port``, ``[v6]:port``), or None."""
    if host.startswith("["):
        name, bracket, port = host[1:].partition("]")
        if not bracket or (port and not port.startswith(":")):
            return None
        port = port[1:]
    else:
        name, colon, port = host.partition(":")
        if colon and not port:
            return None
    if port:
        number = parse_ascii_int(port)
        if number is None or number > 65535:
            return None
    return name or None


def require_json(request: Request) -> None:
    given = request.headers.get("content-type")
    if given is None or given.partition(";")[0].strip(" \t").lower() != JSON_CONTENT_TYPE:
        raise UnsupportedMediaType(
            f"send the body as Content-Type: {JSON_CONTENT_TYPE}; got "
            + ("no Content-Type" if given is None else repr(given[:100])),
            headers={"Accept": JSON_CONTENT_TYPE},
        )


def check_token(token: object) -> None:
    """Refuse a bearer token that is empty, short, or that no Authorization header can carry."""
    if token is None:
        return
    if not isinstance(token, str):
        raise ConfigError(f"the HTTP API token must be a string, not {type(token).__name__}")
    if not token.strip():
        raise ConfigError(
            "the HTTP API token is empty: set one of at least "
            f"{MIN_TOKEN_LENGTH} characters, or none to answer requeue on loopback only"
        )
    if len(token) < MIN_TOKEN_LENGTH:
        raise ConfigError(
            f"the HTTP API token has {len(token)} characters; use at least {MIN_TOKEN_LENGTH}, "
            "such as the output of: python -c 'import secrets; print(secrets.token_urlsafe(32))'"
        )
    if token != token.strip(" \t") or _CONTROL.search(token):
        raise ConfigError(
            "the HTTP API token starts or ends with a space or holds a control character, "
            "which an Authorization header cannot carry"
        )


def json_response(
    status: int, payload: object, headers: Mapping[str, str] | None = None
) -> Response:
    # default=str, as `outboxer messages --json` prints ids and times.
    body = (json.dumps(payload, default=str) + "\n").encode()
    return Response(status, body, JSON_CONTENT_TYPE, dict(headers or {}))


def error_response(error: HttpError) -> Response:
    return json_response(
        error.status, {"error": str(error), "type": type(error).__name__}, error.headers
    )


def encode_response(response: Response) -> bytes:
    try:
        reason = http.HTTPStatus(response.status).phrase
    except ValueError:
        reason = "Unknown"
    lines = [
        f"HTTP/1.1 {response.status} {reason}",
        f"Content-Type: {response.content_type}",
        f"Content-Length: {len(response.body)}",
        "Connection: close",
        "Cache-Control: no-store",
    ]
    lines += [f"{name}: {value}" for name, value in response.headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + response.body


# ----- Prometheus text exposition (format 0.0.4) -------------------------------------------


@dataclass(frozen=True)
class Metric:
    """One metric family: its HELP and TYPE lines and its samples (labels, value)."""

    name: str
    kind: str
    help: str
    samples: Sequence[tuple[Mapping[str, str], float]]


def escape_label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def format_value(value: float) -> str:
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def render_metrics(metrics: Iterable[Metric]) -> str:
    lines: list[str] = []
    for metric in metrics:
        if not _METRIC_NAME.match(metric.name):
            raise ValueError(f"invalid metric name {metric.name!r}")
        if metric.kind not in ("counter", "gauge", "untyped"):
            raise ValueError(f"invalid metric type {metric.kind!r}")
        lines.append(f"# HELP {metric.name} {escape_help(metric.help)}")
        lines.append(f"# TYPE {metric.name} {metric.kind}")
        for labels, value in metric.samples:
            for label in labels:
                if not _LABEL_NAME.match(label) or label.startswith("__"):
                    raise ValueError(f"invalid label name {label!r}")
            rendered = ",".join(
                f'{label}="{escape_label_value(text)}"' for label, text in labels.items()
            )
            lines.append(
                f"{metric.name}{{{rendered}}} {format_value(value)}"
                if rendered
                else f"{metric.name} {format_value(value)}"
            )
    return "\n".join(lines) + "\n" if lines else ""


#: (metric, RelayStats attribute, help), one series per destination (label ``destination``).
_DESTINATION_COUNTERS: tuple[tuple[str, str, str], ...] = (
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
)
#: Counters of the relay as a whole (no label).
_RELAY_COUNTERS: tuple[tuple[str, str, str], ...] = (
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


def relay_metrics(
    stats: RelayStats,
    healthy: bool,
    now: float | None = None,
    destinations: Mapping[str, RelayStats] | None = None,
) -> list[Metric]:
    """The relay's counters: per destination where ``destinations`` says, else unlabelled."""
    per_destination = sorted((destinations or {}).items())
    metrics = [
        Metric(
            name,
            "counter",
            text,
            [
                ({"destination": destination}, getattr(counts, attribute))
                for destination, counts in per_destination
            ]
            if per_destination
            else [({}, getattr(stats, attribute))],
        )
        for name, attribute, text in _DESTINATION_COUNTERS
    ]
    metrics += [
        Metric(name, "counter", text, [({}, getattr(stats, attribute))])
        for name, attribute, text in _RELAY_COUNTERS
    ]
    uptime = (time.time() if now is None else now) - stats.started_at
    metrics.append(
        Metric(
            "outboxer_relay_uptime_seconds",
            "gauge",
            "Seconds since this relay started.",
            [({}, max(uptime, 0.0))],
        )
    )
    metrics.append(
        Metric(
            "outboxer_relay_healthy",
            "gauge",
            "1 while the relay's loops run and nothing is in an outage backoff (as /health).",
            [({}, int(healthy))],
        )
    )
    return metrics


def store_metrics(statuses: Sequence[DestinationStatus] | None) -> list[Metric]:
    """Gauges from ``store.status()``; None when the query failed (only ``outboxer_store_up``)."""
    metrics = [
        Metric(
            "outboxer_store_up",
            "gauge",
            "1 if the last outbox status query succeeded (it is cached for a few seconds).",
            [({}, int(statuses is not None))],
        )
    ]
    if statuses is None:
        return metrics
    # Every status of every destination, zeros included, so a series never vanishes mid-graph.
    counts = [
        ({"destination": entry.destination, "status": status}, entry.counts.get(status, 0))
        for entry in statuses
        for status in ALL_STATUSES
    ]
    ages = [
        ({"destination": entry.destination}, entry.oldest_pending_age or 0.0) for entry in statuses
    ]
    metrics.append(
        Metric(
            "outboxer_messages", "gauge", "Rows in the outbox, by destination and status.", counts
        )
    )
    metrics.append(
        Metric(
            "outboxer_oldest_pending_age_seconds",
            "gauge",
            "Age of the oldest unfinished (PENDING, FAILED, PROCESSING) message; 0 when none.",
            ages,
        )
    )
    return metrics


class StatusCache:
    """One ``store.status()`` answer (or failure) reused for ``ttl`` seconds by every caller."""

    def __init__(
        self, query: Callable[[], Awaitable[list[DestinationStatus]]], ttl: float, timeout: float
    ) -> None:
        self.query = query
        self.ttl = ttl
        self.timeout = timeout
        self._lock = asyncio.Lock()
        self._result: list[DestinationStatus] | None = None
        self._fetched_at = -math.inf

    async def get(self) -> list[DestinationStatus] | None:
        # One query at a time: scrapes arriving together wait for it instead of each sending one.
        async with self._lock:
            if time.monotonic() - self._fetched_at >= self.ttl:
                try:
                    async with asyncio.timeout(self.timeout):
                        self._result = await self.query()
                except Exception as exc:  # noqa: BLE001 -- reported as outboxer_store_up 0, and logged
                    logger.warning("metrics: the outbox status query failed: %s", _describe(exc))
                    self._result = None
                # A failure is cached too: a scraper must not hammer a database that is down.
                self._fetched_at = time.monotonic()
            return self._result


# ----- the API -----------------------------------------------------------------------------


Handler = Callable[[Request], Awaitable[Response]]


class HttpApi:
    """Routes a parsed request to its endpoint; no sockets here, so tests can call ``handle``."""

    def __init__(
        self,
        store: Store,
        settings: Settings,
        relay: Relay | None = None,
        *,
        token: str | None = None,
        status_cache_seconds: float = STATUS_CACHE_SECONDS,
        store_timeout: float = STORE_TIMEOUT,
        extra_metrics: Callable[[], Iterable[Metric]] | None = None,
    ) -> None:
        check_token(token)
        #: More metrics for ``/metrics`` (the consumer's: outboxer.consumer.consumer_metrics).
        self.extra_metrics = extra_metrics
        self.store = store
        self.settings = settings
        self.relay = relay
        self.token = token
        self.store_timeout = store_timeout
        self.status_cache = StatusCache(self._query_status, status_cache_seconds, store_timeout)
        self._connect_lock = asyncio.Lock()
        self.routes: dict[str, dict[str, Handler]] = {
            "/health": {"GET": self.health},
            "/metrics": {"GET": self.metrics},
            "/status": {"GET": self.status},
            "/messages": {"GET": self.messages},
            "/messages/requeue": {"POST": self.requeue},
        }

    async def close(self) -> None:
        await self.store.close()

    async def handle(self, request: Request) -> Response:
        try:
            methods = self.routes.get(request.path)
            if methods is None:
                raise NotFound(f"no endpoint {request.path}; try one of {', '.join(self.routes)}")
            handler = methods.get(request.method)
            if handler is None:
                allowed = ", ".join(sorted(methods))
                raise MethodNotAllowed(
                    f"{request.path} accepts {allowed}, not {request.method}",
                    headers={"Allow": allowed},
                )
            if request.method != "GET":
                self._authorize(request)
            if request.method == "POST":
                require_json(request)
            return await handler(request)
        except HttpError as exc:
            return error_response(exc)
        except Exception as exc:
            if not _is_database_error(exc):
                logger.exception("%s %s failed", request.method, request.path)
                return json_response(
                    http.HTTPStatus.INTERNAL_SERVER_ERROR,
                    {
                        "error": "internal server error; the traceback is in the server's log",
                        "type": type(exc).__name__,
                    },
                )
            logger.warning(
                "%s %s: database error: %s", request.method, request.path, _describe(exc)
            )
            return error_response(ServiceUnavailable(f"database error: {_describe(exc)}"))

    def _authorize(self, request: Request) -> None:
        if self.token is None:  # only allowed on a loopback address (see check_exposure)
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            given.strip().encode("latin-1"), self.token.encode()
        ):
            raise Unauthorized(
                "this endpoint needs the header Authorization: Bearer <token>",
                headers={"WWW-Authenticate": 'Bearer realm="outboxer"'},
            )

    async def _connected_store(self) -> Store:
        # Connect lazily and again after a failure, so the API starts while the database is
        # down; the lock keeps two requests from opening two pools.
        async with self._connect_lock:
            await self.store.connect()
        return self.store

    async def _query_status(self) -> list[DestinationStatus]:
        return await (await self._connected_store()).status()

    # ----- endpoints ---------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        relay_problems = self.relay.health_problems() if self.relay is not None else []
        try:
            async with asyncio.timeout(self.store_timeout):
                await (await self._connected_store()).ping()
            database = "ok"
        except TimeoutError:
            database = f"no answer within {self.store_timeout:g}s"
        except Exception as exc:  # noqa: BLE001 -- any failure to answer is the reason for a 503
            database = _describe(exc)
        body: dict[str, object] = {"status": "ok", "database": database}
        if self.relay is not None:
            body["relay"] = "; ".join(relay_problems) or "ok"
        reasons = ([f"database: {database}"] if database != "ok" else []) + relay_problems
        if reasons:
            body["status"] = "unavailable"
            body["reasons"] = reasons
            return json_response(http.HTTPStatus.SERVICE_UNAVAILABLE, body)
        return json_response(http.HTTPStatus.OK, body)

    async def metrics(self, request: Request) -> Response:
        metrics: list[Metric] = []
        if self.relay is not None:
            metrics += relay_metrics(
                self.relay.stats,
                not self.relay.health_problems(),
                destinations=self.relay.destination_stats,
            )
        if self.extra_metrics is not None:
            metrics += self.extra_metrics()
        metrics += store_metrics(await self.status_cache.get())
        return Response(
            http.HTTPStatus.OK, render_metrics(metrics).encode(), PROMETHEUS_CONTENT_TYPE
        )

    async def status(self, request: Request) -> Response:
        store = await self._connected_store()
        async with asyncio.timeout(QUERY_TIMEOUT):
            return json_response(http.HTTPStatus.OK, await store.status_report())

    async def messages(self, request: Request) -> Response:
        _only(request.query, {"status", "limit"}, "query parameter")
        statuses = _statuses(
            [part for value in request.query.get("status", []) for part in value.split(",")]
            or [Status.ABANDONED.value],
            ALL_STATUSES,
            "status",
        )
        limits = request.query.get("limit", [str(MESSAGES_DEFAULT_LIMIT)])
        if len(limits) != 1:
            raise BadRequest("give limit once")
        limit = parse_ascii_int(limits[0])
        if limit is None:
            raise BadRequest(f"limit must be a whole number; got {limits[0][:40]!r}")
        if not 1 <= limit <= MESSAGES_MAX_LIMIT:
            raise BadRequest(
                f"limit must be between 1 and {MESSAGES_MAX_LIMIT}; got {limits[0][:40]}"
            )
        store = await self._connected_store()
        async with asyncio.timeout(QUERY_TIMEOUT):
            rows = await store.list_messages(statuses, limit)
        return json_response(http.HTTPStatus.OK, {"messages": rows})

    async def requeue(self, request: Request) -> Response:
        try:
            body = json.loads(request.body) if request.body.strip() else None
        except ValueError as exc:  # JSONDecodeError, or bytes that are not UTF-8/16/32
            raise BadRequest(f"the body is not valid JSON: {exc}") from None
        except RecursionError:
            raise BadRequest("the body is not valid JSON: nested too deep") from None
        if not isinstance(body, dict):
            raise BadRequest(
                'the body must be a JSON object such as {"statuses": ["ABANDONED"]} '
                "({} requeues every ABANDONED message)"
            )
        _only(body, {"destinations", "statuses", "ids"}, "field")
        destinations = _string_list(body, "destinations") or self.settings.destination_names
        statuses = _statuses(
            _string_list(body, "statuses") or [Status.ABANDONED.value], REQUEUE_STATUSES, "statuses"
        )
        ids = _string_list(body, "ids")
        if ids is not None:
            try:
                ids = [str(uuid.UUID(value)) for value in ids]
            except ValueError:
                raise BadRequest("ids must be message ids (UUIDs)") from None
        # No timeout here: an abandoned requeue could still commit after the client was told
        # it failed. The store's own statement timeout bounds it.
        count = await (await self._connected_store()).requeue(destinations, statuses, ids)
        logger.info(
            "requeued %d message(s) (destinations %s, statuses %s%s)",
            count,
            ", ".join(destinations),
            ", ".join(statuses),
            f", {len(ids)} id(s)" if ids is not None else "",
        )
        return json_response(http.HTTPStatus.OK, {"requeued": count})


#: Driver packages whose exceptions mean "the database failed", not "the API has a bug":
#: the stores raise StoreError for most failures but let some driver errors through.
_DATABASE_DRIVERS = frozenset({"asyncpg", "aiomysql", "pymysql", "sqlite3"})


def _describe(exc: BaseException) -> str:
    """An error as an API answer shows it: never empty (a timeout's text is), no secrets."""
    return redact_text(str(exc) or type(exc).__name__)


def _is_database_error(exc: BaseException) -> bool:
    return (
        isinstance(exc, StoreError | OSError)  # OSError includes TimeoutError
        or type(exc).__module__.split(".")[0] in _DATABASE_DRIVERS
    )


def _only(given: Mapping[str, object], known: set[str], kind: str) -> None:
    # A mistyped name must not silently widen a requeue to every message.
    unknown = sorted(set(given) - known)
    if unknown:
        raise BadRequest(
            f"unknown {kind}(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )


def _string_list(body: Mapping[str, Any], name: str) -> list[str] | None:
    value = body.get(name)
    if value is None:
        return None
    if (
        not isinstance(value, list)
        or not value
        or not all(isinstance(item, str) and item for item in value)
    ):
        raise BadRequest(
            f"{name} must be a non-empty list of non-empty strings (leave it out for the default)"
        )
    for item in value:
        # JSON can spell both ("\u0000", "\ud800"); the database driver cannot send them.
        try:
            check_text(item, f"an item of {name}")
        except PayloadError as exc:
            raise BadRequest(str(exc)) from None
    return list(value)


def _statuses(values: Sequence[str], allowed: Sequence[str], name: str) -> list[str]:
    statuses = [value.strip().upper() for value in values]
    unknown = [value for value in statuses if value not in allowed]
    if unknown:
        raise BadRequest(f"unknown {name} {', '.join(unknown)}; use {', '.join(allowed)}")
    return list(dict.fromkeys(statuses))


# ----- the server --------------------------------------------------------------------------


class HttpServer:
    """Serves an ``HttpApi`` on ``host:port``, one request per connection."""

    def __init__(
        self,
        api: HttpApi,
        host: str,
        port: int,
        *,
        read_timeout: float = READ_TIMEOUT,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        check_exposure(host, api.token)
        self.api = api
        self.host = host
        self.port = port
        self.read_timeout = read_timeout
        self.max_connections = max_connections
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[Any]] = set()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def start(self) -> HttpServer:
        try:
            self._server = await asyncio.start_server(
                self._serve_connection, self.host, self.port, limit=MAX_HEAD_BYTES
            )
        except OSError as exc:
            raise ConfigError(
                f"the HTTP API cannot listen on {self.host}:{self.port}: {exc.strerror or exc}"
            ) from None
        self.port = self._server.sockets[0].getsockname()[1]  # the port chosen for port 0
        logger.info(
            "HTTP API listening on %s (requeue %s)",
            self.url,
            "needs the bearer token" if self.api.token else "open to local clients",
        )
        return self

    async def close(self) -> None:
        """Stop listening, drop the connections still open, close the API's store."""
        if self._server is not None:
            self._server.close()
        connections = list(self._connections)
        for task in connections:
            task.cancel()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5):
                await asyncio.gather(*connections, return_exceptions=True)
                if self._server is not None:
                    await self._server.wait_closed()
        self._server = None
        await self.api.close()

    async def __aenter__(self) -> HttpServer:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def _serve_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            if len(self._connections) > self.max_connections:
                await self._send(
                    writer, error_response(ServiceUnavailable("too many open connections"))
                )
                return
            response, unread_input = await self._answer(reader, writer)
            if response is not None:
                await self._send(writer, response)
                if unread_input:
                    await self._discard_input(reader, writer)
        except (ConnectionError, TimeoutError) as exc:  # the client left, or stopped reading
            logger.debug("HTTP connection dropped: %s", _describe(exc))
        finally:
            self._connections.discard(task)
            await self._close_writer(writer)

    async def _answer(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> tuple[Response | None, bool]:
        """The response (None: nobody to answer) and whether request bytes may be left unread."""
        started = time.perf_counter()
        try:
            async with asyncio.timeout(self.read_timeout):
                request = await read_request(reader, writer)
        except _ClientGone:
            return None, False
        except TimeoutError:
            return error_response(
                RequestTimeout(f"no complete request within {self.read_timeout:g}s")
            ), False
        except HttpError as exc:
            return error_response(exc), True
        try:
            check_host(request, self.host)
            check_origin(request, self.url.removeprefix("http://"))
        except HttpError as exc:
            logger.warning("refused %s %r: %s", request.method, request.path[:100], exc)
            return error_response(exc), False
        response = await self.api.handle(request)
        logger.debug(
            "%s %s -> %d in %.1f ms",
            request.method,
            request.path,
            response.status,
            (time.perf_counter() - started) * 1000,
        )
        return response, False

    async def _send(self, writer: asyncio.StreamWriter, response: Response) -> None:
        writer.write(encode_response(response))
        async with asyncio.timeout(self.read_timeout):
            await writer.drain()

    async def _discard_input(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        with contextlib.suppress(OSError):  # a timeout or a reset: close anyway
            if writer.can_write_eof():
                writer.write_eof()
            async with asyncio.timeout(_LINGER_SECONDS):
                discarded = 0
                while discarded < _LINGER_BYTES and (chunk := await reader.read(65536)):
                    discarded += len(chunk)

    async def _close_writer(self, writer: asyncio.StreamWriter) -> None:
        writer.close()
        try:
            async with asyncio.timeout(1):
                await writer.wait_closed()
        except OSError:
            # A client that does not read keeps the buffer full: do not wait for it.
            writer.transport.abort()
        except asyncio.CancelledError:
            writer.transport.abort()
            raise


def check_exposure(host: str, token: str | None) -> None:
    """Refuse to offer requeue without a token to anyone but this machine."""
    if token is None and not is_loopback(host):
        raise ConfigError(
            f"set --http-token to expose requeue on a non-loopback address ({host}); "
            "or bind the HTTP API to 127.0.0.1"
        )


async def start_http_api(
    settings: Settings,
    relay: Relay | None = None,
    *,
    extra_metrics: Callable[[], Iterable[Metric]] | None = None,
) -> HttpServer:
    """Check the settings, then listen on ``settings.http``; ConfigError if it cannot."""
    if not settings.http:
        raise ConfigError("no HTTP address: pass --http HOST:PORT or set OUTBOXER_HTTP")
    host, port = parse_http_address(settings.http, "--http")
    store = create_store(settings.require_db(), schema=settings.schema, table=settings.table)
    api = HttpApi(store, settings, relay, token=settings.http_token, extra_metrics=extra_metrics)
    return await HttpServer(api, host, port).start()


async def serve(settings: Settings) -> None:
    """``outboxer serve``: the API without a relay, until SIGTERM or SIGINT."""
    server = await start_http_api(settings)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    try:
        await stopping.wait()
        logger.info("HTTP API stopping")
    finally:
        await server.close()
