"""Arbitrary request heads and bodies, as raw bytes, against the HTTP API's real server.

uvicorn's h11 protocol parses them and outboxer's ASGI app answers: the live server answers
every request with one well-formed HTTP/1.1 response of status 2xx, 4xx or 5xx (JSON, with
its Content-Length, ``Connection: close``), keeps answering, and logs no traceback. The
Content-Length rules (``body_length``) are fuzzed on their own too.

Deterministic for CI: ``derandomize=True`` draws the same examples on every run, and
``database=None`` keeps no example store that could change them.
"""

from __future__ import annotations

import logging
import re
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from outboxer import load_settings
from outboxer.http import (
    MAX_BODY_BYTES,
    HttpApi,
    HttpError,
    body_length,
)
from outboxer.stores import create_store
from tests.http_thread import serving_in_thread


def fuzz(max_examples: int) -> settings:
    return settings(
        max_examples=max_examples,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )


# ----- requests ----------------------------------------------------------------------------
# A plausible request with at most one part drawn from a wild strategy: wild parts
# everywhere would stop nearly every request at its first line, never reaching the rest.

any_text = st.text(st.characters(codec=None), max_size=12)
plausible: dict[str, st.SearchStrategy[Any]] = {
    "method": st.sampled_from(["GET", "GET", "POST", "POST", "HEAD", "PUT", "OPTIONS"]),
    "target": st.sampled_from(
        [
            "/health",
            "/metrics",
            "/status",
            "/messages",
            "/messages?status=FAILED,ABANDONED&limit=5",
            "/messages?status=pending&status=published",
            "/messages/requeue",
            "/nope",
        ]
    ),
    "version": st.sampled_from(["HTTP/1.1", "HTTP/1.1", "HTTP/1.0"]),
    "fields": st.lists(
        st.sampled_from(
            [
                "Host: localhost",
                "Content-Type: application/json",
                "Content-Type: application/json",
                "Authorization: Bearer 0123456789abcdef",
                "Expect: 100-continue",
                "User-Agent: fuzz",
            ]
        ),
        max_size=4,
    ),
    "body": st.sampled_from(
        [
            b"",
            b"{}",
            b'{"statuses": ["ABANDONED", "FAILED"]}',
            b'{"ids": ["0190d6c4-5a6e-7c4c-9d2b-0a1b2c3d4e5f"]}',
            b'{"destinations": ["default"], "statuses": ["FAILED"]}',
        ]
    ),
    "length": st.just("exact"),
    "separator": st.just("\r\n"),
}
wild: dict[str, st.SearchStrategy[Any]] = {
    "method": st.sampled_from(["G(T", "", "GET\n", "get"]) | any_text,
    "target": st.sampled_from(
        [
            "/messages?limit=\u00b2",
            "/messages?limit=%D9%A3",
            "/messages?limit=" + "9" * 5000,
            "/messages?limit=-1",
            "/messages?" + "&".join(["a=1"] * 60),
            "//[x",
            "/%00/%ff",
            "*",
            "http://evil.example/health",
            "/" + "a" * 20000,
        ]
    )
    | st.sampled_from(["//[x", "/messages?limit=\u00b2", "/messages?limit=%D9%A3"])
    | any_text.map(lambda text: "/" + text)
    | any_text,
    "version": st.sampled_from(["HTTP/2.0", "HTTP/\u00b9.1", "http/1.1", "HTTP/1.1\n", ""])
    | any_text,
    "fields": st.lists(
        st.sampled_from(
            [
                "Host: evil.example",  # DNS rebinding
                "Host: 127.0.0.1:9",
                "Host: [::1]",
                "Origin: http://evil.example",  # a page of another site
                "Origin: http://localhost",
                "Origin: null",
                "Content-Type: text/plain",
                "Transfer-Encoding: chunked",
            ]
        ),
        min_size=1,
        max_size=3,
    )
    | st.lists(
        st.tuples(
            st.sampled_from(["Host", "Origin", "Content-Type", "Content-Length", "Expect"])
            | st.sampled_from(["Transfer-Encoding", "Bad Name", "X\n", " Folded"])
            | any_text,
            st.sampled_from(["\u00b2", "\u0663", "9" * 5000, "1, 2", "-1", "chunked", "a\x00b"])
            | any_text,
        ).map(": ".join),
        min_size=1,
        max_size=4,
    )
    | st.just(["X: 1"] * 101),
    "body": st.binary(max_size=64)
    | st.sampled_from(
        [
            b'{"destinations": ["a\\u0000b"]}',
            b'{"statuses": ["\\ud800"]}',
            b'{"ids": ["not-a-uuid"]}',
            b'{"status": ["ABANDONED"]}',
            b"[" * 5000,
            b"\xff\xfe",
        ]
    ),
    "length": st.sampled_from(
        ["none", "short", "long", "twice", "huge", "superscript", "arabic-indic", "5000 digits"]
    ),
    "separator": st.sampled_from(["\n", "\r", "\r\r\n"]),
}


def encode(text: str) -> bytes:
    # Lone surrogates too: a client can send any bytes.
    return text.encode("utf-8", "surrogatepass")


def length_fields(length: str, body: bytes) -> list[str]:
    choices: dict[str, list[object]] = {
        "exact": [len(body)] if body else [],
        "short": [max(len(body) - 1, 0)],
        "long": [len(body) + 1],
        "twice": [len(body), len(body)],
        "huge": [10**30],
        "none": [],
        "superscript": ["\u00b2"],  # isdigit() says True; int() raises
        "arabic-indic": ["\u0661\u0662"],  # int() reads 12
        "5000 digits": ["9" * 5000],  # int() raises past 4300 digits
    }
    return [f"Content-Length: {value}" for value in choices[length]]


@st.composite
def structured_requests(draw: st.DrawFn) -> bytes:
    """A request line, header fields and a body, with at most one part drawn from ``wild``."""
    part = draw(st.sampled_from([None, None, *wild]))
    chosen: dict[str, Any] = {
        name: draw(wild[name] if name == part else strategy) for name, strategy in plausible.items()
    }
    separator: str = chosen["separator"]
    body: bytes = chosen["body"]
    lines = [
        f"{chosen['method']} {chosen['target']} {chosen['version']}",
        *chosen["fields"],
        *length_fields(chosen["length"], body),
    ]
    return encode(separator.join(lines) + separator + separator) + body


#: Two in three structured: a random byte string rarely gets past the request line.
requests = st.one_of(structured_requests(), structured_requests(), st.binary(max_size=256))


# ----- the Content-Length rules ---------------------------------------------------------------


@fuzz(600)
@given(
    headers=st.dictionaries(
        st.sampled_from(["content-length", "transfer-encoding", "host"]) | any_text,
        st.sampled_from(["0", "5", "0005", "1, 1", "1, 2", "\u00b2", "\u0663", "9" * 5000])
        | st.integers(-5, 2 * MAX_BODY_BYTES).map(str)
        | any_text,
        max_size=3,
    )
)
def test_body_length_is_a_number_within_the_limit_or_an_http_error(
    headers: dict[str, str],
) -> None:
    try:
        length = body_length(headers)
    except HttpError as refused:
        assert 400 <= refused.status < 500
        return
    assert 0 <= length <= MAX_BODY_BYTES


# ----- a live server -----------------------------------------------------------------------


@dataclass
class LiveServer:
    port: int
    #: Records with a traceback, or at ERROR and above, since the last ``take_problems``.
    problems: list[logging.LogRecord]

    def take_problems(self) -> list[str]:
        found = [f"{r.name}: {r.getMessage()}" for r in self.problems]
        self.problems.clear()
        return found


class _ProblemHandler(logging.Handler):
    def __init__(self, sink: list[logging.LogRecord]) -> None:
        super().__init__(logging.DEBUG)
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info or record.levelno >= logging.ERROR:
            self.sink.append(record)


@pytest.fixture
def live_server(sqlite_url: str) -> Iterator[LiveServer]:
    """The API on a loopback port, served from its own thread and event loop."""
    problems: list[logging.LogRecord] = []
    handler = _ProblemHandler(problems)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        with serving_in_thread(
            lambda: HttpApi(
                create_store(sqlite_url), load_settings({"db": sqlite_url}, environ={})
            ),
            # A request whose body stops short is answered 400 as its client ends sending, or
            # 408 at this deadline: each example sends all it will at once, so 1 s is plenty.
            read_timeout=1.0,
        ) as server:
            yield LiveServer(server.port, problems)
    finally:
        root.removeHandler(handler)
    # A connection's failure can be logged after its client saw the connection close.
    assert [f"{r.name}: {r.getMessage()}" for r in problems] == [], "no traceback in the log"


def exchange(port: int, data: bytes) -> bytes:
    """Send ``data`` and end the sending side, as a client that has said all it will; the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=15) as client:
        client.sendall(data)
        client.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := client.recv(65536):
            answer += chunk
    return answer


_STATUS_LINE = re.compile(rb"HTTP/1\.1 ([245][0-9][0-9]) [^\r\n]+")
_CONTENT_LENGTH = re.compile(rb"\r\ncontent-length: ([0-9]+)\r\n", re.IGNORECASE)


def assert_one_well_formed_response(answer: bytes, *, to_head: bool = False) -> int:
    """The status of the one final response in ``answer`` (after any 100 Continue).

    ``to_head``: the answer to a HEAD request, which has the length of a GET's body and no
    body; unless the request was refused before its method was read.
    """
    answer = answer.removeprefix(b"HTTP/1.1 100 Continue\r\n\r\n")
    head, separator, body = answer.partition(b"\r\n\r\n")
    assert separator, f"no complete response head: {answer[:200]!r}"
    status_line = _STATUS_LINE.fullmatch(head.split(b"\r\n", 1)[0])
    assert status_line is not None, f"not a 2xx/4xx/5xx status line: {head[:200]!r}"
    length = _CONTENT_LENGTH.search(head + b"\r\n")
    assert length is not None, f"no Content-Length: {answer!r}"
    announced = int(length.group(1))
    assert len(body) in ((0, announced) if to_head else (announced,)), f"body length: {answer!r}"
    assert b"\r\nconnection: close" in head.lower()
    return int(status_line.group(1))


@fuzz(600)
@given(data=requests)
def test_every_request_gets_one_well_formed_answer(live_server: LiveServer, data: bytes) -> None:
    answer = exchange(live_server.port, data)
    if answer or data.strip():  # a client that sent nothing at all is simply gone
        to_head = data.split(b" ", 1)[0] == b"HEAD"
        event(f"status {assert_one_well_formed_response(answer, to_head=to_head)}")
    health = exchange(live_server.port, b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
    assert assert_one_well_formed_response(health) == 200, "the server keeps answering"
    assert live_server.take_problems() == [], "no traceback or error in the log"
