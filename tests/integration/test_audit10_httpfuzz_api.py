"""Property-based fuzzing of the HTTP API, in process (httpx over ASGI) against real stores.

Every route and method (also the ones a route refuses) gets hostile query strings, bodies,
content types, Authorization and Host headers. No answer may be a 5xx, every 4xx is the
API's JSON error that echoes no secret, and every answer comes within a bounded time.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from outboxer import load_settings
from outboxer.admin import FILTER_FIELDS
from outboxer.http import AsgiApp, HttpApi, api_stores
from outboxer.stores import create_store
from tests.integration.test_http_api import enqueue

TOKEN = "fuzz-token-0123456789-SECRET"
#: A password in the database URL (PostgreSQL trusts local clients and ignores it): an
#: error answer that quotes the URL would show it.
DB_PASSWORD = "pw-fuzz-SECRET-42"
SECRETS = (TOKEN, DB_PASSWORD)
#: Seconds any one answer may take (the database is local and the tables tiny).
MAX_SECONDS = 5.0

ROUTES = (
    "/",
    "/dashboard.js",
    "/dashboard.css",
    "/dashboard/series",
    "/health",
    "/metrics",
    "/status",
    "/messages",
    "/messages/requeue",
    "/messages/purge",
    "/messages/replay",
)
METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS", "TRACE", "FOO")
FIELDS = (*sorted(FILTER_FIELDS), "dry_run", "all", "to", "database")
#: Every fuzz test: the same examples on every run (CI), no time limit per example, no
#: example database, and none of the health checks a slow shared box trips.
FUZZ: dict[str, Any] = {
    "deadline": None,
    "derandomize": True,
    "database": None,
    "suppress_health_check": [
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,
    ],
}
HOSTILE_TEXT = (
    "",
    " ",
    "\x00",
    "k\x00",
    "\ud800",
    "a\udfffb",
    "é",
    "😀",
    "x" * 70_000,
    "1e309",
    "NaN",
    "-1",
    "99999999999999999999999999",
    "P1D",
    "1 day",
    "2024-13-45T99:99:99",
    "0001-01-01T00:00:00",
    "9999-12-31T23:59:59+14:00",
    "abandoned",
    "PROCESSING",
    "default",
    "db0",
    "db1",
    "00000000-0000-0000-0000-000000000000",
    "not-a-uuid",
    "%ff",
    "${jndi:x}",
    "' OR 1=1 --",
)
QUERY_PIECES = (
    "",
    "%ff",
    "%00",
    "%ed%a0%80",
    "%",
    "%zz",
    "-1",
    "0",
    "1",
    "1000",
    "1001",
    "1.5",
    "NaN",
    "inf",
    "1e9",
    "9" * 5000,
    "abandoned",
    "ABANDONED,PENDING",
    "published,,",
    "x" * 3000,
    "default",
    "%C2%B2",
    "+",
    "&",
    "=",
)

text = st.one_of(st.sampled_from(HOSTILE_TEXT), st.text(max_size=20))
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True),
    text,
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4),
    max_leaves=12,
)
field_values = st.one_of(json_values, st.lists(text, min_size=1, max_size=3))
#: Values close to what each field takes, so that most bodies get past the field checks
#: and reach the filters, the stores and the databases.
plausible = {
    "ids": st.lists(st.one_of(st.uuids().map(str), text), min_size=1, max_size=3),
    "destinations": st.lists(st.sampled_from(("default", "\ud800", "x\x00", "")), min_size=1),
    "topics": st.lists(st.one_of(st.just("order.placed"), text), min_size=1, max_size=3),
    "keys": st.lists(st.one_of(st.sampled_from(("k0", "k1")), text), min_size=1, max_size=3),
    "statuses": st.lists(
        st.sampled_from(("abandoned", "FAILED", "pending", "PUBLISHED", " failed ", "\x00")),
        min_size=1,
        max_size=3,
    ),
    "older_than": st.one_of(
        st.integers(min_value=-(10**30), max_value=10**30),
        st.floats(),
        st.sampled_from(("1h", "90s", "2d", "-1s", "1e309s", "99999999999999d", "", "h")),
    ),
    "created_after": st.one_of(
        st.datetimes().map(lambda moment: moment.isoformat()), text, st.integers()
    ),
    "created_before": st.one_of(
        st.datetimes(timezones=st.timezones()).map(lambda moment: moment.isoformat()), text
    ),
    "error": st.one_of(text, st.integers(), st.lists(text, max_size=2)),
    "dry_run": st.one_of(st.booleans(), scalars),
    "all": st.one_of(st.booleans(), scalars),
    "to": st.one_of(st.just("default"), text, st.integers()),
    "database": st.one_of(st.sampled_from(("db0", "db1", "default")), text, st.integers()),
}
admin_bodies = st.one_of(
    st.fixed_dictionaries(
        {}, optional={name: st.one_of(values, field_values) for name, values in plausible.items()}
    ),
    st.dictionaries(st.one_of(st.sampled_from(FIELDS), text), field_values, max_size=5),
)


def _dump(value: object) -> bytes:
    # allow_nan: NaN and Infinity are what a careless client sends; the API must refuse them.
    return json.dumps(value, allow_nan=True).encode("utf-8", "surrogatepass")


bodies = st.one_of(
    st.just(b""),
    admin_bodies.map(_dump),
    json_values.map(_dump),
    st.binary(max_size=64),
    st.sampled_from(
        (
            b"{",
            b"[" * 5000 + b"]" * 5000,
            b'{"a":' * 3000 + b"1" + b"}" * 3000,
            b"\xff\xfe\x00",
            b'{"keys": ["\xff"]}',
            b'{"keys": ["\\ud800"]}',
            b'{"keys": ["\\u0000"]}',
            b'{"ids": ["not-a-uuid"]}',
            b'{"older_than": 1e400}',
            b'{"older_than": -1}',
            b'{"older_than": NaN}',
            b'{"statuses": ["abandoned"], "dry_run": true}',
            b'{"all": true, "dry_run": true}',
            b'{"keys": ["k1"], "to": 7}',
            b'{"keys": ["k1"], "error": 7}',
            b'{"keys": ["k1"], "database": ["x"]}',
            b"x" * 70_000,
            # Lists as long as 64 KiB allows: one bound parameter each would pass SQLite's
            # and the drivers' limits.
            b'{"keys":[' + b",".join([b'"k"'] * 15_000) + b'],"dry_run":true}',
            b'{"statuses":[' + b",".join([b'"failed"'] * 6_000) + b'],"dry_run":true}',
            b'{"ids":[' + b",".join([b'"00000000-0000-0000-0000-000000000000"'] * 1_500) + b"]}",
            b'{"error":"' + b"%_" * 30_000 + b'","dry_run":true}',
        )
    ),
)
content_types = st.sampled_from(
    (
        None,
        b"application/json",
        b"application/json; charset=utf-8",
        b"APPLICATION/JSON",
        b"text/plain",
        b"application/x-www-form-urlencoded",
        b"",
        b"application/json\x7f",
        b"\xff\xfe",
    )
)
authorizations = st.sampled_from(
    (
        None,
        f"Bearer {TOKEN}".encode(),
        f"bearer   {TOKEN}  ".encode(),
        b"Bearer wrong",
        b"Bearer",
        b"Basic dXNlcjpwYXNz",
        f"Bearer {TOKEN}x".encode(),
        b"Bearer " + b"A" * 10_000,
        b"Bearer \xff\xfe\x80",
        b"",
    )
)
hosts = st.sampled_from(
    (
        b"127.0.0.1",
        b"localhost:8080",
        b"[::1]:1",
        b"[::1]:99999",
        b"evil.example",
        b"127.0.0.1:",
        b"127.0.0.1:\xff",
        b"[",
        b"h" * 5000,
        b"LOCALHOST",
    )
)
accepts = st.sampled_from(
    (
        b"application/openmetrics-text; version=1.0.0; escaping=bogus",
        b"application/openmetrics-text; version=9",
        b"application/openmetrics-text; version=abc",
        b'text/plain; version="1.0.0"',
        b"application/openmetrics-text; version=1.0.0-rc1; escaping=values",
        b"text/plain; version=0.0.4; escaping=allow-utf-8",
        b"application/openmetrics-text;;;=",
        b"*/*;q=NaN",
        b"\xff\xfe",
        b"text/html, " * 500,
    )
)
query_names = st.one_of(
    st.sampled_from(("status", "limit", "database")),
    st.sampled_from(("status", "limit", "database", "x", "%ff", "db0", "db1")),
    text,
)


@st.composite
def query_strings(draw: st.DrawFn) -> str:
    pairs = draw(st.lists(st.tuples(query_names, st.one_of(text, st.none())), max_size=4))
    parts = []
    for name, value in pairs:
        encoded = urllib.parse.quote(name.encode("utf-8", "surrogatepass"), safe="")
        if value is None:
            value_part = draw(st.sampled_from(QUERY_PIECES))
        else:
            value_part = urllib.parse.quote(value.encode("utf-8", "surrogatepass"), safe="")
        # httpx refuses URLs over 64 KiB; a cut escape ("%f") is hostile input too.
        parts.append(f"{encoded[:8000]}={value_part[:8000]}")
    parts += draw(st.lists(st.sampled_from(QUERY_PIECES), max_size=2))
    if draw(st.integers(0, 9)) == 0:  # more fields than the API parses
        parts += ["status=failed"] * 60
    return "&".join(parts)


@st.composite
def requests(draw: st.DrawFn, paths: st.SearchStrategy[str] | None = None) -> dict[str, Any]:
    # Mostly a Host and no Origin the API answers, so that most requests reach the routes.
    host = draw(hosts) if draw(st.integers(0, 3)) == 0 else b"127.0.0.1"
    headers: list[tuple[bytes, bytes]] = [(b"host", host)]
    content_type = draw(content_types) if draw(st.booleans()) else b"application/json"
    if content_type is not None:
        headers.append((b"content-type", content_type))
    authorization = draw(authorizations) if draw(st.booleans()) else f"Bearer {TOKEN}".encode()
    if authorization is not None:
        headers.append((b"authorization", authorization))
    if draw(st.booleans()):
        headers.append((b"accept", draw(accepts)))
    if draw(st.integers(0, 5)) == 0:
        headers.append((b"origin", draw(st.sampled_from((b"null", b"http://evil", b"\xff")))))
    every_path = st.sampled_from((*ROUTES, "/nope", "/%ff", "/messages/", "/HEALTH"))
    path = draw(every_path if paths is None else paths)
    allowed = "POST" if path.startswith("/messages/") else "GET"
    return {
        "method": draw(st.sampled_from((allowed, *METHODS))),
        "path": path,
        "query": draw(query_strings()),
        "headers": headers,
        "body": draw(bodies),
    }


@pytest.fixture(params=["postgres", "mysql", "sqlite", "postgres+sqlite"])
def fuzz_api(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[HttpApi, list[str]]:
    """The API of one real database, or of two (answers in a section per database)."""
    urls = []
    for kind in str(request.param).split("+"):
        url = str(request.getfixturevalue(f"{'pg' if kind == 'postgres' else kind}_url"))
        urls.append(url.replace("postgres@", f"postgres:{DB_PASSWORD}@", 1))
    for url in urls:
        enqueue(url, 3)
    if len(urls) == 1:
        settings = load_settings({"db": urls[0]}, environ={})
        return HttpApi(create_store(urls[0]), settings, token=TOKEN), urls
    config = tmp_path / "outboxer.toml"
    config.write_text("".join(f'[databases.db{n}]\nurl = "{url}"\n' for n, url in enumerate(urls)))
    settings = load_settings({}, config_file=config, environ={})
    return HttpApi(api_stores(settings), settings, token=TOKEN), urls


@pytest.fixture
def fuzz_client(
    fuzz_api: tuple[HttpApi, list[str]],
) -> Iterator[tuple[asyncio.AbstractEventLoop, httpx.AsyncClient]]:
    api, _ = fuzz_api
    loop = asyncio.new_event_loop()
    app = AsgiApp(api, "127.0.0.1", read_timeout=5.0)
    client = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1", timeout=30
    )
    try:
        yield loop, client
    finally:
        loop.run_until_complete(client.aclose())
        loop.run_until_complete(api.close())
        loop.close()


def check_answer(request: dict[str, Any], response: httpx.Response, seconds: float) -> None:
    """The properties every answer has, whatever was asked."""
    shown = {**request, "body": request["body"][:200]}
    assert response.status_code < 500, (shown, response.status_code, response.text[:2000])
    assert seconds < MAX_SECONDS, (shown, seconds)
    for secret in SECRETS:
        assert secret not in response.text, (shown, response.text[:2000])
    if 400 <= response.status_code < 500 and request["method"] != "HEAD":  # HEAD: no body
        assert response.headers["content-type"].startswith("application/json"), shown
        payload = response.json()
        assert isinstance(payload["error"], str) and payload["error"], (shown, payload)
        assert isinstance(payload["type"], str), (shown, payload)
    if response.status_code == 405:
        assert response.headers.get("allow"), shown


def send(
    loop: asyncio.AbstractEventLoop, client: httpx.AsyncClient, request: dict[str, Any]
) -> tuple[httpx.Response, float]:
    url = request["path"] + ("?" + request["query"] if request["query"] else "")
    started = time.perf_counter()
    response = loop.run_until_complete(
        client.request(request["method"], url, headers=request["headers"], content=request["body"])
    )
    return response, time.perf_counter() - started


@settings(max_examples=300, **FUZZ)
@given(request=requests())
def test_no_request_gets_a_server_error(
    fuzz_client: tuple[asyncio.AbstractEventLoop, httpx.AsyncClient], request: dict[str, Any]
) -> None:
    loop, client = fuzz_client
    response, seconds = send(loop, client, request)
    check_answer(request, response, seconds)


@settings(max_examples=300, **FUZZ)
@given(
    path=st.sampled_from(("/messages/requeue", "/messages/purge", "/messages/replay")),
    body=admin_bodies,
)
def test_admin_bodies_with_the_token_get_no_server_error(
    fuzz_client: tuple[asyncio.AbstractEventLoop, httpx.AsyncClient],
    path: str,
    body: dict[str, Any],
) -> None:
    """The admin endpoints, authorized and as JSON, so every body reaches the handlers."""
    loop, client = fuzz_client
    request = {
        "method": "POST",
        "path": path,
        "query": "",
        "headers": [
            (b"host", b"127.0.0.1"),
            (b"content-type", b"application/json"),
            (b"authorization", f"Bearer {TOKEN}".encode()),
        ],
        "body": _dump({**body, "dry_run": True} if "dry_run" not in body else body),
    }
    response, seconds = send(loop, client, request)
    check_answer(request, response, seconds)


@pytest.mark.parametrize("path", ROUTES)
@settings(max_examples=40, **FUZZ)
@given(data=st.data())
def test_each_route_gets_no_server_error(
    fuzz_client: tuple[asyncio.AbstractEventLoop, httpx.AsyncClient],
    path: str,
    data: st.DataObject,
) -> None:
    """Every route its own budget of examples, whatever the draw favours."""
    loop, client = fuzz_client
    request = data.draw(requests(st.just(path)))
    response, seconds = send(loop, client, request)
    check_answer(request, response, seconds)
