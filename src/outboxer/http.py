"""The HTTP API: health, Prometheus metrics, status, messages, and requeue, purge and replay.

It runs inside the relay (``outboxer relay --http HOST:PORT``) or alone
(``outboxer serve --http HOST:PORT``, the same endpoints without the relay's
counters). Install it with ``pip install 'outboxer[http]'``.

DESIGN (docs/design/http-api.md): uvicorn (its h11 protocol) parses and frames HTTP/1.1,
Starlette reads requests and writes responses, ``HttpApi`` routes and answers, and
prometheus_client renders ``/metrics``. What outboxer adds is policy: one request per
connection (``Connection: close``: probes, scrapers and operators send a request every few
seconds at most, so keep-alive would buy nothing and would let idle clients hold
connections); a deadline on each request's head (``_DeadlineProtocol``) and body, so a slow
or silent client holds one small task, never the relay's loops; bounded heads and bodies;
the browser protections below. The API has its own store (its own connection or pool): a
slow status query cannot take a connection the relay's claims are waiting for, and the
relay closing its store on shutdown cannot pull one out from under a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hmac
import http
import ipaddress
import json
import math
import re
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import parse_qs

from outboxer import admin, dashboard
from outboxer.config import Settings, is_loopback, parse_http_address
from outboxer.errors import (
    AdminRequestError,
    ConfigError,
    MissingDependencyError,
    ReplayError,
    StoreError,
)
from outboxer.message import Status
from outboxer.redact import get_logger, printable, redact_text
from outboxer.relay import Relay
from outboxer.relay_group import RelayGroup
from outboxer.stores import DestinationStatus, Store, create_store

if TYPE_CHECKING:
    import uvicorn

    from outboxer.crypto import KeyRing
    from outboxer.metrics import Metrics

logger = get_logger("outboxer.http")

MAX_BODY_BYTES = 64 * 1024
#: Bytes of request line and header fields; 431 beyond.
MAX_HEAD_BYTES = 16 * 1024
MAX_HEADERS = 100
#: Seconds a client has to send its request head, and then its body (and to take the answer).
READ_TIMEOUT = 10.0
MAX_CONNECTIONS = 64
#: Seconds ``/metrics`` and the dashboard reuse one status answer. It costs milliseconds
#: whatever the table holds (Store.status), but every scraper of every process asks.
STATUS_CACHE_SECONDS = 5.0
#: Seconds ``/health`` and ``/metrics`` wait for the database before saying it did not answer.
STORE_TIMEOUT = 5.0
#: Seconds ``/status`` and ``/messages`` wait for their queries.
QUERY_TIMEOUT = 30.0
#: Shortest bearer token accepted: a short token can be guessed over the network.
MIN_TOKEN_LENGTH = 16
MESSAGES_DEFAULT_LIMIT = 50
MESSAGES_MAX_LIMIT = 1000
ALL_STATUSES = tuple(status.value for status in Status)
JSON_CONTENT_TYPE = "application/json"
#: Seconds the server waits for requests in progress when it closes, then cancels them.
SHUTDOWN_GRACE_SECONDS = 5.0

#: After an error response to a request whose body was not read, read (and drop) what the
#: client still sends before closing: closing a socket with unread input makes the kernel
#: send a reset, and the client may lose the response before it reads it.
_LINGER_SECONDS = 2.0
_LINGER_BYTES = 1024 * 1024

# Matched with fullmatch: ``$`` would also accept a trailing newline. Digits are ASCII only:
# ``\d``, ``str.isdigit()`` and ``int()`` also take "²" or "٣", which HTTP never means.
_ASCII_DIGITS = re.compile(r"[0-9]+")
#: A serialized origin (RFC 6454, 6.1): scheme, host and port only.
_ORIGIN = re.compile(r"https?://([^/?#@\s]+)", re.IGNORECASE)
#: Characters no field value may hold (RFC 9110, 5.5): controls but HTAB.
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
#: What ``parse_ascii_int`` returns for a number of more digits than any limit here needs.
_HUGE = 10**18
#: A ``version`` parameter of an Accept media range ``/metrics`` answers by (unquoted).
_MEDIA_VERSION = re.compile(r"[0-9]{1,9}(?:\.[0-9]{1,9}){0,5}")
#: The media types whose ``version`` prometheus_client compares.
_METRICS_MEDIA_TYPES = ("application/openmetrics-text", "text/plain")
#: The blank line that ends a request head (h11 also takes bare newlines).
_END_OF_HEAD = re.compile(rb"\r?\n\r?\n")
#: HTTP versions answered; uvicorn hands "2.0" in a request line through as is.
_HTTP_VERSIONS = ("1.0", "1.1")


#: The modules of the ``http`` extra (pip names: starlette, uvicorn, prometheus-client).
_HTTP_EXTRA = ("starlette", "uvicorn", "prometheus_client")


def _require(module: str) -> Any:
    """Import a module of the ``http`` extra, or MissingDependencyError naming the extra."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingDependencyError(module.partition(".")[0], "http") from exc


# ----- errors that become responses --------------------------------------------------------


class _PartlyDone(Exception):
    """A change failed on database ``failed`` after the databases in ``done`` committed."""

    def __init__(
        self, cause: Exception, failed: str, done: Mapping[str, admin.AdminResult]
    ) -> None:
        super().__init__(str(cause))
        self.cause, self.failed, self.done = cause, failed, dict(done)


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


class Conflict(HttpError):
    status = http.HTTPStatus.CONFLICT


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


def check_host(
    request: Request, bind_host: str, allowed_hosts: Sequence[str] | None = None
) -> None:
    """Refuse a Host the API does not answer for: a DNS-rebinding page sends its own name,
    and the browser then lets the page read the answers (the GET endpoints need no token).

    On a loopback address it answers for loopback names, the bound name and
    ``allowed_hosts``; elsewhere for any name, or, with ``allowed_hosts``, for IP addresses
    (a page cannot make a browser send one but its own origin's), loopback names, the bound
    name and those. ``.example.com`` in ``allowed_hosts`` names the domain and its names.
    """
    host = request.headers.get("host")
    loopback = is_loopback(bind_host)
    if host is None or (not loopback and allowed_hosts is None):
        return
    name = host_name(host)
    if name is not None:
        name = name.lower()
        if (
            is_loopback(name)
            or name == bind_host.lower()
            or (not loopback and _is_ip_address(name))
            or any(
                name == allowed or (allowed.startswith(".") and f".{name}".endswith(allowed))
                for allowed in allowed_hosts or ()
            )
        ):
            return
    names = "localhost, 127.0.0.1 or [::1]" if loopback else "IP addresses, loopback names"
    listed = f", {', '.join(allowed_hosts)}" if allowed_hosts else ""
    where = "listens on a loopback address and " if loopback else ""
    raise MisdirectedRequest(
        f"this API {where}answers requests for {names}{listed} only"
        f" (--http-allowed-hosts); got Host {printable(host[:100])!r}"
    )


def _is_ip_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


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


def metrics_accept(request: Request) -> str | None:
    """The request's Accept header, for ``Metrics.render``; BadRequest for a version it
    cannot read.

    prometheus_client compares a version of text parts with numbers: ``version=abc`` (or a
    quoted one) raised TypeError there, a 500 (and, in the stream relay's API, a traceback).
    """
    accept = request.headers.get("accept")
    for media_range in (accept or "").split(","):
        media_type, *parameters = media_range.split(";")
        if media_type.strip() not in _METRICS_MEDIA_TYPES:
            continue
        for parameter in parameters:
            # Read as prometheus_client reads it: "version=" exactly, the value as sent.
            name, equals, value = parameter.strip().partition("=")
            if equals and name == "version" and not _MEDIA_VERSION.fullmatch(value):
                raise BadRequest(
                    f"malformed version {printable(value[:40])!r} in Accept for "
                    f"{media_type.strip()}: use numbers such as version=1.0.0, or no version"
                )
    return accept


def check_token(token: object) -> None:
    """Refuse a bearer token that is empty, short, or that no Authorization header can carry."""
    if token is None:
        return
    if not isinstance(token, str):
        raise ConfigError(f"the HTTP API token must be a string, not {type(token).__name__}")
    if not token.strip():
        raise ConfigError(
            "the HTTP API token is empty: set one of at least "
            f"{MIN_TOKEN_LENGTH} characters, or none to answer requeue, purge and replay on "
            "loopback only"
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


# ----- the outbox gauges' query --------------------------------------------------------------


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

    def invalidate(self) -> None:
        """Query again at the next ``get``: the API itself just changed the outbox."""
        self._fetched_at = -math.inf


# ----- the API -----------------------------------------------------------------------------


Handler = Callable[[Request], Awaitable[Response]]


class Api(Protocol):
    """What ``HttpServer`` serves: ``HttpApi``, or the stream relay's (outboxer.stream_api)."""

    #: The bearer token POST endpoints require (None: none).
    token: str | None
    #: Whether the API has endpoints that change something: then it listens on a
    #: non-loopback address only with a token (``check_exposure``).
    writes: bool

    async def handle(self, request: Request) -> Response: ...

    async def sample_forever(self) -> None: ...

    async def close(self) -> None: ...


class HttpApi:
    """Routes a parsed request to its endpoint; no sockets here, so tests can call ``handle``."""

    writes = True

    def __init__(
        self,
        store: Store | Mapping[str, Store],
        settings: Settings,
        relay: Relay | RelayGroup | None = None,
        *,
        token: str | None = None,
        status_cache_seconds: float = STATUS_CACHE_SECONDS,
        store_timeout: float = STORE_TIMEOUT,
        sample_seconds: float = dashboard.SAMPLE_SECONDS,
        collectors: Iterable[Any] = (),
    ) -> None:
        """``store``: the API's own store of the one database, or of each database by name
        (then every answer has a section per database). ``relay``: the relay (or the relays,
        a RelayGroup) running in this process, if any."""
        check_token(token)
        if isinstance(store, Mapping):
            if not store:
                raise ConfigError("the HTTP API needs at least one database")
            self.stores: dict[str, Store] = dict(store)
            #: Whether answers have a section per database (the databases are named).
            self.sectioned = True
        else:
            self.stores = {settings.database_name: store}
            self.sectioned = False
        #: The first database's store (the only one, unless ``sectioned``).
        self.store = next(iter(self.stores.values()))
        self.settings = settings
        #: The replays' key ring when it fetches from a source (``_lasting_keyring``).
        self._fetching_keyring: KeyRing | None = None
        self.relay = relay
        self.relays: dict[str, Relay] = (
            {}
            if relay is None
            else dict(relay.relays)
            if isinstance(relay, RelayGroup)
            else {relay.database: relay}
        )
        #: Each database's settings (its destinations, for requeue's default).
        self.database_settings = settings.database_settings()
        self.token = token
        self.store_timeout = store_timeout
        self.status_caches = {
            name: StatusCache(
                functools.partial(self._query_status, name), status_cache_seconds, store_timeout
            )
            for name in self.stores
        }
        self.status_cache = next(iter(self.status_caches.values()))
        from outboxer.metrics import Metrics

        # Inside a relay, its registry (its counters, histograms and process metrics) gets the
        # outbox gauges too; alone, a registry of the outbox gauges only.
        relay_metrics = next(
            (each.metrics for each in self.relays.values() if each.metrics is not None), None
        )
        if relay_metrics is not None:
            self.prometheus: Metrics = relay_metrics
        else:
            self.prometheus = Metrics(process_metrics=False)
            for each in self.relays.values():
                self.prometheus.watch_relay(each)
        # More of the process's metrics (``outboxer consume``'s: outboxer.consumer).
        for collector in collectors:
            self.prometheus.registry.register(collector)
        self.sample_seconds = sample_seconds
        self.history = dashboard.History(sample_seconds)
        self._connect_locks = {name: asyncio.Lock() for name in self.stores}
        self.routes: dict[str, dict[str, Handler]] = {
            "/": {"GET": self.dashboard},
            "/dashboard.js": {"GET": self.dashboard_asset},
            "/dashboard.css": {"GET": self.dashboard_asset},
            "/dashboard/series": {"GET": self.dashboard_series},
            "/health": {"GET": self.health},
            "/metrics": {"GET": self.metrics},
            "/status": {"GET": self.status},
            "/messages": {"GET": self.messages},
            "/messages/requeue": {"POST": self.requeue},
            "/messages/purge": {"POST": self.purge},
            "/messages/replay": {"POST": self.replay},
        }

    async def close(self) -> None:
        for store in self.stores.values():
            with contextlib.suppress(Exception):
                await store.close()

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
        except _PartlyDone as exc:
            # Earlier databases committed: say which, so that nobody retries the whole
            # request and replays (or requeues) those databases' messages a second time.
            answer = self._failure(request, exc.cause)
            payload = json.loads(answer.body)
            payload["failed_database"] = exc.failed
            payload["committed"] = {name: result.as_json() for name, result in exc.done.items()}
            return json_response(answer.status, payload, answer.headers)
        except Exception as exc:  # noqa: BLE001 -- _failure answers each kind; logs the unknown
            return self._failure(request, exc)

    def _failure(self, request: Request, exc: Exception) -> Response:
        """The error answer for ``exc``; unexpected errors are logged with their traceback."""
        if isinstance(exc, HttpError):
            return error_response(exc)
        if isinstance(exc, AdminRequestError):  # a filter or an option of purge, replay …
            return error_response(BadRequest(str(exc)))
        if isinstance(exc, ReplayError):  # rolled back: nothing written
            return error_response(Conflict(str(exc)))
        if not _is_database_error(exc):
            logger.error("%s %s failed", request.method, request.path, exc_info=exc)
            return json_response(
                http.HTTPStatus.INTERNAL_SERVER_ERROR,
                {
                    "error": "internal server error; the traceback is in the server's log",
                    "type": type(exc).__name__,
                },
            )
        logger.warning("%s %s: database error: %s", request.method, request.path, _describe(exc))
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

    async def _connected_store(self, database: str | None = None) -> Store:
        # Connect lazily and again after a failure, so the API starts while the database is
        # down; the lock keeps two requests from opening two pools.
        # Bounded as /health's ping is: a database that accepts and never answers held each
        # request (and its connection) for the driver's own connect timeout, a minute.
        name = database or next(iter(self.stores))
        async with self._connect_locks[name]:
            try:
                async with asyncio.timeout(self.store_timeout):
                    await self.stores[name].connect()
            except TimeoutError:
                raise StoreError(
                    f"no connection to the database within {self.store_timeout:g}s"
                ) from None
        return self.stores[name]

    async def _query_status(self, database: str) -> list[DestinationStatus]:
        return await (await self._connected_store(database)).status()

    def _databases(self, given: str | None) -> list[str]:
        """The databases a request is about: the one it names, else every one."""
        if given is None:
            return list(self.stores)
        if given not in self.stores:
            raise BadRequest(
                f"no database {given[:100]!r}; this API serves {', '.join(self.stores)}"
            )
        return [given]

    # ----- endpoints ---------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        names = list(self.stores)
        answers = await asyncio.gather(*(self._database_health(name) for name in names))
        sections = dict(zip(names, answers, strict=True))
        reasons: list[str] = []
        for name, (_, problems) in sections.items():
            reasons += [f"{name}: {reason}" if self.sectioned else reason for reason in problems]
        # Of several databases, one that is down is "degraded", still 200: the others
        # publish on, and a probe that failed would take the process's HTTP API (and the
        # operator's admin calls for the healthy databases) out of service, or, used as a
        # liveness probe, restart every database's relay for one outage. Per database:
        # the body, and outboxer_relay_healthy / outboxer_store_up{database}.
        healthy = sum(not problems for _, problems in sections.values())
        state = "ok" if not reasons else "degraded" if healthy else "unavailable"
        body: dict[str, object] = {"status": state}
        if self.sectioned:
            body["databases"] = {name: section for name, (section, _) in sections.items()}
        else:
            body.update(next(iter(sections.values()))[0])
        if reasons:
            body["reasons"] = reasons
        if state == "unavailable":
            return json_response(http.HTTPStatus.SERVICE_UNAVAILABLE, body)
        return json_response(http.HTTPStatus.OK, body)

    async def _database_health(self, name: str) -> tuple[dict[str, str], list[str]]:
        """One database's part of /health: {"database": …, "relay": …} and its problems."""
        relay = self.relays.get(name)
        relay_problems = relay.health_problems() if relay is not None else []
        try:
            async with asyncio.timeout(self.store_timeout):
                await (await self._connected_store(name)).ping()
            database = "ok"
        except TimeoutError:
            database = f"no answer within {self.store_timeout:g}s"
        except Exception as exc:  # noqa: BLE001 -- any failure to answer is the reason for a 503
            database = _describe(exc)
        section = {"database": database}
        if self.relay is not None:
            section["relay"] = "; ".join(relay_problems) or "ok"
        reasons = ([f"database: {database}"] if database != "ok" else []) + relay_problems
        return section, reasons

    async def _statuses(self) -> dict[str, list[DestinationStatus] | None]:
        """Each database's cached status answer (None: it failed)."""
        names = list(self.status_caches)
        answers = await asyncio.gather(*(self.status_caches[name].get() for name in names))
        return dict(zip(names, answers, strict=True))

    async def metrics(self, request: Request) -> Response:
        for name, statuses in (await self._statuses()).items():
            self.prometheus.observe_store_status(statuses, name)
        body, content_type = self.prometheus.render(metrics_accept(request))
        return Response(http.HTTPStatus.OK, body, content_type)

    async def status(self, request: Request) -> Response:
        if not self.sectioned:
            store = await self._connected_store()
            async with asyncio.timeout(QUERY_TIMEOUT):
                return json_response(http.HTTPStatus.OK, await store.status_report())
        names = list(self.stores)
        reports = await asyncio.gather(*(self._status_report(name) for name in names))
        return json_response(
            http.HTTPStatus.OK, {"databases": dict(zip(names, reports, strict=True))}
        )

    async def _status_report(self, name: str) -> dict[str, Any]:
        """One database's /status section; a database that does not answer says why."""
        try:
            store = await self._connected_store(name)
            async with asyncio.timeout(QUERY_TIMEOUT):
                return await store.status_report()
        except Exception as exc:
            if not _is_database_error(exc):
                raise
            return {"error": f"database error: {_describe(exc)}"}

    async def messages(self, request: Request) -> Response:
        _only(request.query, {"status", "limit", "database"}, "query parameter")
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
        given = request.query.get("database", [])
        if len(given) > 1:
            raise BadRequest("give database once")
        rows: list[dict[str, object]] = []
        for name in self._databases(given[0] if given else None):
            store = await self._connected_store(name)
            async with asyncio.timeout(QUERY_TIMEOUT):
                found = await store.list_messages(statuses, limit - len(rows))
            rows += [{**row, "database": name} for row in found] if self.sectioned else found
            if len(rows) >= limit:
                break
        return json_response(http.HTTPStatus.OK, {"messages": rows})

    async def requeue(self, request: Request) -> Response:
        body = _json_object(
            request, '{"statuses": ["ABANDONED"]} ({} requeues every ABANDONED message)'
        )
        _only(body, admin.FILTER_FIELDS | {"dry_run", "database"}, "field")
        dry_run = admin.flag(body, "dry_run")
        where = admin.filter_from_json(body)

        async def requeue(name: str, store: Store) -> admin.AdminResult:
            # No timeout on a change: an abandoned one could still commit after the client
            # was told it failed. The store's own statement timeout bounds it.
            destinations = self.database_settings[name].destination_names
            return await admin.requeue(store, where, destinations=destinations, dry_run=dry_run)

        def check(name: str) -> None:  # a destination one database lacks: before any change
            admin.requeue_filter(where, destinations=self.database_settings[name].destination_names)

        return await self._each_database(body, requeue, check)

    async def purge(self, request: Request) -> Response:
        body = _json_object(request, '{"topics": ["order.placed"], "statuses": ["ABANDONED"]}')
        _only(body, admin.FILTER_FIELDS | {"all", "dry_run", "database"}, "field")
        dry_run, everything = admin.flag(body, "dry_run"), admin.flag(body, "all")
        where = admin.filter_from_json(body)

        async def purge(name: str, store: Store) -> admin.AdminResult:
            return await admin.purge(store, where, everything=everything, dry_run=dry_run)

        return await self._each_database(body, purge)

    async def replay(self, request: Request) -> Response:
        body = _json_object(request, '{"keys": ["order-7"], "to": "partner"}')
        fields = (admin.FILTER_FIELDS - {"statuses"}) | {"all", "dry_run", "to", "database"}
        _only(body, fields, "field")
        dry_run, everything = admin.flag(body, "dry_run"), admin.flag(body, "all")
        to = body.get("to")
        where = admin.filter_from_json(body)
        copier = admin.copier_from_settings(self.settings)
        copier.keyring = self._lasting_keyring(copier.keyring)

        async def replay(name: str, store: Store) -> admin.AdminResult:
            try:
                return await admin.replay(
                    store,
                    where,
                    to=to,
                    everything=everything,
                    copier=copier,
                    known_destinations=self.database_settings[name].destination_names,
                    dry_run=dry_run,
                )
            except ReplayError as exc:
                if copier.unanswered is None and copier.keys_unavailable is None:
                    raise  # a row that cannot be copied: 409, retrying would not help
                # The claim-check store or the key ring's source (a KMS) did not answer, or
                # failed for now (rolled back, nothing written): the server's trouble, which
                # passes, as a database that does not answer.
                raise ServiceUnavailable(redact_text(str(exc))) from exc

        def check(name: str) -> None:
            if to is not None:
                admin.check_destination(to, self.database_settings[name].destination_names)

        try:
            return await self._each_database(body, replay, check)
        finally:
            await asyncio.to_thread(copier.close)

    def _lasting_keyring(self, ring: KeyRing | None) -> KeyRing | None:
        """The ring a replay uses: a ring that fetches (a KMS) is kept from one request to
        the next while its source and current key stay the same. Its cap of calls left
        running is per ring: a new ring per request let each request against a KMS that
        does not answer leave one more thread waiting on it for ever, and asked the KMS
        again for every key. A ring holding its keys is the request's own, as before."""
        if ring is None or not ring.fetches:
            return ring
        kept = self._fetching_keyring
        if kept is not None and kept.same_source(ring):
            return kept
        self._fetching_keyring = ring
        return ring

    async def _each_database(
        self,
        body: Mapping[str, Any],
        action: Callable[[str, Store], Awaitable[admin.AdminResult]],
        check: Callable[[str], object] | None = None,
    ) -> Response:
        """``action`` on the database the body names, else on each; one answer for all.

        Each database changes in its own transaction, one after the other, so ``check``
        (a request error for a database, e.g. a destination it lacks) runs on every one
        before any changes. A failure after some databases committed answers with the
        failure and what those databases did (see ``_PartlyDone``).
        """
        database = body.get("database")
        if database is not None and not isinstance(database, str):
            raise BadRequest("database must be the name of a database (a string)")
        names = self._databases(database)
        if check is not None:
            for name in names:
                check(name)
        results: dict[str, admin.AdminResult] = {}
        for name in names:
            try:
                result = results[name] = await action(name, await self._connected_store(name))
            except Exception as exc:
                done = {name: result for name, result in results.items() if not result.dry_run}
                if done:
                    raise _PartlyDone(exc, name, done) from exc
                raise
            if not result.dry_run:
                self.status_caches[name].invalidate()  # the next page or scrape shows it
        if not self.sectioned:
            (only,) = results.values()
            return json_response(http.HTTPStatus.OK, only.as_json())
        answer: dict[str, object] = {}
        for result in results.values():  # the totals, under the single database's names
            for name, value in result.as_json().items():
                if isinstance(value, int) and not isinstance(value, bool):
                    total = answer.get(name, 0)
                    answer[name] = (total if isinstance(total, int) else 0) + value
                else:
                    answer.setdefault(name, value)
        answer.pop("by_destination", None)
        answer["databases"] = {name: result.as_json() for name, result in results.items()}
        return json_response(http.HTTPStatus.OK, answer)

    # ----- the dashboard ------------------------------------------------------------------

    async def dashboard(self, request: Request) -> Response:
        answers = await self._statuses()
        rows: list[dict[str, object]] = []
        for name, answer in answers.items():
            if answer is None:  # the page says the database did not answer
                continue
            store = await self._connected_store(name)
            async with asyncio.timeout(QUERY_TIMEOUT):
                # Each store lists its newest changes first: take just as many of each.
                found = await store.list_messages(
                    list(dashboard.PROBLEM_STATUSES), dashboard.PROBLEMS_SHOWN
                )
            rows += [{**row, "database": name} for row in found] if self.sectioned else found
        problems = dashboard.newest_problems(rows)
        statuses: list[DestinationStatus] | None = None
        if any(answer is not None for answer in answers.values()):
            statuses = [
                dataclasses.replace(entry, destination=self._shown(name, entry.destination))
                for name, answer in answers.items()
                for entry in answer or ()
            ]
        relay = None
        if self.relays:
            relay = (
                "; ".join(
                    f"{name}: {problem}" if self.sectioned else problem
                    for name, each in self.relays.items()
                    for problem in each.health_problems()
                )
                or "ok"
            )
        page = dashboard.render_page(
            statuses,
            problems,
            relay=relay,
            token_required=self.token is not None,
            sample_seconds=self.sample_seconds,
        )
        return Response(
            http.HTTPStatus.OK, page.encode(), "text/html; charset=utf-8", dashboard.PAGE_HEADERS
        )

    async def dashboard_asset(self, request: Request) -> Response:
        name = request.path.removeprefix("/")
        kind = "text/javascript" if name.endswith(".js") else "text/css"
        return Response(
            http.HTTPStatus.OK,
            dashboard.asset(name),
            f"{kind}; charset=utf-8",
            {"X-Content-Type-Options": "nosniff"},
        )

    async def dashboard_series(self, request: Request) -> Response:
        return json_response(http.HTTPStatus.OK, self.history.series())

    def _shown(self, database: str, destination: str) -> str:
        """A destination as the dashboard names it: ``database/destination`` when sectioned."""
        return f"{database}/{destination}" if self.sectioned else destination

    async def sample(self) -> None:
        """Add a point to the chart: messages published so far, and the latency histogram."""
        published: dict[str, float] = {}
        series: dict[str, tuple[str, str]] = {}  # shown name -> (database, destination)
        if self.relays:  # the relays' own counters: exact, and no query
            for name, relay in self.relays.items():
                for destination, counts in relay.destination_stats.items():
                    shown = self._shown(name, destination)
                    published[shown] = float(counts.published)
                    series[shown] = (name, destination)
        else:
            answers = await self._statuses()
            if all(answer is None for answer in answers.values()):
                return  # no numbers: a gap in the chart
            if any(
                entry.published_estimated for answer in answers.values() for entry in answer or ()
            ):
                return  # a big table's PUBLISHED rows are estimated: their rate would be noise
            for name, answer in answers.items():  # the PUBLISHED rows (retention may delete some)
                for entry in answer or ():
                    shown = self._shown(name, entry.destination)
                    published[shown] = float(entry.counts.get(Status.PUBLISHED.value, 0))
                    series[shown] = (name, entry.destination)
        registry = self.prometheus.registry
        latency = {}
        for shown, (database, destination) in series.items():
            labels = {"database": database, "destination": destination}
            total = registry.get_sample_value("outboxer_publish_latency_seconds_sum", labels)
            count = registry.get_sample_value("outboxer_publish_latency_seconds_count", labels)
            if total is not None and count is not None:
                latency[shown] = (total, count)
        self.history.add(dashboard.Sample(time.time(), published, latency))

    async def sample_forever(self) -> None:
        while True:
            try:
                await self.sample()
            except Exception as exc:  # noqa: BLE001 -- a missed point is logged; the next one may work
                logger.warning("dashboard: sampling failed: %s", _describe(exc))
            await asyncio.sleep(self.sample_seconds)


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


def _json_object(request: Request, example: str) -> dict[str, Any]:
    """The request's body: a JSON object, else BadRequest quoting ``example``."""
    try:
        body = json.loads(request.body) if request.body.strip() else None
    except ValueError as exc:  # JSONDecodeError, or bytes that are not UTF-8/16/32
        raise BadRequest(f"the body is not valid JSON: {exc}") from None
    except RecursionError:
        raise BadRequest("the body is not valid JSON: nested too deep") from None
    if not isinstance(body, dict):
        raise BadRequest(f"the body must be a JSON object such as {example}")
    return body


def _only(given: Mapping[str, object], known: Iterable[str], kind: str) -> None:
    # A mistyped name must not silently widen a requeue to every message.
    known = set(known)
    unknown = sorted(set(given) - known)
    if unknown:
        raise BadRequest(
            f"unknown {kind}(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )


def _statuses(values: Sequence[str], allowed: Sequence[str], name: str) -> list[str]:
    statuses = [value.strip().upper() for value in values]
    unknown = [value for value in statuses if value not in allowed]
    if unknown:
        raise BadRequest(f"unknown {name} {', '.join(unknown)}; use {', '.join(allowed)}")
    return list(dict.fromkeys(statuses))


# ----- the server --------------------------------------------------------------------------


def _raw_error(error: HttpError) -> bytes:
    """``error`` as a whole response, for the protocol to write when no request reached the app."""
    response = error_response(error)
    head = [
        f"HTTP/1.1 {response.status} {http.HTTPStatus(response.status).phrase}",
        f"Content-Type: {response.content_type}",
        f"Content-Length: {len(response.body)}",
        "Connection: close",
        "Cache-Control: no-store",
    ]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + response.body


def _protocol_class(
    read_timeout: float, max_connections: int = MAX_CONNECTIONS
) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol with a deadline on the request head and JSON protocol errors.

    uvicorn times out idle keep-alive connections only: a client that opens a connection and
    sends half a request head would hold it for good. Here a connection whose request head
    is not complete ``read_timeout`` seconds after it opened gets 408 and is closed; one
    whose client stops reading the answer is dropped at the next deadline. The body has its
    own deadline in ``AsgiApp``. A connection beyond ``max_connections`` open ones gets 503
    and is closed as soon as it is accepted.
    """
    h11_impl = _require("uvicorn.protocols.http.h11_impl")
    h11 = _require("h11")

    class _DeadlineProtocol(h11_impl.H11Protocol):  # type: ignore[misc,name-defined]
        _deadline: asyncio.TimerHandle | None = None
        #: Bytes of a closed connection's answer still unsent at the last deadline.
        _unsent: int | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            # uvicorn's limit_concurrency counts connections only once a request is in, so
            # clients that connect and send nothing were each held (a file descriptor of the
            # relay's process) until the deadline: enough of them and the relay could open
            # no database or broker connection. Refuse them here, before they cost more.
            if len(self.connections) > max_connections:
                self._refuse(
                    ServiceUnavailable(
                        f"the HTTP API has {max_connections} connections open; try again later"
                    )
                )
                return
            self._deadline = self.loop.call_later(read_timeout, self._on_deadline)

        def connection_lost(self, exc: Exception | None) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            super().connection_lost(exc)

        def shutdown(self) -> None:
            if self.transport.is_closing() and self.transport.get_write_buffer_size():
                # An answer written whole that its client has not read yet. uvicorn would
                # wait its whole grace period for it, then stop and leave the socket and the
                # unsent bytes behind; the server is stopping: drop it now.
                self.transport.abort()
                return
            super().shutdown()

        def _on_deadline(self) -> None:
            self._deadline = None
            if self.transport.is_closing():
                # uvicorn writes a whole answer into the transport and closes it; asyncio
                # then keeps the socket and the unsent bytes until the client reads them. A
                # client that reads nothing for a whole deadline is dropped, else it holds a
                # connection (and megabytes of the relay's memory) for as long as it likes.
                unsent = self.transport.get_write_buffer_size()
                if unsent and unsent == self._unsent:
                    self.transport.abort()
                elif unsent:
                    self._unsent = unsent
                    self._deadline = self.loop.call_later(read_timeout, self._on_deadline)
                return
            cycle = self.cycle
            if cycle is None:  # the request head is still incomplete
                self._refuse(RequestTimeout(f"no complete request within {read_timeout:g}s"))
            elif cycle.response_started and not cycle.response_complete and self.flow.write_paused:
                self.transport.abort()  # the client stopped reading the answer
            else:  # still answering, or the answer is still to be flushed once closed
                self._deadline = self.loop.call_later(read_timeout, self._on_deadline)

        def data_received(self, data: bytes) -> None:
            if self.cycle is None and not self.transport.is_closing():
                # h11 bounds only a head that is still incomplete; a whole one in one read
                # passes at any size. Bound it here, body bytes of the same read excluded.
                received = self.conn.trailing_data[0] + data
                end = _END_OF_HEAD.search(received)
                if (end.end() if end else len(received)) > MAX_HEAD_BYTES:
                    self._refuse(
                        HeadersTooLarge(
                            f"the request line and headers exceed {MAX_HEAD_BYTES} bytes"
                        )
                    )
                    return
            super().data_received(data)

        def eof_received(self) -> bool:
            # A client may end its sending side once it has said all it will (shutdown(SHUT_WR)).
            # uvicorn closes the connection there, dropping the answer still to come: keep the
            # connection open to answer a request that is in, refuse one cut short.
            if self.cycle is not None:
                if self.conn.their_state is h11.SEND_BODY:
                    # Nothing more can come: waiting for the rest of the body held the
                    # connection and its task for the whole read timeout, then said 408.
                    self._refuse(BadRequest("the connection ended inside the request body"))
                    return False
                return True
            if self.conn.trailing_data[0].strip():
                self._refuse(BadRequest("the connection ended inside the request head"))
            return False

        def send_400_response(self, msg: str) -> None:
            # h11 refused the request: answer as every other error, JSON with a length.
            self._refuse(
                BadRequest(
                    "malformed HTTP/1.1 request: the request line, a header field (Host is "
                    "required) or the framing (Content-Length, Transfer-Encoding) is not valid"
                )
            )

        def _refuse(self, error: HttpError) -> None:
            self.transport.write(_raw_error(error))
            self.transport.close()

    return _DeadlineProtocol


class AsgiApp:
    """The ASGI application: turns a request into ``HttpApi.handle``'s ``Request``.

    Checks here are the ones that need the connection: the HTTP version, the request
    target's form, the body's length and deadline, and the Host and Origin (which need the
    address the server listens on).
    """

    def __init__(
        self,
        api: Api,
        host: str,
        read_timeout: float,
        allowed_hosts: Sequence[str] | None = None,
    ) -> None:
        self.api = api
        self.host = host
        self.allowed_hosts = allowed_hosts
        self.authority = host  # with the port, once the server listens (HttpServer.start)
        self.read_timeout = read_timeout

    async def __call__(
        self,
        scope: MutableMapping[str, Any],
        receive: Callable[[], Awaitable[MutableMapping[str, Any]]],
        send: Callable[[MutableMapping[str, Any]], Awaitable[None]],
    ) -> None:
        if scope["type"] != "http":  # uvicorn runs with lifespan and websockets off
            return
        requests = _require("starlette.requests")
        started = time.perf_counter()
        incoming = requests.Request(scope, receive)
        response = await self._answer(scope, incoming)
        if response is not None:
            await self._send(response, scope, receive, send)
            logger.debug(
                "%s %s -> %d in %.1f ms",
                scope["method"],
                scope["path"][:100],
                response.status,
                (time.perf_counter() - started) * 1000,
            )

    async def _answer(self, scope: Mapping[str, Any], incoming: Any) -> Response | None:
        """The response (None: the client left before its body arrived)."""
        headers: dict[str, str] = {}
        for raw_name, raw_value in scope["headers"]:
            # A repeated field's values joined with ", " (RFC 9110, 5.3).
            name, value = raw_name.decode("latin-1").lower(), raw_value.decode("latin-1")
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        try:
            request = self._request(scope, headers)
            length = body_length(headers)
        except HttpError as exc:
            await self._discard_body(incoming, headers)
            return error_response(exc)
        try:
            if length or "transfer-encoding" in headers:
                body = await self._read_body(incoming, length)
                if body is None:
                    return None
                request = Request(request.method, request.path, request.query, headers, body)
            check_host(request, self.host, self.allowed_hosts)
            check_origin(request, self.authority)
        except HttpError as exc:
            logger.warning("refused %s %r: %s", request.method, request.path[:100], exc)
            return error_response(exc)
        return await self.api.handle(request)

    @staticmethod
    def _request(scope: Mapping[str, Any], headers: dict[str, str]) -> Request:
        if len(scope["headers"]) > MAX_HEADERS:
            raise HeadersTooLarge(f"more than {MAX_HEADERS} header fields")
        version = scope["http_version"]
        if version not in _HTTP_VERSIONS:
            raise VersionNotSupported(f"HTTP/{version[:10]} is not supported; use HTTP/1.1")
        path: str = scope["path"]
        if not path.startswith("/"):  # "*" or an absolute URL ("http://host/path")
            raise BadRequest(
                f"the request target must be a path starting with '/'; got {path[:100]!r}"
            )
        try:
            query = parse_qs(
                scope["query_string"].decode("latin-1"), keep_blank_values=True, max_num_fields=50
            )
        except ValueError as exc:
            raise BadRequest(f"malformed query string: {exc}") from None
        return Request(method=scope["method"], path=path, query=query, headers=headers)

    async def _read_body(self, incoming: Any, length: int) -> bytes | None:
        body = bytearray()
        try:
            async with asyncio.timeout(self.read_timeout):
                async for chunk in incoming.stream():
                    body += chunk
                    if len(body) > length:  # h11 holds a body to its Content-Length
                        raise BadRequest(f"the body is longer than its Content-Length {length}")
        except TimeoutError:
            raise RequestTimeout(f"the body did not arrive within {self.read_timeout:g}s") from None
        except _require("starlette.requests").ClientDisconnect:
            return None
        return bytes(body)

    async def _discard_body(self, incoming: Any, headers: Mapping[str, str]) -> None:
        """Read what the client sends of a body we refused, within bounds, before answering."""
        if headers.get("expect", "").lower() == "100-continue":
            return  # the client waits for our word before it sends the body
        if "content-length" not in headers and "transfer-encoding" not in headers:
            return
        discarded = 0
        with contextlib.suppress(TimeoutError, _require("starlette.requests").ClientDisconnect):
            async with asyncio.timeout(_LINGER_SECONDS):
                async for chunk in incoming.stream():
                    discarded += len(chunk)
                    if discarded > _LINGER_BYTES:
                        break

    @staticmethod
    async def _send(
        response: Response,
        scope: MutableMapping[str, Any],
        receive: Callable[[], Awaitable[MutableMapping[str, Any]]],
        send: Callable[[MutableMapping[str, Any]], Awaitable[None]],
    ) -> None:
        responses = _require("starlette.responses")
        outgoing = responses.Response(
            response.body,
            status_code=response.status,
            headers={**response.headers, "Connection": "close", "Cache-Control": "no-store"},
            media_type=response.content_type,
        )

        async def send_titled(message: MutableMapping[str, Any]) -> None:
            # ASGI header names are lower-case; h11 writes them as given. Clients do not care,
            # but people reading raw answers (and curl -i) are used to Content-Type.
            if message["type"] == "http.response.start":
                message = {
                    **message,
                    "headers": [(name.title(), value) for name, value in message["headers"]],
                }
            await send(message)

        await outgoing(scope, receive, send_titled)


class HttpServer:
    """Serves an ``HttpApi`` (or another ``Api``) on ``host:port`` with uvicorn, one request
    per connection."""

    def __init__(
        self,
        api: Api,
        host: str,
        port: int,
        *,
        read_timeout: float = READ_TIMEOUT,
        max_connections: int = MAX_CONNECTIONS,
        allowed_hosts: Sequence[str] | None = None,
    ) -> None:
        if api.writes:
            check_exposure(host, api.token)
        self.api = api
        self.host = host
        self.port = port
        self.read_timeout = read_timeout
        self.max_connections = max_connections
        self.app = AsgiApp(api, host, read_timeout, allowed_hosts)
        self._server: uvicorn.Server | None = None
        self._serving: asyncio.Task[None] | None = None
        self._sampling: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def _listen(self) -> socket.socket:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        try:
            return socket.create_server((self.host, self.port), family=family)
        except OSError as exc:
            raise ConfigError(
                f"the HTTP API cannot listen on {self.host}:{self.port}: {exc.strerror or exc}"
            ) from None

    async def start(self) -> HttpServer:
        uvicorn = _require("uvicorn")
        config = uvicorn.Config(
            self.app,
            http=_protocol_class(self.read_timeout, self.max_connections),
            ws="none",
            lifespan="off",
            log_config=None,  # the application's (or the CLI's) logging, not uvicorn's
            access_log=False,
            proxy_headers=False,  # no client address or scheme taken from X-Forwarded-*
            server_header=False,
            # uvicorn counts the connection of the request itself: max_connections + 1 answers
            # up to max_connections (more are refused on arrival, _DeadlineProtocol).
            limit_concurrency=self.max_connections + 1,
            h11_max_incomplete_event_size=MAX_HEAD_BYTES,
            timeout_graceful_shutdown=SHUTDOWN_GRACE_SECONDS,
        )
        listener = self._listen()
        self.port = listener.getsockname()[1]  # the port chosen for port 0
        self.app.authority = self.url.removeprefix("http://")
        server = uvicorn.Server(config)
        # Server.serve() would take over SIGINT and SIGTERM, which belong to the relay (or to
        # the application embedding the API); _serve() is serve() without that.
        self._serving = asyncio.create_task(server._serve(sockets=[listener]))
        self._server = server
        while not server.started:
            if self._serving.done():
                await self._serving  # raises what stopped it
                raise ConfigError(f"the HTTP API on {self.url} stopped while starting")
            await asyncio.sleep(0.01)
        self._sampling = asyncio.create_task(self.api.sample_forever())
        logger.info(
            "HTTP API listening on %s (%s)",
            self.url,
            "read only"
            if not self.api.writes
            else "requeue, purge and replay need the bearer token"
            if self.api.token
            else "requeue, purge and replay open to local clients",
        )
        return self

    async def close(self) -> None:
        """Stop listening, close idle connections, finish (or cancel) requests, close the store."""
        if self._sampling is not None:
            self._sampling.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sampling
        if self._server is not None and self._serving is not None:
            self._server.should_exit = True
            await self._serving
        self._server = self._serving = self._sampling = None
        await self.api.close()

    async def __aenter__(self) -> HttpServer:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


def check_exposure(host: str, token: str | None) -> None:
    """Refuse to offer requeue without a token to anyone but this machine."""
    if token is None and not is_loopback(host):
        raise ConfigError(
            f"set --http-token to expose requeue on a non-loopback address ({host}) (purge "
            "and replay too); "
            "or bind the HTTP API to 127.0.0.1"
        )


def api_stores(settings: Settings) -> Store | dict[str, Store]:
    """The API's own store (not yet connected): of the one database, or of each by name."""
    if not settings.several_databases:
        return create_store(settings.require_db(), schema=settings.schema, table=settings.table)
    return {
        name: create_store(own.require_db(), schema=own.schema, table=own.table)
        for name, own in settings.database_settings().items()
    }


async def start_http_api(
    settings: Settings,
    relay: Relay | RelayGroup | None = None,
    *,
    collectors: Iterable[Any] = (),
) -> HttpServer:
    """Check the settings, then listen on ``settings.http``; ConfigError if it cannot."""
    if not settings.http:
        raise ConfigError("no HTTP address: pass --http HOST:PORT or set OUTBOXER_HTTP")
    host, port = parse_http_address(settings.http, "--http")
    for module in _HTTP_EXTRA:  # checked before the store or a socket is opened
        _require(module)
    api = HttpApi(
        api_stores(settings), settings, relay, token=settings.http_token, collectors=collectors
    )
    return await HttpServer(api, host, port, allowed_hosts=settings.http_allowed_hosts).start()


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
