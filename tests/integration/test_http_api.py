"""The HTTP API over real HTTP, against the real PostgreSQL, SQLite and MariaDB stores."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import sqlite3
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import outboxer
from outboxer import Relay, load_settings
from outboxer.brokers.memory import MemoryBroker, memory_broker
from outboxer.cli import main as cli_main
from outboxer.http import HttpApi, HttpServer
from outboxer.stores import Failure, Store, create_store
from outboxer.stores.sqlite import sqlite_path
from outboxer.testing import eventually
from tests.conftest import mysql_connect

TOKEN = "s3cret-token-0123456789"


@pytest.fixture(params=["sqlite", "postgres", "mysql"])
def db_url(request: pytest.FixtureRequest) -> str:
    fixture = {"sqlite": "sqlite_url", "postgres": "pg_url", "mysql": "mysql_url"}[request.param]
    return str(request.getfixturevalue(fixture))


@pytest.fixture(params=["sqlite", "postgres"])
def relay_db_url(request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue(f"{'pg' if request.param == 'postgres' else 'sqlite'}_url"))


def connect_sync(url: str) -> Any:
    if url.startswith("sqlite"):
        return sqlite3.connect(sqlite_path(url))
    if url.startswith("mysql"):
        return mysql_connect(url)
    import psycopg

    return psycopg.connect(url)


def enqueue(url: str, count: int) -> list[outboxer.Message]:
    conn = connect_sync(url)
    try:
        sent = [outboxer.enqueue(conn, "order.placed", {"n": n}, key=f"k{n}") for n in range(count)]
        conn.commit()
    finally:
        conn.close()
    return sent


async def abandon(store: Store, count: int) -> None:
    """Claim ``count`` pending messages and record a permanent failure for each (ABANDONED)."""
    claimed = await store.claim("default", "relay-test", count, 60.0, False)
    await store.settle(
        "default",
        claimed.lease,
        [],
        [Failure(m.stored_seq, "rejected", 0.0, True) for m in claimed],
        [],
        10,
    )


async def statuses(store: Store) -> dict[str, int]:
    report = await store.status()
    return dict(report[0].counts) if report else {}


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextlib.asynccontextmanager
async def serving(
    url: str, relay: Relay | None = None, **options: Any
) -> AsyncIterator[httpx.AsyncClient]:
    """The API on a free loopback port, and a client for it (``client.server`` is the server)."""
    server_options = {
        k: options.pop(k) for k in ("read_timeout", "max_connections") if k in options
    }
    api = HttpApi(create_store(url), load_settings({"db": url}, environ={}), relay, **options)
    server = await HttpServer(api, "127.0.0.1", 0, **server_options).start()
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=20) as client:
            client.server = server  # type: ignore[attr-defined]
            yield client
    finally:
        await server.close()


def samples(text: str) -> dict[str, float]:
    """Sample lines of a Prometheus exposition: 'name{labels}' -> value."""
    result = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            result[name] = float(value)
    return result


@contextlib.asynccontextmanager
async def running(relay: Relay) -> AsyncIterator[asyncio.Task[Any]]:
    task = asyncio.create_task(relay.run())
    try:
        yield task
    finally:
        relay.stop()
        await asyncio.wait_for(task, 30)


def make_relay(url: str, broker_url: str) -> Relay:
    return Relay.from_settings(
        load_settings(
            {"db": url, "broker": broker_url, "poll_interval": 0.05, "concurrency": 2}, environ={}
        )
    )


@pytest.fixture
def broker() -> MemoryBroker:
    return memory_broker(f"http-{uuid.uuid4().hex[:8]}")


# ----- health ------------------------------------------------------------------------------


async def test_health_is_ok_when_the_database_answers(db_url: str) -> None:
    async with serving(db_url) as client:
        response = await client.get("/health")
    assert response.status_code == 200
    assert response.json() == {"status": "ok", "database": "ok"}


async def test_unreachable_database_is_503_not_500() -> None:
    url = f"postgresql://postgres@127.0.0.1:{closed_port()}/nowhere"
    async with serving(url) as client:
        health = await client.get("/health")
        status = await client.get("/status")
        metrics = await client.get("/metrics")
    assert health.status_code == 503
    body = health.json()
    assert body["status"] == "unavailable" and body["reasons"][0].startswith("database: ")
    assert "cannot connect to PostgreSQL" in body["database"]
    assert status.status_code == 503 and status.json()["type"] == "ServiceUnavailable"
    assert metrics.status_code == 200, "a scrape still works and says the store is down"
    assert samples(metrics.text) == {'outboxer_store_up{database="default"}': 0}


async def test_health_inside_a_relay_follows_its_loops(
    relay_db_url: str, broker: MemoryBroker
) -> None:
    relay = make_relay(relay_db_url, f"memory://{broker.name}")
    async with serving(relay_db_url, relay) as client:
        starting = await client.get("/health")
        assert starting.status_code == 503
        assert "relay is starting" in starting.json()["relay"]
        async with running(relay):

            async def healthy() -> bool:
                return (await client.get("/health")).status_code == 200

            await eventually(healthy)
            assert (await client.get("/health")).json() == {
                "status": "ok",
                "database": "ok",
                "relay": "ok",
            }
            relay.stop()
            stopping = await client.get("/health")
        assert stopping.status_code == 503 and "relay is stopping" in stopping.json()["relay"]


async def test_health_is_503_while_the_broker_is_down_and_recovers(
    sqlite_url: str, tmp_path: Path
) -> None:
    events = tmp_path / "events.jsonl"
    events.mkdir()  # a directory where the file should be: the file broker cannot open it
    relay = make_relay(sqlite_url, f"file://{events}")
    async with serving(sqlite_url, relay) as client, running(relay):

        async def reports(status: int, fragment: str) -> bool:
            response = await client.get("/health")
            return response.status_code == status and fragment in response.text

        await eventually(lambda: reports(503, "broker default: unreachable"))
        events.rmdir()
        await eventually(lambda: reports(200, '"relay": "ok"'), timeout=30)


# ----- metrics -----------------------------------------------------------------------------


async def test_metrics_counters_move_when_the_relay_publishes(
    relay_db_url: str, broker: MemoryBroker
) -> None:
    relay = make_relay(relay_db_url, f"memory://{broker.name}")
    async with serving(relay_db_url, relay, status_cache_seconds=0) as client, running(relay):
        before = samples((await client.get("/metrics")).text)
        assert (
            before['outboxer_messages_published_total{database="default",destination="default"}']
            == 0
        )
        enqueue(relay_db_url, 3)

        async def published() -> bool:
            return (
                samples((await client.get("/metrics")).text)[
                    'outboxer_messages_published_total{database="default",destination="default"}'
                ]
                == 3
            )

        await eventually(published)
        response = await client.get("/metrics")
    assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    text = response.text
    for name, kind in [
        ("outboxer_messages_published_total", "counter"),
        ("outboxer_batches_total", "counter"),
        ("outboxer_claim_seconds_total", "counter"),
        ("outboxer_relay_uptime_seconds", "gauge"),
        ("outboxer_messages", "gauge"),
        ("outboxer_oldest_pending_age_seconds", "gauge"),
    ]:
        assert f"# TYPE {name} {kind}\n" in text and f"# HELP {name} " in text
    after = samples(text)
    assert (
        after['outboxer_batches_total{database="default",destination="default"}'] >= 1
        and after['outboxer_claim_seconds_total{database="default",destination="default"}'] > 0
    )
    assert (
        after['outboxer_messages_failed_total{database="default",destination="default"}']
        == after['outboxer_messages_abandoned_total{database="default",destination="default"}']
        == 0
    )
    assert after['outboxer_store_errors_total{database="default"}'] == 0  # the relay's own
    assert (
        after['outboxer_messages{database="default",destination="default",status="PUBLISHED"}'] == 3
    )
    assert (
        after['outboxer_messages{database="default",destination="default",status="PENDING"}'] == 0
    )
    assert after['outboxer_relay_healthy{database="default"}'] == 1
    assert after['outboxer_store_up{database="default"}'] == 1


async def test_metrics_reuse_the_status_query_for_a_few_seconds(sqlite_url: str) -> None:
    async with serving(sqlite_url, status_cache_seconds=60) as client:
        first = samples((await client.get("/metrics")).text)
        enqueue(sqlite_url, 2)
        cached = samples((await client.get("/metrics")).text)
        status = (await client.get("/status")).json()
    assert first == cached == {'outboxer_store_up{database="default"}': 1}, (
        "the second scrape did not query the outbox"
    )
    assert status["destinations"][0]["counts"] == {"PENDING": 2}, "/status is never cached"
    async with serving(sqlite_url, status_cache_seconds=0) as client:
        fresh = samples((await client.get("/metrics")).text)
    assert (
        fresh['outboxer_messages{database="default",destination="default",status="PENDING"}'] == 2
    )
    assert not any(name.startswith("outboxer_messages_published_total") for name in fresh), (
        "no relay counters without a relay"
    )


async def test_metrics_in_openmetrics_when_the_scraper_asks(sqlite_url: str) -> None:
    enqueue(sqlite_url, 1)
    async with serving(sqlite_url, status_cache_seconds=0) as client:
        response = await client.get(
            "/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"}
        )
    assert response.headers["content-type"].startswith("application/openmetrics-text")
    assert response.text.endswith("# EOF\n")
    assert (
        'outboxer_messages{database="default",destination="default",status="PENDING"} 1.0'
        in response.text
    )


async def test_the_dashboard_page_its_assets_and_its_series(db_url: str) -> None:
    enqueue(db_url, 2)
    async with serving(db_url, status_cache_seconds=0, sample_seconds=0.05) as client:
        await eventually(
            lambda: _true(len(client.server.api.history.samples) >= 2)  # type: ignore[attr-defined]
        )
        page = await client.get("/")
        script = await client.get("/dashboard.js")
        style = await client.get("/dashboard.css")
        series = (await client.get("/dashboard/series")).json()
    assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert 'data-status="PENDING">2</td>' in page.text
    assert script.headers["content-type"] == "text/javascript; charset=utf-8"
    assert "function drawChart" in script.text and "sessionStorage" in script.text
    assert style.headers["content-type"] == "text/css; charset=utf-8"
    assert series["points"][-1]["destinations"] == {"default": {"rate": 0.0, "latency": None}}


async def test_a_requeue_through_the_api_refreshes_the_cached_gauges(sqlite_url: str) -> None:
    async with abandoned(sqlite_url, 2), serving(sqlite_url, status_cache_seconds=60) as client:
        before = samples((await client.get("/metrics")).text)
        assert (await client.post("/messages/requeue", json={})).json() == {"requeued": 2}
        after = samples((await client.get("/metrics")).text)
    assert (
        before['outboxer_messages{database="default",destination="default",status="ABANDONED"}']
        == 2
    )
    assert (
        after['outboxer_messages{database="default",destination="default",status="ABANDONED"}'] == 0
    )
    assert (
        after['outboxer_messages{database="default",destination="default",status="PENDING"}'] == 2
    )


# ----- status and messages -----------------------------------------------------------------


async def test_status_is_what_the_cli_prints(
    db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    enqueue(db_url, 3)
    async with create_store(db_url) as store:
        await abandon(store, 1)
    async with serving(db_url) as client:
        response = await client.get("/status")
    assert await asyncio.to_thread(cli_main, ["status", "--db", db_url, "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    served = response.json()
    for report in (printed, served):  # ages move between the two calls
        for entry in report["destinations"]:
            assert entry.pop("oldest_pending_age_seconds") >= 0
        if report["oldest_transaction_age_seconds"] is not None:
            report["oldest_transaction_age_seconds"] = 0
    assert served == printed
    assert served["destinations"][0]["counts"] == {"PENDING": 2, "ABANDONED": 1}


async def test_messages_lists_by_status_with_a_limit(db_url: str) -> None:
    sent = enqueue(db_url, 4)
    async with create_store(db_url) as store:
        await abandon(store, 2)
    async with serving(db_url) as client:
        abandoned = (await client.get("/messages")).json()["messages"]
        pending = (
            await client.get("/messages", params={"status": "pending", "limit": "1"})
        ).json()["messages"]
        both = (await client.get("/messages?status=PENDING&status=ABANDONED&limit=100")).json()[
            "messages"
        ]
    # The newest change first; rows changed at the same moment, the later seq first.
    assert [m["id"] for m in abandoned] == [str(m.id) for m in reversed(sent[:2])]
    assert {m["status"] for m in abandoned} == {"ABANDONED"} and abandoned[0][
        "last_error"
    ] == "rejected"
    assert [m["id"] for m in pending] == [str(sent[3].id)]
    assert len(both) == 4


# ----- requeue -----------------------------------------------------------------------------


async def test_requeue_moves_abandoned_messages_to_pending(db_url: str) -> None:
    sent = enqueue(db_url, 4)
    async with create_store(db_url) as store:
        await abandon(store, 3)
        async with serving(db_url) as client:
            one = await client.post("/messages/requeue", json={"ids": [str(sent[0].id)]})
            assert one.status_code == 200 and one.json() == {"requeued": 1}
            assert await statuses(store) == {"PENDING": 2, "ABANDONED": 2}
            elsewhere = await client.post("/messages/requeue", json={"destinations": ["partner"]})
            assert elsewhere.json() == {"requeued": 0}
            failed_only = await client.post("/messages/requeue", json={"statuses": ["FAILED"]})
            assert failed_only.json() == {"requeued": 0}
            rest = await client.post("/messages/requeue", json={})
            assert rest.json() == {"requeued": 2}
        assert await statuses(store) == {"PENDING": 4}
        rows = await store.list_messages(["PENDING"], 10)
    assert {row["attempts"] for row in rows} == {0}, "attempts reset"


async def test_requeue_needs_the_token_when_one_is_configured(sqlite_url: str) -> None:
    enqueue(sqlite_url, 1)
    async with serving(sqlite_url, token=TOKEN) as client:
        refused = [
            await client.post("/messages/requeue", json={}),
            await client.post(
                "/messages/requeue", json={}, headers={"Authorization": "Bearer wrong"}
            ),
            await client.post(
                "/messages/requeue", json={}, headers={"Authorization": f"Bearer {TOKEN}x"}
            ),
            await client.post(
                "/messages/requeue", json={}, headers={"Authorization": f"Basic {TOKEN}"}
            ),
        ]
        allowed = await client.post(
            "/messages/requeue", json={}, headers={"Authorization": f"Bearer {TOKEN}"}
        )
        reads = [await client.get(path) for path in ("/health", "/status", "/messages", "/metrics")]
    for response in refused:
        assert response.status_code == 401
        assert response.json()["type"] == "Unauthorized"
        assert response.headers["www-authenticate"].startswith("Bearer")
    assert allowed.status_code == 200 and allowed.json() == {"requeued": 0}
    assert [r.status_code for r in reads] == [200, 200, 200, 200], "reads need no token"


# ----- requests from browsers --------------------------------------------------------------


@contextlib.asynccontextmanager
async def abandoned(url: str, count: int) -> AsyncIterator[Store]:
    """A store over ``count`` ABANDONED messages: what a requeue would move."""
    enqueue(url, count)
    async with create_store(url) as store:
        await abandon(store, count)
        yield store


def assert_refused(responses: list[httpx.Response], status: int, kind: str, fragment: str) -> None:
    for response in responses:
        assert response.status_code == status, response.text
        assert response.json()["type"] == kind
        assert fragment in response.json()["error"]


async def test_a_cross_site_form_post_is_refused_and_requeues_nothing(sqlite_url: str) -> None:
    """What a page on evil.example can make a browser send to a loopback API without a token."""
    async with abandoned(sqlite_url, 3) as store:
        async with serving(sqlite_url) as client:
            own_origin = client.server.url  # type: ignore[attr-defined]
            form = await client.post(
                "/messages/requeue",
                content=b'{"statuses": ["ABANDONED"]}',
                headers={"Content-Type": "text/plain", "Origin": "http://evil.example"},
            )
            as_json = await client.post(
                "/messages/requeue", json={}, headers={"Origin": "http://evil.example"}
            )
            sandboxed = await client.post("/messages/requeue", json={}, headers={"Origin": "null"})
            read = await client.get("/messages", headers={"Origin": "http://evil.example"})
            assert await statuses(store) == {"ABANDONED": 3}, "nothing was requeued"
            same_origin = await client.post(
                "/messages/requeue", json={}, headers={"Origin": own_origin}
            )
        assert await statuses(store) == {"PENDING": 3}
    assert_refused([form, as_json, sandboxed, read], 403, "Forbidden", "cross-origin request")
    assert same_origin.status_code == 200 and same_origin.json() == {"requeued": 3}


async def test_a_post_must_be_json(sqlite_url: str) -> None:
    async with abandoned(sqlite_url, 2) as store:
        async with serving(sqlite_url) as client:
            refused = [
                await client.post("/messages/requeue", content=b"{}", headers=headers)
                for headers in (
                    {},
                    {"Content-Type": "text/plain"},
                    {"Content-Type": "application/x-www-form-urlencoded"},
                    {"Content-Type": "multipart/form-data; boundary=x"},
                )
            ]
            assert await statuses(store) == {"ABANDONED": 2}, "nothing was requeued"
            accepted = await client.post(
                "/messages/requeue",
                content=b'{"ids": null}',
                headers={"Content-Type": "Application/JSON; charset=utf-8"},
            )
        assert await statuses(store) == {"PENDING": 2}
    assert_refused(refused, 415, "UnsupportedMediaType", "Content-Type: application/json")
    assert {response.headers["accept"] for response in refused} == {"application/json"}
    assert accepted.status_code == 200 and accepted.json() == {"requeued": 2}


async def test_a_dns_rebinding_host_is_misdirected_on_loopback(sqlite_url: str) -> None:
    """A page whose name resolves to 127.0.0.1 reaches the API with its own name as Host."""
    async with abandoned(sqlite_url, 1) as store, serving(sqlite_url) as client:
        port = client.server.port  # type: ignore[attr-defined]
        rebound = f"evil.example:{port}"
        read = await client.get("/messages", headers={"Host": rebound})
        requeue = await client.post(
            "/messages/requeue",
            json={},
            headers={"Host": rebound, "Origin": f"http://{rebound}"},
        )
        assert await statuses(store) == {"ABANDONED": 1}, "nothing was requeued"
        loopback_names = [
            await client.get("/messages", headers={"Host": host})
            for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "localhost")
        ]
    assert_refused([read, requeue], 421, "MisdirectedRequest", "got Host 'evil.example:")
    assert [response.status_code for response in loopback_names] == [200, 200, 200, 200]
    assert len(loopback_names[0].json()["messages"]) == 1


# ----- bad requests ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "body", "fragment"),
    [
        ("GET", "/messages?status=LOST", None, "unknown status LOST"),
        ("GET", "/messages?limit=ten", None, "limit must be a whole number"),
        ("GET", "/messages?limit=%C2%B2", None, "limit must be a whole number"),  # "²"
        ("GET", "/messages?limit=%D9%A3", None, "limit must be a whole number"),  # int() took it
        ("GET", "/messages?limit=-1", None, "limit must be a whole number"),
        ("GET", "/messages?limit=" + "9" * 5000, None, "limit must be between 1 and 1000"),
        ("GET", "/messages?limit=0", None, "limit must be between 1 and 1000"),
        ("GET", "/messages?limit=1001", None, "limit must be between 1 and 1000"),
        ("GET", "/messages?limit=1&limit=2", None, "give limit once"),
        ("GET", "/messages?stats=FAILED", None, "unknown query parameter(s) stats"),
        ("POST", "/messages/requeue", b"{not json", "not valid JSON"),
        ("POST", "/messages/requeue", b"\xff\xfe\xfa", "not valid JSON"),
        ("POST", "/messages/requeue", b"", "must be a JSON object"),
        ("POST", "/messages/requeue", b'["ABANDONED"]', "must be a JSON object"),
        ("POST", "/messages/requeue", b'{"status": ["ABANDONED"]}', "unknown field(s) status"),
        (
            "POST",
            "/messages/requeue",
            b'{"statuses": "ABANDONED"}',
            "statuses must be a non-empty list",
        ),
        ("POST", "/messages/requeue", b'{"statuses": []}', "statuses must be a non-empty list"),
        (
            "POST",
            "/messages/requeue",
            b'{"statuses": ["PUBLISHED"]}',
            "unknown statuses PUBLISHED; use ABANDONED, FAILED",
        ),
        (
            "POST",
            "/messages/requeue",
            b'{"destinations": [1]}',
            "destinations must be a non-empty list",
        ),
        ("POST", "/messages/requeue", b'{"ids": ["not-a-uuid"]}', "ids must be message ids"),
        (
            "POST",
            "/messages/requeue",
            b'{"destinations": ["a\\u0000b"]}',
            "an item of destinations contains a NUL",
        ),
        (
            "POST",
            "/messages/requeue",
            b'{"statuses": ["\\ud800"]}',
            "an item of statuses contains a lone surrogate",
        ),
        ("POST", "/messages/requeue", b"[" * 60000, "nested too deep"),
        (
            "POST",
            "/messages/requeue",
            b'{"ids": null, "destinations": [""]}',
            "destinations must be a non-empty list",
        ),
    ],
)
async def test_bad_input_is_a_400_that_says_why(
    sqlite_url: str, method: str, path: str, body: bytes | None, fragment: str
) -> None:
    async with serving(sqlite_url) as client:
        response = await client.request(
            method, path, content=body, headers={"Content-Type": "application/json"}
        )
    assert response.status_code == 400, response.text
    assert response.json()["type"] == "BadRequest"
    assert fragment in response.json()["error"]


async def test_unknown_paths_and_wrong_methods(sqlite_url: str) -> None:
    async with serving(sqlite_url) as client:
        missing = await client.get("/nope")
        post_health = await client.post("/health")
        delete_requeue = await client.delete("/messages/requeue")
        head_metrics = await client.head("/metrics")
    assert missing.status_code == 404 and missing.json()["type"] == "NotFound"
    assert post_health.status_code == 405 and post_health.headers["allow"] == "GET"
    assert delete_requeue.status_code == 405 and delete_requeue.headers["allow"] == "POST"
    assert head_metrics.status_code == 405


async def test_a_body_over_64_kib_is_refused_with_413(sqlite_url: str) -> None:
    async with serving(sqlite_url) as client:
        response = await client.post("/messages/requeue", content=b"x" * (64 * 1024 + 1))
        after = await client.get("/health")
    assert response.status_code == 413 and response.json()["type"] == "PayloadTooLarge"
    assert after.status_code == 200


async def raw_exchange(port: int, data: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


@pytest.mark.parametrize(
    ("data", "status"),
    [
        (b"garbage\r\n\r\n", b"400 Bad Request"),
        (b"GET /health HTTP/2.0\r\n\r\n", b"505 HTTP Version Not Supported"),
        # HTTP/1.1 requests carry Host (RFC 9112, 3.2): without it the answer is 400.
        (b"GET /health HTTP/1.1\r\n\r\n", b"400 Bad Request"),
        (
            b"POST /messages/requeue HTTP/1.1\r\nHost: localhost\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
            b"411 Length Required",
        ),
        (b"GET /health HTTP/1.1\r\nContent-Length: 1, 2\r\n\r\n", b"400 Bad Request"),
        (b"GET /health HTTP/1.0\r\n\r\n", b"200 OK"),
        # Each of these was a traceback in the log and a connection closed without an answer.
        (b"GET /health HTTP/1.1\r\nContent-Length: \xb2\r\n\r\n", b"400 Bad Request"),
        (
            b"GET /health HTTP/1.1\r\nHost: localhost\r\nContent-Length: "
            + b"9" * 5000
            + b"\r\n\r\n",
            b"400 Bad Request",  # h11 refuses a length of more digits than int() reads
        ),
        (
            b"POST /messages/requeue HTTP/1.1\r\nHost: localhost\r\nContent-Length: 70000\r\n"
            b"Content-Type: application/json\r\n\r\n" + b" " * 70000,
            b"413 Request Entity Too Large",
        ),
        (b"GET //[x HTTP/1.1\r\nHost: localhost\r\n\r\n", b"404 Not Found"),
        (b"GET * HTTP/1.1\r\nHost: localhost\r\n\r\n", b"400 Bad Request"),
        (b"GET /" + b"a" * 17000 + b" HTTP/1.1\r\n\r\n", b"431 Request Header Fields Too Large"),
    ],
)
async def test_raw_requests(
    sqlite_url: str, data: bytes, status: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        async with serving(sqlite_url) as client:
            answer = await raw_exchange(client.server.port, data)  # type: ignore[attr-defined]
            assert (await client.get("/health")).status_code == 200
    assert answer.startswith(b"HTTP/1.1 " + status + b"\r\n"), answer
    assert b"Connection: close\r\n" in answer
    assert [r.getMessage() for r in caplog.records if r.exc_info] == [], "no traceback"


@pytest.mark.parametrize(
    ("head", "status", "fragment"),
    [
        (b"GET /health\r\n\r\n", 400, "malformed HTTP/1.1 request"),
        (b"GET  /health HTTP/1.1\r\nHost: x\r\n\r\n", 400, "malformed"),
        (b"G(T /health HTTP/1.1\r\nHost: x\r\n\r\n", 400, "malformed"),
        (b"GET /health HTTP/1\r\nHost: x\r\n\r\n", 400, "malformed"),
        (b"GET /health http/1.1\r\nHost: x\r\n\r\n", 400, "malformed"),
        (b"GET /health HTTP/2.0\r\nHost: x\r\n\r\n", 505, "HTTP/2.0 is not supported"),
        (b"GET http://x/health HTTP/1.1\r\nHost: x\r\n\r\n", 400, "starting with '/'"),
        (b"GET /health HTTP/1.1\r\nHost: x\r\nNo colon here\r\n\r\n", 400, "malformed"),
        (b"GET /health HTTP/1.1\r\nHost: x\r\nBad Name: x\r\n\r\n", 400, "malformed"),
        # (A folded field line is not refused: h11 unfolds it, as RFC 9112, 5.2, allows.)
        (
            b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"A: 1\r\n" * 101 + b"\r\n",
            431,
            "more than 100 header fields",
        ),
        (b"GET /health HTTP/1.1\r\nHost: x\r\nX: a\x00b\r\n\r\n", 400, "malformed"),
        (b"GET /he\x00alth HTTP/1.1\r\nHost: x\r\n\r\n", 400, "malformed"),
        (b"GET /health HTTP/\xb9.1\r\nHost: x\r\n\r\n", 400, "malformed"),
        (
            b"GET /health HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 17000 + b"\r\n\r\n",
            431,
            "exceed 16384 bytes",
        ),
    ],
)
async def test_malformed_heads_are_refused_by_the_server(
    sqlite_url: str, head: bytes, status: int, fragment: str
) -> None:
    async with serving(sqlite_url) as client:
        answer = await raw_exchange(client.server.port, head)  # type: ignore[attr-defined]
    response_head, _, body = answer.partition(b"\r\n\r\n")
    assert response_head.split(b" ")[1] == str(status).encode(), answer
    assert fragment in json.loads(body)["error"]


async def test_unexpected_errors_are_a_500_with_the_traceback_in_the_log(
    sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with serving(sqlite_url) as client:
        api: HttpApi = client.server.api  # type: ignore[attr-defined]

        async def broken() -> dict[str, Any]:
            raise KeyError("a bug")

        api.store.status_report = broken  # type: ignore[method-assign]
        with caplog.at_level(logging.ERROR, logger="outboxer.http"):
            response = await client.get("/status")
    assert response.status_code == 500
    assert response.json() == {
        "error": "internal server error; the traceback is in the server's log",
        "type": "KeyError",
    }
    [record] = [r for r in caplog.records if r.name == "outboxer.http"]
    assert record.exc_info is not None and "GET /status failed" in record.getMessage()


# ----- slow clients and shutdown -----------------------------------------------------------


async def test_a_slow_client_times_out_and_blocks_neither_the_api_nor_the_relay(
    sqlite_url: str, broker: MemoryBroker
) -> None:
    relay = make_relay(sqlite_url, f"memory://{broker.name}")
    async with serving(sqlite_url, relay, read_timeout=1.0) as client, running(relay):
        port = client.server.port  # type: ignore[attr-defined]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # ... and never the blank line
        await writer.drain()
        started = time.monotonic()
        assert (await client.get("/status")).status_code == 200
        enqueue(sqlite_url, 2)
        await eventually(lambda: _true(len(broker.messages) == 2))
        answer = await asyncio.wait_for(reader.read(), 10)
        writer.close()
    assert answer.startswith(b"HTTP/1.1 408 Request Timeout"), answer
    assert 0.9 <= time.monotonic() - started < 5


async def test_a_body_that_stops_short_times_out_with_408(sqlite_url: str) -> None:
    async with abandoned(sqlite_url, 1) as store, serving(sqlite_url, read_timeout=1.0) as client:
        port = client.server.port  # type: ignore[attr-defined]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST /messages/requeue HTTP/1.1\r\nHost: localhost\r\n"
            b"Content-Type: application/json\r\nContent-Length: 20\r\n\r\n{}"
        )  # ... and never the other 18 bytes
        await writer.drain()
        started = time.monotonic()
        answer = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        assert await statuses(store) == {"ABANDONED": 1}, "nothing was requeued"
    assert answer.startswith(b"HTTP/1.1 408 Request Timeout"), answer
    assert b"did not arrive within 1s" in answer
    assert 0.9 <= time.monotonic() - started < 5


async def test_closing_the_server_drops_open_connections_without_waiting(sqlite_url: str) -> None:
    async with serving(sqlite_url) as client:
        server: HttpServer = client.server  # type: ignore[attr-defined]
        idle = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(3)]
        await asyncio.sleep(0.1)
        started = time.monotonic()
        await server.close()
        assert time.monotonic() - started < 2, "close() does not wait for the read timeout"
        for reader, writer in idle:
            assert await asyncio.wait_for(reader.read(), 5) == b""
            writer.close()
        with pytest.raises(httpx.ConnectError):
            await client.get("/health")


async def _true(value: bool) -> bool:
    return value


async def test_allowed_hosts_from_the_settings_reach_the_server(sqlite_url: str) -> None:
    """`http_allowed_hosts` names what a proxy or an internal DNS name sends as Host; other
    names stay misdirected (a DNS-rebinding page sends its own)."""
    from outboxer.http import start_http_api

    settings = load_settings(
        {"db": sqlite_url, "http": "127.0.0.1:0", "http_allowed_hosts": "relay.internal"},
        environ={},
    )
    async with abandoned(sqlite_url, 1):
        server = await start_http_api(settings)
        try:
            async with httpx.AsyncClient(base_url=server.url, timeout=20) as client:
                named = await client.get("/messages", headers={"Host": "relay.internal:9100"})
                rebound = await client.get("/messages", headers={"Host": "evil.example:9100"})
        finally:
            await server.close()
    assert named.status_code == 200 and len(named.json()["messages"]) == 1
    assert_refused([rebound], 421, "MisdirectedRequest", "got Host 'evil.example:")
