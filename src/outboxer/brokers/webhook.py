"""``http(s)://host/path``: POST every message to an HTTP endpoint (a webhook), through httpx.

A message counts as published once the receiver answered it with a 2xx status.
A retryable answer's ``Retry-After`` (seconds or an HTTP date) becomes the least
wait before that message's next attempt (up to the relay's longest backoff).
Each message is one request; the body is the payload, the envelope travels in
``Outboxer-*`` headers and, with a ``secret``, the request is signed (see
:mod:`outboxer.webhook_signature` for the scheme and the receiver's check).

The status decides the outcome. Of the response body at most ``RESPONSE_READ_BYTES``
are read, for at most ``RESPONSE_READ_SECONDS``, and the connection is dropped if more
is left: a receiver answering with an endless (or 300 MB) body costs the relay a few
KiB. The start of an error answer's body, decoded with replacement characters and
without control characters, goes into the error text.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import ssl
import time
import urllib.request
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Mapping, Sequence
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import cast
from urllib.parse import quote, unquote, urljoin, urlsplit, urlunsplit

import httpx

from outboxer.brokers import resolve
from outboxer.brokers.base import NotSent, Publisher, parse_options
from outboxer.config import duration_option, int_option
from outboxer.errors import BrokerUnavailableError, ConfigError, PublishError
from outboxer.message import Message
from outboxer.redact import redact_url
from outboxer.webhook_signature import (
    HEADER_ID,
    HEADER_TIMESTAMP,
    sign_headers,
)

HEADER_TOPIC = "Outboxer-Topic"
HEADER_KEY = "Outboxer-Key"
HEADER_CREATED_AT = "Outboxer-Created-At"
#: User headers whose names HTTP or outboxer own are sent under this prefix.
RESERVED_PREFIX = "Outboxer-Header-"
RESERVED_NAMES = frozenset(
    {
        "host",
        "content-length",
        "content-type",
        "content-encoding",
        "transfer-encoding",
        "connection",
        "keep-alive",
        "upgrade",
        "te",
        "trailer",
        "expect",
        "proxy-connection",
        "proxy-authorization",
        # The receiver takes these for the transport's own, not the message's; and a user
        # header "Authorization" replaced the publisher's configured one on its request.
        "authorization",
        "user-agent",
        "accept",
        "accept-encoding",
        "forwarded",
        "via",
    }
)

#: Query parameters outboxer reads itself (and removes from the URL it posts to).
OPTIONS = ("secret", "max_connections", "retry_statuses", "timeout")
DEFAULT_RETRY_STATUSES = frozenset({408, 429, *range(500, 600)})
DEFAULT_MAX_CONNECTIONS = 64
#: How far past ``timeout`` a request may wait for the receiver's status and headers in
#: all (connect, send, the head): past httpx's own connect timeout, so that one still wins.
HEAD_DEADLINE_MARGIN = 1.0
DEFAULT_TIMEOUT = 10.0
#: The most of a response body read (an error answer's excerpt comes from it).
RESPONSE_READ_BYTES = 4096
#: The longest a response body is read once the status arrived (the status decided already).
RESPONSE_READ_SECONDS = 1.0
#: Characters of an error answer's body kept in the error text.
EXCERPT_CHARS = 200
#: Control characters (but whitespace, which is collapsed) cannot go into stored error text.
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")

#: An HTTP header name (RFC 9110's token). Used with fullmatch: an anchored "$" also
#: matches before a final newline, and "x-evil\n" was taken for a name.
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
#: Header values keep printable ASCII but ``%`` and space; the rest is percent-encoded UTF-8.
_SAFE = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) != "%")
#: A header name sent under RESERVED_PREFIX keeps its token characters but ``%``.
_NAME_SAFE = "!#$&'*+-.^_`|~"


class WebhookStatusError(PublishError):
    """The receiver answered with a status other than 2xx."""

    def __init__(
        self,
        status: int,
        url: str,
        excerpt: str,
        *,
        retryable: bool,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(
            f"{url} answered HTTP {status}: {excerpt}".rstrip(": "),
            retryable=retryable,
            retry_after=retry_after,
        )
        self.status = status


def parse_retry_after(value: str | None, now: datetime | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (RFC 9110: delay-seconds or an HTTP
    date); None when absent or unreadable, 0 for a date already past."""
    if value is None:
        return None
    text = value.strip()
    # ASCII digits only (RFC 9110's DIGIT): str.isdigit() takes '²', which float() refuses,
    # and the ValueError took the place of the receiver's answer as the attempt's error.
    if text.isascii() and text.isdigit():
        return float(text)
    try:
        when = parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # an HTTP date is GMT
        when = when.replace(tzinfo=UTC)
    return max((when - (now or datetime.now(UTC))).total_seconds(), 0.0)


def encode_header_value(value: str) -> str:
    """Percent-encode what an HTTP header cannot carry; plain ASCII tokens stay as they are."""
    return quote(value, safe=_SAFE)


def decode_header_value(value: str) -> str:
    """The receiver's inverse of :func:`encode_header_value`."""
    return unquote(value)


def parse_retry_statuses(value: str | Iterable[int | str]) -> frozenset[int]:
    """``"408,429,5xx"`` (or an iterable of ints and ``"Nxx"`` strings) -> the set of statuses."""
    items = value.split(",") if isinstance(value, str) else list(value)
    statuses: set[int] = set()
    for item in items:
        token = str(item).strip().lower()
        if not token:
            continue
        if re.fullmatch(r"[1-5]xx", token):
            base = int(token[0]) * 100
            statuses.update(range(base, base + 100))
        elif token.isdigit() and 100 <= int(token) <= 599:
            statuses.add(int(token))
        else:
            raise ConfigError(
                f"webhook option retry_statuses: {item!r} is not a status (like 503) or a class (like 5xx)"
            )
    if any(200 <= status < 300 for status in statuses):
        raise ConfigError(
            "webhook option retry_statuses cannot contain 2xx statuses (they mean published)"
        )
    return frozenset(statuses)


class _Lanes:
    """Up to ``size`` one-connection httpx clients; each request borrows an idle one.

    httpx's pool scans all its connections for every request, so one client
    with 64 connections is several times slower than 64 clients of one
    connection each. The clients share one SSL context, which keeps them cheap.
    """

    def __init__(self, size: int, make: Callable[[], httpx.AsyncClient]) -> None:
        self._slots = asyncio.Semaphore(size)
        self._make = make
        self._idle: list[httpx.AsyncClient] = []  # most recently used last: warm connections first
        self._closed = False

    @contextlib.asynccontextmanager
    async def borrow(self) -> AsyncIterator[httpx.AsyncClient]:
        async with self._slots:
            client = self._idle.pop() if self._idle else self._make()
            try:
                yield client
            finally:
                if not self._closed:
                    self._idle.append(client)
                else:
                    # Closed while this request waited for a slot or ran (the publisher
                    # reconnected, or closes): the client is this request's to close, else
                    # it kept its connection open for good.
                    await _close_clients([client])

    async def aclose(self) -> None:
        """Close the idle clients; one lent to a request is closed once the request is done
        (``borrow``). Closed under it, a request that was going well failed and had its
        attempt counted (the receiver may have applied it) whenever another relay loop
        reconnected: only idle connections are stale."""
        self._closed = True
        clients, self._idle = self._idle, []
        await _close_clients(clients)


def _environment_proxies() -> list[str]:
    """The proxy URLs httpx's clients take from the environment (``HTTP_PROXY``,
    ``HTTPS_PROXY``, ``ALL_PROXY``; httpx's ``get_environment_proxies``), a scheme added
    where one is missing as httpx adds it."""
    proxies = urllib.request.getproxies()
    return [
        url if "://" in url else f"http://{url}"
        for scheme in ("http", "https", "all")
        if (url := proxies.get(scheme))
    ]


async def _close_clients(clients: Sequence[httpx.AsyncClient]) -> None:
    """Close ``clients``; one whose connection broke has nothing left to release."""
    results = await asyncio.gather(*(client.aclose() for client in clients), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException) and not isinstance(result, Exception):
            raise result  # cancellation, not a broken connection


class WebhookPublisher(Publisher):
    """POSTs each message to the URL (or to its topic's route).

    Options (URL query string or keyword arguments; keywords win), removed from
    the URL before posting; every other query parameter is sent to the receiver:

    - ``secret``: signs every request (``Outboxer-Signature``); unset, nothing is signed.
    - ``max_connections`` (default 64): requests in flight and pooled connections.
    - ``retry_statuses`` (default ``408,429,5xx``): statuses that fail retryably;
      any other non-2xx status fails for good.
    - ``timeout`` (seconds, default 10): connect, read and write timeout of one request; a
      request waits at most a second more in all for the receiver's status and headers.
    - ``headers`` (keyword only): static headers sent with every request (e.g. Authorization).
    - ``verify`` (keyword only, default True): TLS verification, as httpx takes it
      (False, a CA bundle path, or an ``ssl.SSLContext``).
    """

    schemes = ("http", "https")

    def __init__(
        self,
        url: str,
        *,
        routes: Mapping[str, str] | None = None,
        publish_timeout: float = 30.0,
        secret: str | bytes | None = None,
        max_connections: int | None = None,
        retry_statuses: str | Iterable[int | str] | None = None,
        timeout: float | None = None,
        headers: Mapping[str, str] | None = None,
        verify: ssl.SSLContext | str | bool = True,
    ) -> None:
        super().__init__(url, routes=routes, publish_timeout=publish_timeout)
        parts, options = parse_options(url)
        if parts.scheme.lower() not in self.schemes or not parts.hostname:
            raise ConfigError(
                f"webhook URL must be http(s)://host[:port]/path, not {redact_url(url)!r}"
            )
        #: The URL every unrouted message is posted to (outboxer's options removed).
        self.endpoint: str = urlunsplit(
            parts._replace(query=_strip_options(parts.query), fragment="")
        )
        secret = secret if secret is not None else options.get("secret")
        self.secret: bytes | None = (secret.encode() if isinstance(secret, str) else secret) or None
        self.max_connections = int_option(
            max_connections
            if max_connections is not None
            else options.get("max_connections", DEFAULT_MAX_CONNECTIONS),
            "webhook option max_connections",
            1,
            10_000,
        )
        statuses = retry_statuses if retry_statuses is not None else options.get("retry_statuses")
        self.retry_statuses = (
            DEFAULT_RETRY_STATUSES if statuses is None else parse_retry_statuses(statuses)
        )
        self.timeout = duration_option(
            timeout if timeout is not None else options.get("timeout", DEFAULT_TIMEOUT),
            "webhook option timeout",
            0.001,
            3600,
        )
        self.headers = dict(headers or {})
        for name in self.headers:
            if not _TOKEN.fullmatch(name):
                raise ConfigError(
                    f"webhook option headers: {name!r} is not a valid HTTP header name"
                )
        #: User header names sent under RESERVED_PREFIX: a message's header of a configured
        #: static header's name would replace that one on its request (credentials included).
        self._reserved = RESERVED_NAMES | {name.lower() for name in self.headers}
        for topic, route in self.routes.items():
            if "://" in route and urlsplit(route).scheme.lower() not in self.schemes:
                raise ConfigError(
                    f"webhook route for {topic!r} must be an http(s) URL or a path: {route!r}"
                )
        self.verify = verify
        self._ssl: ssl.SSLContext | None = None
        if isinstance(verify, str):
            # Loaded now (that file alone: quick), so that a path that cannot be read is a
            # ConfigError at start naming the option, not an outage at every connect.
            try:
                self._ssl = _ssl_context(verify)
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError(
                    f"webhook option verify: cannot load CA certificates from {verify!r}: {exc}"
                ) from exc
        self._lanes: _Lanes | None = None
        #: A URL that refused a connection: the next connect probes it (see _connect).
        self._unreachable: str | None = None

    def destination_for(self, message: Message) -> str:
        """The URL to post ``message`` to: the endpoint, or its topic's route.

        An absolute route replaces the endpoint; a route starting with ``/``
        replaces its path; any other route is appended to its path.
        """
        route = self.routes.get(message.topic)
        if route is None:
            return self.endpoint
        if "://" in route:
            return route
        parts = urlsplit(self.endpoint)
        path = route if route.startswith("/") else f"{parts.path.rstrip('/')}/{route}"
        return urlunsplit(parts._replace(path=path))

    # ----- connection ------------------------------------------------------------------------

    def host_names(self) -> list[str]:
        # A route may name another receiver (an absolute URL): its lookups too. So does the
        # proxy the environment names, which httpx connects to instead (trust_env): its name
        # is the one looked up here, once per request, the receiver's by the proxy.
        urls = [self.endpoint, *(route for route in self.routes.values() if "://" in route)]
        urls += _environment_proxies()
        return [host for url in urls for host in resolve.hosts_of(url)]

    async def _connect(self) -> None:
        await self._close()  # pooled connections to a restarted receiver are stale
        ssl_context = self._ssl
        if ssl_context is None:  # loading the CA store takes a while: once, off the event loop
            ssl_context = self._ssl = await asyncio.to_thread(_ssl_context, self.verify)

        def client() -> httpx.AsyncClient:
            return httpx.AsyncClient(
                limits=httpx.Limits(max_connections=1, max_keepalive_connections=1),
                timeout=httpx.Timeout(self.timeout, pool=None),
                # Uncompressed answers only: a compressed body's excerpt would be unreadable,
                # and decompressing would defeat the bound on what is read.
                headers={"Accept-Encoding": "identity", **self.headers},
                follow_redirects=False,
                verify=ssl_context,
            )

        self._lanes = _Lanes(self.max_connections, client)
        unreachable = self._unreachable
        if unreachable is not None:
            # HTTP has no connection to open: without this, the relay's reconnect after an
            # endpoint refused its requests succeeded at once, the relay claimed again, and
            # an outage used up every message's attempts. A HEAD request (any answer will
            # do: the receiver is there) tells the relay the endpoint is still down. On a
            # client of its own, closed after: a receiver that answers HEAD with a body
            # would leave bytes on a pooled connection for the next POST to misread.
            async with client() as probe:
                try:
                    await probe.head(unreachable)
                except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                    raise BrokerUnavailableError(
                        f"cannot reach {_safe(unreachable)}: {_describe(exc)}"
                    ) from exc
                except httpx.HTTPError:
                    pass  # it answered, or at least accepted the connection
            self._unreachable = None

    async def _close(self) -> None:
        lanes, self._lanes = self._lanes, None
        if lanes is not None:
            await lanes.aclose()

    # ----- publishing ------------------------------------------------------------------------

    def request_headers(self, message: Message, timestamp: int | None = None) -> dict[str, str]:
        """The headers of ``message``'s request (signed now unless ``timestamp`` is given)."""
        headers = {"Content-Type": message.content_type, HEADER_ID: str(message.id)}
        #: Each user header's name as sent, folded: HTTP header names know no case.
        sent: dict[str, str] = {}
        for name, value in message.headers.items():
            given, folded = name, name.lower()
            if (
                not _TOKEN.fullmatch(name)  # a space, a colon, a newline, non-ASCII
                or folded in self._reserved
                or folded.startswith("outboxer-")
            ):
                # Percent-encoded, any name is a token; the receiver decodes it.
                name = RESERVED_PREFIX + quote(name, safe=_NAME_SAFE)
                folded = name.lower()
            if folded in sent:
                # Both would reach the receiver as one header, and one value was lost.
                raise PublishError(
                    f"the headers {sent[folded]!r:.80} and {given!r:.80} differ only in case: "
                    "HTTP header names know no case, so a webhook receiver would get only one",
                    retryable=False,
                )
            sent[folded] = given
            headers[name] = encode_header_value(value)
        headers[HEADER_TOPIC] = encode_header_value(message.topic)
        if message.key is not None:
            headers[HEADER_KEY] = encode_header_value(message.key)
        if message.created_at is not None:
            headers[HEADER_CREATED_AT] = message.created_at.isoformat()
        if self.secret is not None:
            signed_at = int(time.time()) if timestamp is None else timestamp
            headers[HEADER_TIMESTAMP] = str(signed_at)
            # v1 (the body) for receivers that know no better, v2 over every header sent.
            headers.update(
                sign_headers(self.secret, signed_at, str(message.id), headers, message.payload)
            )
        return headers

    async def _publish_one(self, message: Message) -> None:
        lanes = self._lanes
        if lanes is None:
            raise ConnectionError("webhook publisher is not connected")
        url = self.destination_for(message)
        headers = self.request_headers(message)
        #: The receiver broke the connection while the body was still being sent (httpcore
        #: then reads for an answer, which such a close usually loses: see below).
        body_cut: list[BaseException] = []

        async def trace(event: str, info: Mapping[str, object]) -> None:
            if event == "http11.send_request_body.failed":
                body_cut.append(cast(BaseException, info.get("exception")))

        async with lanes.borrow() as client:
            try:
                # httpx's timeout bounds each read and write, not the request: a receiver
                # trickling its status line and headers a byte at a time held the request
                # until the relay's publish_timeout, which then failed the whole wave, the
                # messages other receivers had already acknowledged among them. The deadline
                # is a little past ``timeout``: a connect that hangs for all of it must end
                # in httpx's ConnectTimeout (no attempt, the relay reconnects), not here.
                async with (
                    asyncio.timeout(self.timeout + HEAD_DEADLINE_MARGIN) as deadline,
                    client.stream(
                        "POST",
                        url,
                        content=message.payload,
                        headers=headers,
                        extensions={"trace": trace},
                    ) as response,
                ):
                    deadline.reschedule(None)  # the status is here; _read_head has its own
                    # Leaving the block closes the response: its connection is dropped if
                    # the body was not read to the end.
                    head, cut_short = await _read_head(response)
            except TimeoutError as exc:
                raise PublishError(
                    f"request to {_safe(url)} failed: TimeoutError: no status and headers "
                    f"within {self.timeout + HEAD_DEADLINE_MARGIN:g}s"
                ) from exc
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                # No connection, so no request: the receiver never saw the message (no
                # attempt), and the relay reconnects, which probes the endpoint (_connect).
                self._unreachable = url
                raise NotSent(
                    BrokerUnavailableError(f"cannot reach {_safe(url)}: {_describe(exc)}")
                ) from exc
            except (
                httpx.LocalProtocolError,
                httpx.UnsupportedProtocol,
                httpx.InvalidURL,
                UnicodeError,
            ) as exc:
                raise PublishError(
                    f"cannot send to {_safe(url)}: {_describe(exc)}", retryable=False
                ) from exc
            except httpx.HTTPError as exc:  # timeouts, dropped connections: try again later
                if body_cut:
                    # A receiver refusing a body over its size limit (413) before reading it
                    # and closing: the unread bytes make its kernel reset the connection, which
                    # discards the answer on the relay's side. The error said "ReadError" only,
                    # for every attempt. Still retryable: a receiver going down mid-body (or
                    # shutting down with a 503) looks the same.
                    raise PublishError(
                        f"request to {_safe(url)} failed: the receiver closed the connection "
                        f"while the {len(message.payload):,}-byte body was being sent, and "
                        f"no answer arrived ({_describe(exc)}); a receiver refusing bodies over "
                        "a size limit before reading them (413) looks like this"
                    ) from exc
                raise PublishError(f"request to {_safe(url)} failed: {_describe(exc)}") from exc
        if 200 <= response.status_code < 300:
            return
        excerpt = _excerpt(head, response.headers.get("content-encoding", ""), cut_short)
        if 300 <= response.status_code < 400 and "location" in response.headers:
            # Not followed (the signed request, and its configured credentials, would go
            # wherever the receiver points): the error named no place, only "HTTP 301".
            excerpt = f"{_redirect(url, response.headers['location'])} {excerpt}".strip()
        retryable = response.status_code in self.retry_statuses
        raise WebhookStatusError(
            response.status_code,
            _safe(url),
            excerpt,
            retryable=retryable,
            retry_after=parse_retry_after(response.headers.get("retry-after"))
            if retryable
            else None,
        )


async def _read_head(response: httpx.Response) -> tuple[bytes, str]:
    """At most ``RESPONSE_READ_BYTES`` of the body, read for at most ``RESPONSE_READ_SECONDS``,
    and what cut the reading short, if anything did ("" when the body ended or filled the head).

    A body that ends sooner leaves the connection reusable. A failure while reading is no
    failure of the request (the status arrived): it is only noted.
    """
    head = bytearray()
    chunks = cast(AsyncGenerator[bytes, None], response.aiter_raw())
    try:
        async with asyncio.timeout(RESPONSE_READ_SECONDS), contextlib.aclosing(chunks):
            async for chunk in chunks:
                head += chunk[: RESPONSE_READ_BYTES - len(head)]
                if len(head) >= RESPONSE_READ_BYTES:
                    break
    except TimeoutError:
        return bytes(head), f"(body still arriving after {RESPONSE_READ_SECONDS:g}s)"
    except httpx.HTTPError as exc:
        return bytes(head), f"(body unreadable: {_describe(exc)})"
    return bytes(head), ""


def _excerpt(head: bytes, content_encoding: str, cut_short: str) -> str:
    """Storable text for the start of an error answer's body (UTF-8 with replacement
    characters, at most EXCERPT_CHARS), then what cut its reading short, if anything."""
    if content_encoding.strip().lower() in ("", "identity"):
        shown = head[: EXCERPT_CHARS * 4].decode("utf-8", errors="replace")
    else:
        shown = f"({content_encoding}-encoded body, not shown)"
    return f"{_storable(shown)} {_storable(cut_short)}".strip()


def _storable(text: str) -> str:
    """``text`` without control characters (NUL cannot be stored), whitespace collapsed,
    at most EXCERPT_CHARS."""
    return " ".join(_CONTROL.sub("\ufffd", text).split())[:EXCERPT_CHARS]


def _redirect(url: str, location: str) -> str:
    """Where a 3xx answer points, for the error text: absolute, without credentials or query
    (as the URLs outboxer shows), control characters replaced, at most EXCERPT_CHARS."""
    try:
        target = _safe(urljoin(url, location.strip()))
    except ValueError:  # an unparsable Location (a bad IPv6 literal): shown as sent
        target = location
    return f"(redirects to {_storable(target)}, not followed)"


def _ssl_context(verify: ssl.SSLContext | str | bool) -> ssl.SSLContext:
    if isinstance(verify, ssl.SSLContext):
        return verify
    if isinstance(verify, str):  # a CA bundle file or a directory of CA certificates
        if os.path.isdir(verify):
            return ssl.create_default_context(capath=verify)
        return ssl.create_default_context(cafile=verify)
    return httpx.create_ssl_context(verify=verify)


def _strip_options(query: str) -> str:
    """``query`` without outboxer's options, every other parameter untouched."""
    return "&".join(
        pair for pair in query.split("&") if pair and unquote(pair.partition("=")[0]) not in OPTIONS
    )


def _safe(url: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2], query=""))


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


__all__ = [
    "WebhookPublisher",
    "WebhookStatusError",
    "decode_header_value",
    "encode_header_value",
    "parse_retry_statuses",
]
