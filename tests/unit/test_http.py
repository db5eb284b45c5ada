"""The HTTP API's request checks, token and exposure rules, without sockets.

uvicorn (h11) parses requests; tests/integration/test_http_api.py and
tests/chaos/test_fuzz_http.py send it raw bytes through the real server."""

from __future__ import annotations

from pathlib import Path

import pytest

from outboxer import ConfigError, load_settings
from outboxer.config import is_loopback, parse_http_address
from outboxer.http import (
    MAX_BODY_BYTES,
    BadRequest,
    Forbidden,
    HttpApi,
    HttpError,
    HttpServer,
    LengthRequired,
    MisdirectedRequest,
    PayloadTooLarge,
    Request,
    UnsupportedMediaType,
    body_length,
    check_exposure,
    check_host,
    check_origin,
    check_token,
    host_name,
    parse_ascii_int,
    require_json,
)
from outboxer.stores import create_store

# ----- request checks ----------------------------------------------------------------------


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


def test_allowed_hosts_guard_a_non_loopback_address_against_dns_rebinding() -> None:
    allowed = ("relay.internal", ".svc.cluster.local")
    for host in (
        "relay.internal:9100",
        "RELAY.internal",
        "outboxer.ns.svc.cluster.local:9100",
        "svc.cluster.local",
        "10.1.2.3:9100",  # an address: a page cannot make a browser send one but its own
        "[fd00::5]:9100",
        "localhost:9100",
    ):
        check_host(_request(host=host), "0.0.0.0", allowed)
    for host in ("evil.example:9100", "relay.internal.evil.example", "xsvc.cluster.local"):
        with pytest.raises(MisdirectedRequest, match="--http-allowed-hosts"):
            check_host(_request(host=host), "0.0.0.0", allowed)
    check_host(_request(), "0.0.0.0", allowed)  # no Host: HTTP/1.0 clients, not browsers


def test_allowed_hosts_add_names_on_loopback_but_no_other_address() -> None:
    check_host(_request(host="relay.internal:9100"), "127.0.0.1", ("relay.internal",))
    for host in ("10.0.0.1:9100", "evil.example"):
        with pytest.raises(MisdirectedRequest, match="answers requests for localhost"):
            check_host(_request(host=host), "127.0.0.1", ("relay.internal",))


@pytest.mark.parametrize(
    "value", ["evil example", "a..b", "-x.example", "x_y.example", "é.example"]
)
def test_an_allowed_host_that_is_no_host_name_is_refused(value: str) -> None:
    with pytest.raises(ConfigError, match="is no host name"):
        load_settings({"http_allowed_hosts": value}, environ={})


def test_allowed_hosts_are_read_lower_cased_from_the_environment() -> None:
    settings = load_settings(
        {}, environ={"OUTBOXER_HTTP_ALLOWED_HOSTS": "Relay.Internal.,.svc.local"}
    )
    assert settings.http_allowed_hosts == ("relay.internal", ".svc.local")
