"""WebhookPublisher against a real HTTP/1.1 server started by the test (asyncio streams).

The server records every request, answers 200 unless told otherwise (per
server, or per request with a ``Test-Answer: <status>`` header), can delay its
answers, and counts how many requests it serves at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import subprocess
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from pathlib import Path

import pytest

from outboxer.brokers import create_publisher
from outboxer.brokers.base import OutcomeKind
from outboxer.brokers.webhook import (
    DEFAULT_RETRY_STATUSES,
    WebhookPublisher,
    decode_header_value,
    parse_retry_after,
    parse_retry_statuses,
)
from outboxer.errors import BrokerUnavailableError, ConfigError
from outboxer.message import Message
from outboxer.testing import Consumer, PublisherContract, Received, make_message
from outboxer.webhook_signature import WebhookSignatureError, verify_signature


@dataclass
class Request:
    method: str
    target: str
    #: Header names in lower case, values as sent.
    headers: dict[str, str]
    body: bytes
    status: int


@dataclass
class HookServer:
    """A tiny HTTP/1.1 server (keep-alive, Content-Length bodies) on 127.0.0.1."""

    port: int = 0
    status: int = 200
    delay: float = 0.0
    requests: list[Request] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    connections: int = 0
    tls: ssl.SSLContext | None = None
    #: Set whenever a request was recorded.
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    _server: asyncio.Server | None = None
    _handlers: set[asyncio.Task[None]] = field(default_factory=set)

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    async def start(self) -> HookServer:
        self._server = await asyncio.start_server(
            self._handle, "127.0.0.1", self.port, ssl=self.tls
        )
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        """Go down: stop listening and drop every open connection."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for task in list(self._handlers):
            task.cancel()
        if self._handlers:
            await asyncio.wait(list(self._handlers), timeout=5)

    async def restart(self) -> None:
        await self.stop()
        await self.start()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        self.connections += 1
        try:
            while await self._serve_one(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            self._handlers.discard(task)
            writer.transport.abort()

    async def _serve_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        line = await reader.readline()
        if not line:
            return False
        method, target, _ = line.decode("latin-1").split(" ", 2)
        headers: dict[str, str] = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        length = int(headers.get("content-length", "0"))
        body = await reader.readexactly(length) if length else b""
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.delay:
                await asyncio.sleep(self.delay)
        finally:
            self.in_flight -= 1
        status = int(headers.get("test-answer", self.status))
        self.requests.append(Request(method, target, headers, body, status))
        self.arrived.set()
        answer = f"status {status}".encode()
        retry_after = decode_header_value(
            headers.get("test-retry-after", "")
        )  # sent percent-encoded
        extra = f"Retry-After: {retry_after}\r\n" if retry_after else ""
        writer.write(
            f"HTTP/1.1 {status} Test\r\nContent-Type: text/plain\r\n{extra}"
            f"Content-Length: {len(answer)}\r\n\r\n".encode()
            + answer
        )
        await writer.drain()
        return True


def received(request: Request) -> Received:
    headers = {name: decode_header_value(value) for name, value in request.headers.items()}
    return Received(
        id=headers.get("outboxer-id", ""),
        topic=headers.get("outboxer-topic", ""),
        key=headers.get("outboxer-key"),
        headers=headers,
        payload=request.body,
    )


class HookConsumer(Consumer):
    """The requests for one topic the server accepted (2xx) since the consumer started."""

    def __init__(self, server: HookServer, topic: str) -> None:
        self.server = server
        self.topic = topic
        self.since = len(server.requests)

    def accepted(self) -> list[Received]:
        return [
            received(r)
            for r in self.server.requests[self.since :]
            if 200 <= r.status < 300
            and decode_header_value(r.headers.get("outboxer-topic", "")) == self.topic
        ]

    async def receive(self, count: int, timeout: float = 10.0) -> list[Received]:
        deadline = time.monotonic() + timeout
        while len(self.accepted()) < count and (left := deadline - time.monotonic()) > 0:
            self.server.arrived.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.server.arrived.wait(), left)
        return self.accepted()


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class TestWebhook(PublisherContract):
    server: HookServer

    @pytest.fixture(autouse=True)
    async def _server(self):  # type: ignore[no-untyped-def]
        self.server = await HookServer().start()
        yield
        await self.server.stop()

    def make_publisher(self, path: str = "/hooks", **options: object) -> WebhookPublisher:
        return WebhookPublisher(self.server.url + path, **options)  # type: ignore[arg-type]

    def make_unreachable_publisher(self) -> WebhookPublisher:
        return WebhookPublisher(f"http://127.0.0.1:{closed_port()}/hooks", timeout=2)

    async def start_consumer(self, topic: str) -> HookConsumer:
        return HookConsumer(self.server, topic)

    def rejected_message(self, topic: str) -> Message:
        return make_message(topic, {"reject": True}, headers={"test-answer": "400"})

    async def restart_server(self) -> None:
        await self.server.restart()

    # ----- webhook specifics --------------------------------------------------------------

    async def test_request_shape_and_signature(self) -> None:
        topic = self.fresh_topic()
        message = make_message(
            topic, {"total": 12}, key="order-7", headers={"traceparent": "00-ab-cd-01"}
        )
        async with self.make_publisher(secret="s3cret") as publisher:
            [outcome] = await publisher.publish_batch([message])
        assert outcome.published, outcome
        [request] = self.server.requests
        assert request.method == "POST"
        assert request.target == "/hooks"
        assert request.body == message.payload
        assert request.headers["content-type"] == "application/json"
        assert request.headers["outboxer-id"] == str(message.id)
        assert request.headers["outboxer-topic"] == topic
        assert request.headers["outboxer-key"] == "order-7"
        assert request.headers["traceparent"] == "00-ab-cd-01"
        assert abs(int(request.headers["outboxer-timestamp"]) - time.time()) < 5
        assert request.headers["outboxer-signature"].startswith("v1=")
        assert verify_signature("s3cret", request.headers, request.body) == str(message.id)
        with pytest.raises(WebhookSignatureError):
            verify_signature("s3cret", request.headers, request.body + b" ")
        with pytest.raises(WebhookSignatureError):
            verify_signature("s3cret", {**request.headers, "outboxer-id": "another"}, request.body)
        with pytest.raises(WebhookSignatureError):
            verify_signature("other", request.headers, request.body)

    async def test_without_a_secret_nothing_is_signed(self) -> None:
        async with self.make_publisher() as publisher:
            [outcome] = await publisher.publish_batch([make_message(self.fresh_topic())])
        assert outcome.published
        [request] = self.server.requests
        assert "outboxer-signature" not in request.headers
        assert "outboxer-timestamp" not in request.headers

    async def test_text_that_http_headers_cannot_carry_is_percent_encoded(self) -> None:
        topic = "commandes.créées"
        consumer = await self.start_consumer(topic)
        message = make_message(topic, "x", key="zürich 1%", headers={"note": "a b\r\nc ✓"})
        async with self.make_publisher() as publisher:
            [outcome] = await publisher.publish_batch([message])
        assert outcome.published, outcome
        [request] = self.server.requests
        assert request.headers["outboxer-key"] == "z%C3%BCrich%201%25"
        [got] = await consumer.receive(1)
        assert got.topic == topic
        assert got.key == "zürich 1%"
        assert got.headers["note"] == "a b\r\nc ✓"

    async def test_reserved_header_names_are_prefixed(self) -> None:
        headers = {
            "Content-Type": "text/evil",
            "Outboxer-Id": "forged",
            "host": "elsewhere",
            "x-ok": "1",
        }
        message = make_message(self.fresh_topic(), {"a": 1}, headers=headers)
        async with self.make_publisher() as publisher:
            [outcome] = await publisher.publish_batch([message])
        assert outcome.published, outcome
        [request] = self.server.requests
        assert request.headers["content-type"] == "application/json"
        assert request.headers["outboxer-id"] == str(message.id)
        assert request.headers["host"] == f"127.0.0.1:{self.server.port}"
        assert request.headers["outboxer-header-content-type"] == "text/evil"
        assert request.headers["outboxer-header-outboxer-id"] == "forged"
        assert request.headers["outboxer-header-host"] == "elsewhere"
        assert request.headers["x-ok"] == "1"

    async def test_a_header_name_http_cannot_carry_travels_encoded(self) -> None:
        topic = self.fresh_topic()
        spaced = make_message(topic, {"a": 1}, key="k", headers={"bad name": "v"})
        good = make_message(topic, {"a": 2}, key="j")
        async with self.make_publisher() as publisher:
            assert "Outboxer-Header-bad%20name" in publisher.request_headers(spaced)
            outcomes = await publisher.publish_batch([spaced, good])
        assert outcomes[0].published and outcomes[1].published, outcomes

    async def test_a_header_name_ending_in_a_newline_travels_encoded(self) -> None:
        """``re.match`` with ``$`` took "x-evil\\n" for a token (``$`` matches before a final
        newline): sent as is, the HTTP client refused the request ("Illegal header name"), a
        permanent failure: the message was abandoned, never delivered."""
        topic = self.fresh_topic()
        evil = make_message(topic, {"a": 1}, key="k", headers={"x-evil\n": "v"})
        async with self.make_publisher() as publisher:
            assert publisher.request_headers(evil).get("Outboxer-Header-x-evil%0A") == "v"
            [outcome] = await publisher.publish_batch([evil])
        assert outcome.published, outcome
        [request] = self.server.requests
        assert request.headers["outboxer-header-x-evil%0a"] == "v"
        with pytest.raises(ConfigError, match="not a valid HTTP header name"):
            WebhookPublisher(self.server.url, headers={"X-Static\n": "1"})

    @pytest.mark.parametrize(
        ("status", "retryable"),
        [
            (500, True),
            (503, True),
            (429, True),
            (408, True),
            (400, False),
            (404, False),
            (410, False),
            (301, False),
        ],
    )
    async def test_status_classification(self, status: int, retryable: bool) -> None:
        self.server.status = status
        async with self.make_publisher() as publisher:
            [outcome] = await publisher.publish_batch([make_message(self.fresh_topic())])
            assert publisher.connected  # an answer, however bad, is no connection problem
        assert outcome.kind is OutcomeKind.FAILED
        assert outcome.retryable is retryable, outcome
        assert f"HTTP {status}" in (outcome.error or "")

    async def test_retry_statuses_option(self) -> None:
        async with self.make_publisher("/hooks?retry_statuses=409,5xx") as publisher:
            outcomes = await publisher.publish_batch(
                [
                    make_message("t", headers={"test-answer": "409"}),
                    make_message("t", headers={"test-answer": "502"}),
                    make_message("t", headers={"test-answer": "429"}),
                ]
            )
        assert [o.retryable for o in outcomes] == [True, True, False], outcomes

    async def test_retry_after_of_a_retryable_answer_is_passed_on(self) -> None:
        later = format_datetime(datetime.now(UTC) + timedelta(seconds=90), usegmt=True)
        async with self.make_publisher() as publisher:
            outcomes = await publisher.publish_batch(
                [
                    make_message("t", headers={"test-answer": "429", "test-retry-after": "7"}),
                    make_message("t", headers={"test-answer": "503", "test-retry-after": later}),
                    make_message("t", headers={"test-answer": "503", "test-retry-after": "soon"}),
                    make_message("t", headers={"test-answer": "500"}),
                    make_message("t", headers={"test-answer": "400", "test-retry-after": "7"}),
                ]
            )
        assert [o.retryable for o in outcomes] == [True, True, True, True, False], outcomes
        assert outcomes[0].retry_after == 7
        assert outcomes[1].retry_after is not None and 85 <= outcomes[1].retry_after <= 90
        assert [o.retry_after for o in outcomes[2:]] == [
            None,
            None,
            None,
        ]  # unreadable, absent, permanent

    async def test_a_slow_receiver_times_out_retryably(self) -> None:
        self.server.delay = 1.0
        async with self.make_publisher(timeout=0.2) as publisher:
            [outcome] = await publisher.publish_batch([make_message(self.fresh_topic())])
            assert publisher.connected
        assert outcome.kind is OutcomeKind.FAILED and outcome.retryable, outcome
        assert "Timeout" in (outcome.error or "")

    async def test_many_in_flight_but_at_most_max_connections(self) -> None:
        self.server.delay = 0.05
        batch = [make_message(self.fresh_topic(), {"n": n}, key=f"k{n}") for n in range(40)]
        async with self.make_publisher(max_connections=4) as publisher:
            outcomes = await publisher.publish_batch(batch)
        assert all(o.published for o in outcomes)
        assert self.server.max_in_flight == 4
        assert self.server.connections == 4  # kept alive and reused
        self.server.max_in_flight = 0
        async with self.make_publisher() as publisher:
            outcomes = await publisher.publish_batch(batch)
        assert all(o.published for o in outcomes)
        assert self.server.max_in_flight > 10  # default max_connections=64: the wave goes at once

    async def test_receiver_down_fails_retryably_then_recovers(self) -> None:
        publisher = self.make_publisher()
        await publisher.connect()
        await self.server.stop()
        [outcome] = await publisher.publish_batch([make_message("t")])
        assert outcome.kind is OutcomeKind.FAILED and outcome.retryable, outcome
        assert not publisher.connected
        await self.server.start()
        await publisher.connect()
        [outcome] = await publisher.publish_batch([make_message("t")])
        await publisher.close()
        assert outcome.published, outcome

    async def test_routes_replace_or_join_the_url(self) -> None:
        routes = {
            "absolute": f"{self.server.url}/elsewhere?x=1",
            "relative": "orders",
            "rooted": "/root/path",
        }
        async with self.make_publisher(
            "/hooks/?token=abc&secret=s&max_connections=3", routes=routes
        ) as publisher:
            outcomes = await publisher.publish_batch(
                [make_message(topic) for topic in ("absolute", "relative", "rooted", "plain")]
            )
        assert all(o.published for o in outcomes), outcomes
        targets = {
            decode_header_value(r.headers["outboxer-topic"]): r.target for r in self.server.requests
        }
        assert targets == {
            "absolute": "/elsewhere?x=1",
            "relative": "/hooks/orders?token=abc",
            "rooted": "/root/path?token=abc",
            "plain": "/hooks/?token=abc",
        }
        assert all("outboxer-signature" in r.headers for r in self.server.requests)

    async def test_basic_auth_from_the_url_and_static_headers(self) -> None:
        url = self.server.url.replace("http://", "http://app:pa%3Ass@") + "/hooks"
        async with WebhookPublisher(url, headers={"Authorization-Extra": "token"}) as publisher:
            [outcome] = await publisher.publish_batch([make_message("t")])
            assert "pa" not in publisher.safe_url.split("@")[0].split(":", 2)[-1]
        assert outcome.published
        [request] = self.server.requests
        assert request.headers["authorization"] == "Basic YXBwOnBhOnNz"  # app:pa:ss
        assert request.headers["authorization-extra"] == "token"


@pytest.fixture
def self_signed(tmp_path: Path) -> tuple[Path, Path]:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


async def test_https_with_a_private_ca(self_signed: tuple[Path, Path]) -> None:
    cert, key = self_signed
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, key)
    server = await HookServer(tls=tls).start()
    try:
        async with WebhookPublisher(server.url + "/in", verify=str(cert)) as publisher:
            [outcome] = await publisher.publish_batch([make_message("t")])
        assert outcome.published, outcome
        async with WebhookPublisher(
            server.url + "/in"
        ) as publisher:  # the system CAs do not know it
            [outcome] = await publisher.publish_batch([make_message("t")])
        assert outcome.kind is OutcomeKind.FAILED and outcome.retryable, outcome
        assert "CERTIFICATE_VERIFY_FAILED" in (outcome.error or "")
    finally:
        await server.stop()


# ----- receivers answering with huge or endless bodies -------------------------------------

#: What the flooding receiver starts its body with: NUL, invalid UTF-8, a terminal escape.
FLOOD_HEAD = b"boom\x00\xff\xfe \x1b[31m"


@dataclass
class FloodServer:
    """Answers every request with ``500`` and a body of ``size`` bytes (chunked and endless
    when None), written ``chunk`` bytes every ``pause`` seconds; counts what it wrote."""

    size: int | None
    chunk: int
    pause: float
    written: int = 0
    port: int = 0
    _server: asyncio.Server | None = None

    async def start(self) -> FloodServer:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(
                int(line.split(b":")[1])
                for line in head.lower().split(b"\r\n")
                if line.startswith(b"content-length:")
            )
            await reader.readexactly(length)
            framing = (
                b"Transfer-Encoding: chunked"
                if self.size is None
                else b"Content-Length: %d" % self.size
            )
            writer.write(
                b"HTTP/1.1 500 Boom\r\nContent-Type: text/plain\r\n" + framing + b"\r\n\r\n"
            )
            body = FLOOD_HEAD + b"x" * (self.chunk - len(FLOOD_HEAD))
            while self.size is None or self.written < self.size:
                data = body if self.size is None else body[: self.size - self.written]
                writer.write(b"%x\r\n%s\r\n" % (len(data), data) if self.size is None else data)
                await writer.drain()
                self.written += len(data)
                body = b"x" * self.chunk
                await asyncio.sleep(self.pause)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the publisher hung up: what it was sent is counted
        finally:
            writer.transport.abort()


def peak_rss_reset() -> None:
    """Start counting the process's peak resident memory (VmHWM) afresh."""
    Path("/proc/self/clear_refs").write_text("5")


def peak_rss_bytes() -> int:
    status = Path("/proc/self/status").read_text()
    return int(status.split("VmHWM:")[1].split()[0]) * 1024


@pytest.mark.parametrize(
    ("size", "chunk", "pause"),
    [
        (300_000_000, 1 << 20, 0.002),  # 300 MB at up to 500 MB/s
        (None, 1, 0.05),  # an endless drip, a byte every 50 ms
    ],
    ids=["300MB", "endless-drip"],
)
async def test_a_huge_or_endless_error_body_costs_a_few_kib_and_fails_promptly(
    size: int | None, chunk: int, pause: float
) -> None:
    server = await FloodServer(size, chunk, pause).start()
    peak_rss_reset()
    before = peak_rss_bytes()
    try:
        async with WebhookPublisher(
            f"http://127.0.0.1:{server.port}/hooks", publish_timeout=20
        ) as publisher:
            started = time.monotonic()
            [outcome] = await publisher.publish_batch([make_message("t")])
            elapsed = time.monotonic() - started
    finally:
        await server.stop()
    assert elapsed < 3, f"the publish took {elapsed:.1f}s"
    # Loopback socket buffers hold a few MiB that the publisher never read.
    assert server.written < 16 << 20, f"the receiver got to write {server.written:,} bytes"
    assert peak_rss_bytes() - before < 32 << 20, "the publisher's memory grew by 32 MiB or more"
    assert outcome.kind is OutcomeKind.FAILED and outcome.retryable, outcome
    error = outcome.error or ""
    assert "HTTP 500" in error, error
    assert "\x00" not in error and "\x1b" not in error, error
    assert "boom\ufffd" in error, error  # NUL and invalid UTF-8 replaced
    assert len(error) < 600, error
    if size is None:
        assert "still arriving" in error, error


# ----- configuration (no server needed) --------------------------------------------------


def test_options_and_defaults() -> None:
    publisher = WebhookPublisher("https://h.example/in?a=1&secret=x&timeout=2.5&max_connections=8")
    assert publisher.endpoint == "https://h.example/in?a=1"
    assert publisher.secret == b"x"
    assert publisher.timeout == 2.5
    assert publisher.max_connections == 8
    assert publisher.retry_statuses == DEFAULT_RETRY_STATUSES
    assert "x" not in publisher.safe_url.split("?")[1].replace("max_connections", "")
    keyword = WebhookPublisher(
        "https://h.example/in?secret=x&max_connections=8", secret="y", max_connections=2
    )
    assert (keyword.secret, keyword.max_connections) == (b"y", 2)
    default = WebhookPublisher("http://h.example")
    assert (default.secret, default.max_connections, default.timeout) == (None, 64, 10.0)


def test_retry_after_parsing() -> None:
    now = datetime(2026, 11, 21, 9, 0, 0, tzinfo=UTC)
    assert parse_retry_after("120", now) == 120
    assert parse_retry_after(" 0 ", now) == 0
    assert parse_retry_after("Sat, 21 Nov 2026 09:01:30 GMT", now) == 90
    assert parse_retry_after("Sat, 21 Nov 2026 08:59:00 GMT", now) == 0  # already past
    for unreadable in (None, "", "-5", "1.5", "tomorrow", "Sat, 99 Nov 2026 09:01:30 GMT"):
        assert parse_retry_after(unreadable, now) is None, unreadable


def test_retry_statuses_parsing() -> None:
    assert parse_retry_statuses("408, 429,5xx") == DEFAULT_RETRY_STATUSES
    assert parse_retry_statuses([503, "4xx"]) == frozenset({503, *range(400, 500)})
    assert parse_retry_statuses("") == frozenset()


@pytest.mark.parametrize(
    ("url", "options", "match"),
    [
        ("http://h/x?max_connections=0", {}, "max_connections"),
        ("http://h/x?max_connections=many", {}, "max_connections"),
        ("http://h/x?timeout=-1", {}, "timeout"),
        ("http://h/x?retry_statuses=2xx", {}, "2xx"),
        ("http://h/x?retry_statuses=abc", {}, "abc"),
        ("http:///no-host", {}, "host"),
        ("http://h/x", {"routes": {"t": "ftp://elsewhere/"}}, "route"),
        ("http://h/x", {"headers": {"bad name": "v"}}, "header"),
    ],
)
def test_invalid_options_are_config_errors(
    url: str, options: dict[str, object], match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        WebhookPublisher(url, **options)  # type: ignore[arg-type]


def test_registry_builds_a_webhook_publisher() -> None:
    assert isinstance(create_publisher("https://h.example/hook"), WebhookPublisher)
    assert isinstance(create_publisher("http://h.example/hook"), WebhookPublisher)


async def test_close_without_connect_is_fine() -> None:
    publisher = WebhookPublisher("http://127.0.0.1:9/x")
    with contextlib.suppress(Exception):
        await publisher.close()
    await publisher.close()


async def test_an_endpoint_that_refuses_connections_costs_no_attempt_and_fails_the_reconnect() -> (
    None
):
    """HTTP has no connection to lose: an endpoint that refused its requests was "reconnected"
    to at once, the relay claimed again, and an outage used up every attempt (ABANDONED after
    ~8.5 minutes with the defaults). Refused requests are not attempted, and the reconnect
    probes the endpoint: it fails while the endpoint is down, so the relay backs off."""
    server = await HookServer().start()
    url = server.url + "/hooks"
    await server.stop()
    publisher = WebhookPublisher(url, timeout=2)
    await publisher.connect()
    try:
        [refused] = await publisher.publish_batch([make_message("t", {"n": 1}, key="k")])
        assert refused.kind is OutcomeKind.FAILED and not refused.attempted, refused
        assert not publisher.connected, "the relay reconnects before its next claim"
        with pytest.raises(BrokerUnavailableError, match="cannot reach"):
            await publisher.connect()
        await server.restart()
        await publisher.connect()
        [sent] = await publisher.publish_batch([make_message("t", {"n": 2}, key="k")])
        assert sent.published, sent
        assert [request.method for request in server.requests][-1] == "POST"
    finally:
        await publisher.close()
        await server.stop()
