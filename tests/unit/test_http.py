"""The HTTP API's request parser, response encoding and Prometheus rendering, without sockets."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest

from outboxer import ConfigError, load_settings
from outboxer.config import is_loopback, parse_http_address
from outboxer.http import (
    MAX_BODY_BYTES,
    MAX_HEAD_BYTES,
    BadRequest,
    Forbidden,
    HeadersTooLarge,
    HttpApi,
    HttpError,
    HttpServer,
    LengthRequired,
    Metric,
    MisdirectedRequest,
    PayloadTooLarge,
    Request,
    Response,
    UnsupportedMediaType,
    VersionNotSupported,
    _ClientGone,
    body_length,
    check_exposure,
    check_host,
    check_origin,
    check_token,
    encode_response,
    escape_label_value,
    host_name,
    parse_ascii_int,
    parse_head,
    read_request,
    relay_metrics,
    render_metrics,
    require_json,
    store_metrics,
)
from outboxer.relay import RelayStats
from outboxer.stores import DestinationStatus, create_store

# ----- the request parser ------------------------------------------------------------------


def test_parses_request_line_query_and_headers() -> None:
    request = parse_head(
        b"GET /messages?status=FAILED&status=ABANDONED&limit=5 HTTP/1.1\r\n"
        b"Host: x\r\nX-Thing:  a \r\nx-thing: b\r\n\r\n"
    )
    assert (request.method, request.path) == ("GET", "/messages")
    assert request.query == {"status": ["FAILED", "ABANDONED"], "limit": ["5"]}
    assert request.headers == {"host": "x", "x-thing": "a, b"}, "names lower-cased, repeats joined"


def test_path_is_percent_decoded_and_blank_query_values_kept() -> None:
    request = parse_head(b"GET /messages%2Frequeue?limit= HTTP/1.0\r\n\r\n")
    assert request.path == "/messages/requeue"
    assert request.query == {"limit": [""]}


def test_a_target_is_a_path_never_a_network_location() -> None:
    # urlsplit read "//[x" as a network location and raised ValueError (a traceback).
    assert parse_head(b"GET //[x?limit=1 HTTP/1.1\r\n\r\n").path == "//[x"
    assert parse_head(b"GET //evil.example/health HTTP/1.1\r\n\r\n").path == (
        "//evil.example/health"
    )
    assert parse_head(b"GET /health#frag?x=1 HTTP/1.1\r\n\r\n").query == {}


@pytest.mark.parametrize(
    ("text", "number"),
    [
        ("0", 0),
        ("0042", 42),
        ("65535", 65535),
        ("9" * 18, 10**18 - 1),
        ("9" * 5000, 10**18),  # int() raises on over 4300 digits
        ("0" * 5000 + "7", 7),
        ("\u00b2", None),  # superscript two: str.isdigit() says True, int() raises
        ("\u0663", None),  # Arabic-Indic three: int() takes it
        ("\uff11", None),  # fullwidth one
        ("1_000", None),
        ("+1", None),
        ("-1", None),
        (" 1", None),
        ("1\n", None),
        ("", None),
    ],
)
def test_numbers_are_ascii_digits_only(text: str, number: int | None) -> None:
    assert parse_ascii_int(text) == number


@pytest.mark.parametrize(
    ("head", "error", "fragment"),
    [
        (b"GET /health\r\n\r\n", BadRequest, "request line"),
        (b"GET  /health HTTP/1.1\r\n\r\n", BadRequest, "request line"),
        (b"G(T /health HTTP/1.1\r\n\r\n", BadRequest, "method"),
        (b"GET /health HTTP/1\r\n\r\n", BadRequest, "version"),
        (b"GET /health http/1.1\r\n\r\n", BadRequest, "version"),
        (b"GET /health HTTP/2.0\r\n\r\n", VersionNotSupported, "HTTP/2.0"),
        (b"GET http://example/health HTTP/1.1\r\n\r\n", BadRequest, "starting with '/'"),
        (b"GET /health HTTP/1.1\r\nNo colon here\r\n\r\n", BadRequest, "header line"),
        (b"GET /health HTTP/1.1\r\nBad Name: x\r\n\r\n", BadRequest, "header line"),
        (b"GET /health HTTP/1.1\r\nA: 1\r\n  folded\r\n\r\n", BadRequest, "folded"),
        (
            b"GET /health HTTP/1.1\r\n" + b"A: 1\r\n" * 101 + b"\r\n",
            HeadersTooLarge,
            "header fields",
        ),
        (b"\r\n\r\n", BadRequest, "empty"),
        # "$" in a pattern also matches before a final newline; these must not pass.
        (b"GET /health HTTP/1.1\n\r\n\r\n", BadRequest, "version"),
        (b"GET\n /health HTTP/1.1\r\n\r\n", BadRequest, "method"),
        (b"GET /health HTTP/1.1\r\nHost\n: x\r\n\r\n", BadRequest, "header line"),
        (b"GET /health HTTP/\xb9.1\r\n\r\n", BadRequest, "version"),  # superscript one
        (b"GET /health HTTP/1.1\r\nX: a\x00b\r\n\r\n", BadRequest, "header line"),
        (b"GET /health HTTP/1.1\r\nX: a\nb\r\n\r\n", BadRequest, "header line"),
        (b"GET /he\x00alth HTTP/1.1\r\n\r\n", BadRequest, "starting with '/'"),
    ],
)
def test_malformed_heads_are_refused(head: bytes, error: type[HttpError], fragment: str) -> None:
    with pytest.raises(error, match=fragment.replace("(", r"\(")) as raised:
        parse_head(head)
    assert raised.value.status in (400, 431, 505)


@pytest.mark.parametrize(
    ("headers", "length"),
    [
        ({}, 0),
        ({"content-length": "12"}, 12),
        ({"content-length": "5, 5"}, 5),
        ({"content-length": str(MAX_BODY_BYTES)}, MAX_BODY_BYTES),
    ],
)
def test_body_length(headers: dict[str, str], length: int) -> None:
    assert body_length(headers) == length


@pytest.mark.parametrize(
    ("headers", "error"),
    [
        ({"content-length": "5, 6"}, BadRequest),
        ({"content-length": "-1"}, BadRequest),
        ({"content-length": "ten"}, BadRequest),
        ({"content-length": "\u00b2"}, BadRequest),  # was int("²"): ValueError, a traceback
        ({"content-length": "\u0661\u0662"}, BadRequest),  # was 12
        ({"content-length": "1_2"}, BadRequest),
        ({"content-length": "+12"}, BadRequest),
        ({"content-length": "9" * 5000}, PayloadTooLarge),  # was int(): ValueError
        ({"content-length": str(MAX_BODY_BYTES + 1)}, PayloadTooLarge),
        ({"transfer-encoding": "chunked"}, LengthRequired),
    ],
)
def test_bodies_that_cannot_or_must_not_be_read(
    headers: dict[str, str], error: type[HttpError]
) -> None:
    with pytest.raises(error):
        body_length(headers)


def _reader(data: bytes, *, eof: bool = True) -> asyncio.StreamReader:
    reader = asyncio.StreamReader(limit=MAX_HEAD_BYTES)
    reader.feed_data(data)
    if eof:
        reader.feed_eof()
    return reader


async def test_reads_a_request_with_its_body_and_no_further() -> None:
    reader = _reader(
        b"POST /messages/requeue HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}trailing", eof=False
    )
    request = await read_request(reader)
    assert (request.method, request.body) == ("POST", b"{}")


async def test_read_request_refusals() -> None:
    with pytest.raises(_ClientGone):
        await read_request(_reader(b""))
    with pytest.raises(BadRequest, match="inside the request headers"):
        await read_request(_reader(b"GET /health HTTP/1.1\r\nHost"))
    with pytest.raises(BadRequest, match="Content-Length of 10"):
        await read_request(_reader(b"POST /x HTTP/1.1\r\nContent-Length: 10\r\n\r\nshort"))
    with pytest.raises(HeadersTooLarge):
        await read_request(_reader(b"GET /" + b"a" * MAX_HEAD_BYTES + b" HTTP/1.1\r\n\r\n"))


def test_response_encoding_closes_the_connection() -> None:
    raw = encode_response(Response(405, b'{"x": 1}', headers={"Allow": "POST"}))
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert lines[0] == "HTTP/1.1 405 Method Not Allowed"
    assert {
        "Content-Type: application/json",
        "Content-Length: 8",
        "Connection: close",
        "Allow: POST",
    } <= set(lines)
    assert body == b'{"x": 1}'


# ----- requests from browsers --------------------------------------------------------------


def _request(method: str = "GET", **headers: str) -> Request:
    return Request(method, "/messages/requeue", headers=headers)


@pytest.mark.parametrize(
    ("host", "name"),
    [
        ("localhost", "localhost"),
        ("localhost:9100", "localhost"),
        ("127.0.0.1:80", "127.0.0.1"),
        ("[::1]:9100", "::1"),
        ("[::1]", "::1"),
        ("evil.example:9100", "evil.example"),
        ("localhost:", None),
        ("localhost:\u00b9", None),
        ("localhost:65536", None),
        ("localhost:80:80", None),
        ("[::1", None),
        ("[::1]x", None),
        ("::1", None),
        (":9100", None),
        ("", None),
    ],
)
def test_host_names(host: str, name: str | None) -> None:
    assert host_name(host) == name


@pytest.mark.parametrize(
    "host", ["localhost", "LOCALHOST:1", "127.0.0.1:9100", "127.3.2.1", "[::1]:9100"]
)
def test_loopback_hosts_are_answered_on_loopback(host: str) -> None:
    check_host(_request(host=host), "127.0.0.1")


@pytest.mark.parametrize(
    "host", ["evil.example", "evil.example:9100", "10.0.0.1:9100", "localhost.:9100", "x:y", ""]
)
def test_other_hosts_are_misdirected_on_loopback(host: str) -> None:
    with pytest.raises(MisdirectedRequest, match="answers requests for localhost"):
        check_host(_request(host=host), "127.0.0.1")


def test_host_rules_apply_on_loopback_only() -> None:
    check_host(_request(), "127.0.0.1")  # no Host: HTTP/1.0 clients, not browsers
    check_host(_request(host="relay.internal:9100"), "0.0.0.0")  # the token guards it
    check_host(_request(host="relay.internal:9100"), "10.1.2.3")
    check_host(_request(host="MyBox:9100"), "mybox")  # bound by a name


@pytest.mark.parametrize(
    ("origin", "host"),
    [
        ("http://127.0.0.1:9100", "127.0.0.1:9100"),
        ("http://localhost:9100", "LocalHost:9100"),
        ("https://relay.internal", "relay.internal"),  # behind a TLS proxy
        ("http://[::1]:9100", "[::1]:9100"),
    ],
)
def test_the_apis_own_origin_is_accepted(origin: str, host: str) -> None:
    check_origin(_request(origin=origin, host=host), "127.0.0.1:9100")
    check_origin(_request(), "127.0.0.1:9100")  # no Origin: curl, scrapers, probes


@pytest.mark.parametrize(
    "origin",
    [
        "http://evil.example",
        "http://127.0.0.1:9101",  # another port is another origin
        "null",  # sandboxed frames, file:// pages
        "file://",
        "http://127.0.0.1:9100/path",
        "http://user@127.0.0.1:9100",
        "http://127.0.0.1:9100, http://evil.example",  # two Origin fields
        "",
    ],
)
def test_a_foreign_origin_is_forbidden(origin: str) -> None:
    with pytest.raises(Forbidden, match="cross-origin request refused"):
        check_origin(_request(origin=origin, host="127.0.0.1:9100"), "127.0.0.1:9100")


def test_without_a_host_the_origin_is_compared_with_the_bound_address() -> None:
    check_origin(_request(origin="http://127.0.0.1:9100"), "127.0.0.1:9100")
    with pytest.raises(Forbidden):
        check_origin(_request(origin="http://localhost:9100"), "127.0.0.1:9100")


@pytest.mark.parametrize(
    "content_type", ["application/json", "Application/JSON", "application/json; charset=utf-8"]
)
def test_json_bodies_are_accepted(content_type: str) -> None:
    require_json(_request("POST", **{"content-type": content_type}))


@pytest.mark.parametrize(
    "content_type",
    [
        None,
        "text/plain",  # what a cross-site <form enctype="text/plain"> sends
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/jsonp",
        "application/json-patch+json",
    ],
)
def test_other_bodies_are_an_unsupported_media_type(content_type: str | None) -> None:
    headers = {} if content_type is None else {"content-type": content_type}
    with pytest.raises(UnsupportedMediaType, match="Content-Type: application/json") as raised:
        require_json(_request("POST", **headers))
    assert raised.value.status == 415 and raised.value.headers == {"Accept": "application/json"}


@pytest.mark.parametrize(
    ("token", "fragment"),
    [
        ("", "empty"),
        ("   ", "empty"),
        ("t0ken", "has 5 characters; use at least 16"),
        ("x" * 15, "has 15 characters"),
        (" " + "x" * 20, "starts or ends with a space"),
        ("x" * 20 + "\n", "control character"),
        ("x" * 10 + "\x00" + "x" * 10, "control character"),
    ],
)
def test_tokens_that_are_refused(token: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        check_token(token)


def test_library_users_get_the_same_token_and_exposure_rules(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'outbox.db'}"
    settings = load_settings({"db": url}, environ={})
    with pytest.raises(ConfigError, match="at least 16"):
        HttpApi(create_store(url), settings, token="short-token")
    with pytest.raises(ConfigError, match="empty"):
        HttpApi(create_store(url), settings, token="")
    check_token(None)
    open_api = HttpApi(create_store(url), settings)
    with pytest.raises(ConfigError, match="set --http-token to expose requeue"):
        HttpServer(open_api, "0.0.0.0", 0)
    HttpServer(HttpApi(create_store(url), settings, token="x" * 16), "0.0.0.0", 0)
    HttpServer(open_api, "127.0.0.1", 0)


# ----- Prometheus rendering ----------------------------------------------------------------


def test_help_type_and_samples() -> None:
    text = render_metrics(
        [
            Metric("outboxer_things_total", "counter", "Things.", [({}, 3)]),
            Metric(
                "outboxer_messages",
                "gauge",
                "Rows.",
                [({"destination": "a", "status": "PENDING"}, 2)],
            ),
        ]
    )
    assert text == (
        "# HELP outboxer_things_total Things.\n"
        "# TYPE outboxer_things_total counter\n"
        "outboxer_things_total 3\n"
        "# HELP outboxer_messages Rows.\n"
        "# TYPE outboxer_messages gauge\n"
        'outboxer_messages{destination="a",status="PENDING"} 2\n'
    )


def test_label_values_and_help_are_escaped() -> None:
    awkward = 'a\\b"c\nd'
    assert escape_label_value(awkward) == 'a\\\\b\\"c\\nd'
    text = render_metrics(
        [Metric("m", "gauge", 'line one\nback\\slash "quoted"', [({"d": awkward}, 1)])]
    )
    assert text.splitlines() == [
        '# HELP m line one\\nback\\\\slash "quoted"',  # HELP escapes backslash and newline only
        "# TYPE m gauge",
        'm{d="a\\\\b\\"c\\nd"} 1',
    ]


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (7, "7"),
        (0.25, "0.25"),
        (1e-7, "1e-07"),
        (math.nan, "NaN"),
        (math.inf, "+Inf"),
        (-math.inf, "-Inf"),
    ],
)
def test_values(value: float, text: str) -> None:
    assert (
        render_metrics([Metric("m", "gauge", "h", [({}, value)])]).splitlines()[-1] == f"m {text}"
    )


@pytest.mark.parametrize(
    "metric",
    [
        Metric("bad-name", "gauge", "h", []),
        Metric("m", "histogram", "h", []),
        Metric("m", "gauge", "h", [({"bad-label": "x"}, 1)]),
        Metric("m", "gauge", "h", [({"__reserved": "x"}, 1)]),
    ],
)
def test_invalid_names_are_programming_errors(metric: Metric) -> None:
    with pytest.raises(ValueError, match="invalid"):
        render_metrics([metric])


def test_relay_counters_and_uptime() -> None:
    stats = RelayStats(
        published=5, failed=2, abandoned_now=1, batches=3, claim_seconds=0.5, started_at=100.0
    )
    metrics = {m.name: m for m in relay_metrics(stats, healthy=True, now=160.0)}
    counters = [m for m in metrics.values() if m.kind == "counter"]
    assert counters and all(m.name.endswith("_total") for m in counters)
    assert metrics["outboxer_messages_published_total"].samples == [({}, 5)]
    assert metrics["outboxer_messages_failed_total"].samples == [({}, 2)]
    assert metrics["outboxer_messages_abandoned_total"].samples == [({}, 1)]
    assert metrics["outboxer_batches_total"].samples == [({}, 3)]
    assert metrics["outboxer_claim_seconds_total"].samples == [({}, 0.5)]
    assert metrics["outboxer_relay_uptime_seconds"].samples == [({}, 60.0)]
    assert metrics["outboxer_relay_healthy"].samples == [({}, 1)]
    render_metrics(metrics.values())  # every name is valid


def test_relay_counters_per_destination() -> None:
    totals = RelayStats(published=5, store_errors=2, cleaned=4)
    per = {
        "webhooks": RelayStats(published=2),
        "default": RelayStats(published=3, broker_reconnects=1),
    }
    metrics = {m.name: m for m in relay_metrics(totals, healthy=False, now=0.0, destinations=per)}
    assert metrics["outboxer_messages_published_total"].samples == [
        ({"destination": "default"}, 3),
        ({"destination": "webhooks"}, 2),
    ]
    assert metrics["outboxer_broker_connects_total"].samples == [
        ({"destination": "default"}, 1),
        ({"destination": "webhooks"}, 0),
    ]
    # What no destination owns stays one series.
    assert metrics["outboxer_store_errors_total"].samples == [({}, 2)]
    assert metrics["outboxer_messages_cleaned_total"].samples == [({}, 4)]
    assert 'outboxer_messages_published_total{destination="webhooks"} 2\n' in render_metrics(
        metrics.values()
    )


def test_store_gauges_list_every_status_and_say_when_the_query_failed() -> None:
    entry = DestinationStatus("partner", {"PENDING": 4, "ABANDONED": 1}, oldest_pending_age=12.5)
    text = render_metrics(store_metrics([entry, DestinationStatus("idle", {"PUBLISHED": 3})]))
    assert "outboxer_store_up 1" in text
    assert 'outboxer_messages{destination="partner",status="PENDING"} 4' in text
    assert 'outboxer_messages{destination="partner",status="FAILED"} 0' in text
    assert 'outboxer_oldest_pending_age_seconds{destination="partner"} 12.5' in text
    assert 'outboxer_oldest_pending_age_seconds{destination="idle"} 0.0' in text
    assert render_metrics(store_metrics(None)).splitlines()[-1] == "outboxer_store_up 0"


# ----- settings ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "address"),
    [
        ("127.0.0.1:8080", ("127.0.0.1", 8080)),
        ("[::1]:9000", ("::1", 9000)),
        ("localhost:0", ("localhost", 0)),
        (" 0.0.0.0:80 ", ("0.0.0.0", 80)),
    ],
)
def test_http_addresses(value: str, address: tuple[str, int]) -> None:
    assert parse_http_address(value, "--http") == address


@pytest.mark.parametrize(
    "value", ["8080", "host:", ":8080", "host:65536", "::1:80", "host:http", "[::1]"]
)
def test_bad_http_addresses(value: str) -> None:
    with pytest.raises(ConfigError, match="--http"):
        parse_http_address(value, "--http")


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.8.0.1", True),
        ("::1", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.1", False),
        ("relay.internal", False),
    ],
)
def test_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_http_settings_from_flags_environment_and_file(tmp_path: Path) -> None:
    config = tmp_path / "outboxer.toml"
    config.write_text('http = "127.0.0.1:9100"\nhttp_token = "from-file-0123456789"\n')
    from_file = load_settings({}, config_file=config, environ={})
    assert (from_file.http, from_file.http_token) == ("127.0.0.1:9100", "from-file-0123456789")
    from_env = load_settings({}, config_file=config, environ={"OUTBOXER_HTTP": "0.0.0.0:9200"})
    assert from_env.http == "0.0.0.0:9200"
    assert "from-file" not in repr(from_env), "the token stays out of reprs (and so out of logs)"
    with pytest.raises(ConfigError, match="--http must be HOST:PORT"):
        load_settings({"http": "9100"}, environ={})
    with pytest.raises(ConfigError, match="--http-token"):
        load_settings({"http_token": " "}, environ={})


def test_requeue_without_token_only_on_loopback() -> None:
    check_exposure("127.0.0.1", None)
    check_exposure("0.0.0.0", "secret")
    with pytest.raises(
        ConfigError, match="set --http-token to expose requeue on a non-loopback address"
    ):
        check_exposure("0.0.0.0", None)
