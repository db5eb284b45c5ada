"""Several databases in one relay process (RelayGroup): two real PostgreSQL databases and an
SQLite file published to the real Redis by one process, each database's keys in order, one
broker connection, metrics labelled by database; a database that is down holds up only its own
relay, and /health names it."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis.asyncio as aioredis

from outboxer import load_settings
from outboxer.errors import SchemaError
from outboxer.http import HttpApi, Request, api_stores
from outboxer.relay_group import RelayGroup
from tests.conftest import _admin_execute, _pg_url
from tests.integration.test_http_api import closed_port
from tests.relaying import enqueue, rows
from tests.services import require

REDIS = "redis://127.0.0.1:6379/0"


@pytest.fixture
def other_pg_url(pg_template: str) -> Iterator[str]:
    """A second fresh PostgreSQL database from the test template (``pg_url`` is the first)."""
    name = f"outboxer_t_{uuid.uuid4().hex[:12]}"
    _admin_execute(f"CREATE DATABASE {name} TEMPLATE {pg_template}")
    yield _pg_url(name)
    _admin_execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture
async def stream_prefix() -> AsyncIterator[str]:
    """A Redis stream prefix of this test's own; its streams are deleted afterwards."""
    require("redis")
    prefix = f"outboxer-test:{uuid.uuid4().hex[:8]}:"
    yield prefix
    client = aioredis.Redis.from_url(REDIS)
    try:
        keys = [key async for key in client.scan_iter(match=f"{prefix}*")]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()


async def stream(prefix: str, topic: str) -> list[dict[str, Any]]:
    """Every entry of the stream of ``topic``, in stream order, its payload parsed."""
    client = aioredis.Redis.from_url(REDIS)
    try:
        entries = await client.xrange(prefix + topic)
    finally:
        await client.aclose()
    return [
        {
            "key": fields[b"key"].decode() if b"key" in fields else None,
            "payload": json.loads(fields[b"payload"]),
        }
        for _, fields in entries
    ]


def write(url: str, database: str, keys: int, per_key: int) -> None:
    """``keys * per_key`` messages of topic ``t``, interleaved by key, in one transaction each
    round; payload {"db", "key", "n"}."""
    import outboxer
    from tests.integration.test_http_api import connect_sync

    conn = connect_sync(url)
    try:
        for n in range(per_key):
            for k in range(keys):
                key = f"k{k}"
                outboxer.enqueue(conn, "t", {"db": database, "key": key, "n": n}, key=key)
            conn.commit()
    finally:
        conn.close()


async def drained(url: str) -> bool:
    """Whether the outbox holds messages, every one PUBLISHED."""
    return {row["status"] for row in await rows(url)} == {"PUBLISHED"}


def config(tmp_path: Path, databases: dict[str, str], prefix: str, **extra: object) -> Path:
    """An outboxer.toml naming ``databases`` (name -> url), publishing to Redis."""
    lines = [
        f'broker = "{REDIS}?stream_prefix={prefix}"',
        "poll_interval = 0.05",
        "backoff_base = 0.05",
        "backoff_max = 0.1",
        *(f"{name} = {json.dumps(value)}" for name, value in extra.items()),
    ]
    for name, url in databases.items():
        lines += [f"[databases.{name}]", f'url = "{url}"']
    path = tmp_path / "outboxer.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


async def test_one_process_publishes_three_databases_each_in_key_order_over_one_connection(
    pg_url: str, other_pg_url: str, sqlite_url: str, stream_prefix: str, tmp_path: Path
) -> None:
    databases = {"orders": pg_url, "billing": other_pg_url, "local": sqlite_url}
    keys, per_key = 3, 30
    for name, url in databases.items():
        write(url, name, keys, per_key)
    settings = load_settings(
        {"exit_when_idle": True, "batch_size": 7},
        config_file=config(tmp_path, databases, stream_prefix, concurrency=3),
        environ={},
    )
    group = RelayGroup.from_settings(settings)
    assert len(group.pool or ()) == 1, "one publisher, so one connection, for the three"
    [_shared] = {id(relay.publishers["default"]) for relay in group.relays.values()}

    stats = await asyncio.wait_for(group.run(), 60)

    assert {name: each.published for name, each in stats.items()} == dict.fromkeys(
        databases, keys * per_key
    )
    for url in databases.values():
        assert {row["status"] for row in await rows(url)} == {"PUBLISHED"}
    entries = await stream(stream_prefix, "t")
    assert len(entries) == len(databases) * keys * per_key  # no duplicate: nothing failed
    for name in databases:
        for k in range(keys):
            order = [
                e["payload"]["n"]
                for e in entries
                if e["payload"]["db"] == name and e["key"] == f"k{k}"
            ]
            assert order == list(range(per_key)), f"{name} k{k} out of order"
    metrics = group.metrics
    assert metrics is not None
    for name in databases:
        value = metrics.registry.get_sample_value(
            "outboxer_messages_published_total", {"database": name, "destination": "default"}
        )
        assert value == keys * per_key, name
        count = metrics.registry.get_sample_value(
            "outboxer_publish_latency_seconds_count", {"database": name, "destination": "default"}
        )
        assert count == keys * per_key, name


async def test_health_is_unavailable_only_when_no_database_is_healthy(
    sqlite_url: str, stream_prefix: str, tmp_path: Path
) -> None:
    down = {
        name: f"postgresql://postgres@127.0.0.1:{closed_port()}/nowhere"
        for name in ("north", "south")
    }
    # Another file: one outbox under two names is refused (load_settings).
    other_sqlite = tmp_path / "other.db"
    shutil.copyfile(sqlite_url.removeprefix("sqlite:///"), other_sqlite)
    for databases, code, state in (
        (down, 503, "unavailable"),
        ({**down, "local": sqlite_url}, 200, "degraded"),
        ({"local": sqlite_url, "other": f"sqlite:///{other_sqlite}"}, 200, "ok"),
    ):
        settings = load_settings(
            {}, config_file=config(tmp_path, databases, stream_prefix), environ={}
        )
        api = HttpApi(api_stores(settings), settings, None, store_timeout=2)
        try:
            health = await api.handle(Request("GET", "/health"))
        finally:
            await api.close()
        body = json.loads(health.body)
        assert (health.status, body["status"]) == (code, state), body
        assert set(body["databases"]) == set(databases)
        assert sorted(reason.split(":", 1)[0] for reason in body.get("reasons", [])) == sorted(
            name for name in databases if name in down
        )


async def test_a_database_that_is_down_holds_up_its_own_relay_only(
    pg_url: str, sqlite_url: str, stream_prefix: str, tmp_path: Path
) -> None:
    down = f"postgresql://postgres@127.0.0.1:{closed_port()}/nowhere"
    databases = {"up": pg_url, "down": down, "local": sqlite_url}
    settings = load_settings(
        {"http": "127.0.0.1:0"},
        config_file=config(tmp_path, databases, stream_prefix, concurrency=2),
        environ={},
    )
    group = RelayGroup.from_settings(settings)
    running = asyncio.create_task(group.run())
    api = HttpApi(api_stores(settings), settings, group, store_timeout=2)
    try:
        write(pg_url, "up", 2, 10)
        write(sqlite_url, "local", 2, 10)
        deadline = time.monotonic() + 30
        while not (await drained(pg_url) and await drained(sqlite_url)):
            assert time.monotonic() < deadline, "the databases that are up did not drain"
            assert not running.done(), running
            await asyncio.sleep(0.05)
        problems = group.health_problems()
        assert problems["up"] == [] and problems["local"] == []
        assert problems["down"], "the relay of the database that is down says so"
        assert any("database" in problem for problem in problems["down"]), problems
        health = await api.handle(Request("GET", "/health"))
        body = json.loads(health.body)
        assert health.status == 200 and body["status"] == "degraded", "the others publish on"
        assert body["databases"]["up"] == {"database": "ok", "relay": "ok"}
        assert body["databases"]["local"] == {"database": "ok", "relay": "ok"}
        assert body["databases"]["down"]["database"] != "ok"
        assert body["reasons"] and all(r.startswith("down: ") for r in body["reasons"])
        status = json.loads((await api.handle(Request("GET", "/status"))).body)["databases"]
        assert status["up"]["destinations"][0]["counts"] == {"PUBLISHED": 20}
        assert "error" in status["down"]
        metrics = (await api.handle(Request("GET", "/metrics"))).body.decode()
        assert 'outboxer_relay_healthy{database="up"} 1.0' in metrics
        assert 'outboxer_relay_healthy{database="down"} 0.0' in metrics
        assert 'outboxer_store_up{database="down"} 0.0' in metrics
        assert (
            'outboxer_messages_published_total{database="local",destination="default"} 20.0'
            in metrics
        )
    finally:
        group.stop()
        await asyncio.wait_for(running, 20)  # the relay backing off stops too
        await api.close()


async def test_a_database_whose_connections_are_cut_catches_up_while_the_other_keeps_up(
    pg_url: str, other_pg_url: str, stream_prefix: str, tmp_path: Path
) -> None:
    databases = {"steady": pg_url, "cut": other_pg_url}
    settings = load_settings(
        {}, config_file=config(tmp_path, databases, stream_prefix, concurrency=2), environ={}
    )
    group = RelayGroup.from_settings(settings)
    running = asyncio.create_task(group.run())
    cut_name = other_pg_url.rsplit("/", 1)[1]
    try:
        cutting = True

        async def cut_connections() -> None:
            # The relay's connections to "cut" end every 20 ms while this runs.
            with psycopg.connect(_pg_url("postgres"), autocommit=True) as admin:
                while cutting:
                    admin.execute(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                        "WHERE datname = %s AND pid <> pg_backend_pid()",
                        (cut_name,),
                    )
                    await asyncio.sleep(0.02)

        cutter = asyncio.create_task(cut_connections())
        await asyncio.sleep(0.2)
        enqueue(pg_url, *[("t", "k")] * 20)
        write_cut = asyncio.create_task(asyncio.to_thread(_write_retrying, other_pg_url))
        deadline = time.monotonic() + 20
        while not await drained(pg_url):
            assert time.monotonic() < deadline, "the steady database did not drain"
            await asyncio.sleep(0.05)
        assert group.health_problems()["steady"] == []
        cutting = False
        await cutter
        await write_cut
        deadline = time.monotonic() + 30
        while not await drained(other_pg_url):
            assert time.monotonic() < deadline, "the database that was cut did not catch up"
            assert not running.done(), running
            await asyncio.sleep(0.05)
    finally:
        group.stop()
        await asyncio.wait_for(running, 20)
    assert group.relays["cut"].stats.store_errors > 0, "its relay did ride out an outage"
    assert group.relays["steady"].stats.store_errors == 0


def _write_retrying(url: str) -> None:
    """Commit 10 messages into a database whose connections are being cut: retry until in."""
    deadline = time.monotonic() + 20
    while True:
        try:
            enqueue(url, *[("t", "k")] * 10)
            return
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


async def test_the_api_lists_and_requeues_per_database(tmp_path: Path) -> None:
    from outboxer.stores import create_store
    from tests.integration.test_http_api import abandon
    from tests.integration.test_http_api import enqueue as enqueue_numbered

    urls = {name: f"sqlite:///{tmp_path / name}.db" for name in ("east", "west")}
    for url in urls.values():
        async with create_store(url) as store:
            await store.apply_schema()
    enqueue_numbered(urls["east"], 2)
    enqueue_numbered(urls["west"], 3)
    for url, count in ((urls["east"], 2), (urls["west"], 3)):
        async with create_store(url) as store:
            await abandon(store, count)
    settings = load_settings({"db": [f"{n}={u}" for n, u in urls.items()]}, environ={})
    api = HttpApi(api_stores(settings), settings)
    try:
        listed = json.loads((await api.handle(Request("GET", "/messages"))).body)["messages"]
        assert sorted(row["database"] for row in listed) == ["east"] * 2 + ["west"] * 3
        west = await api.handle(Request("GET", "/messages", query={"database": ["west"]}))
        assert {row["database"] for row in json.loads(west.body)["messages"]} == {"west"}
        unknown = await api.handle(Request("GET", "/messages", query={"database": ["north"]}))
        assert unknown.status == 400 and b"this API serves east, west" in unknown.body

        def requeue(body: dict[str, object]) -> Request:
            return _post("/messages/requeue", body)

        one = json.loads((await api.handle(requeue({"database": "east"}))).body)
        assert one == {"requeued": 2, "databases": {"east": {"requeued": 2}}}
        rest = json.loads((await api.handle(requeue({}))).body)
        assert rest == {
            "requeued": 3,
            "databases": {"east": {"requeued": 0}, "west": {"requeued": 3}},
        }
        # A dry run answers per database too, each with its counts by destination.
        dry = json.loads((await api.handle(requeue({"dry_run": True}))).body)
        assert dry["would_requeue"] == 0 and set(dry["databases"]) == {"east", "west"}
    finally:
        await api.close()


async def test_a_database_whose_schema_is_behind_stops_the_process_with_its_name(
    sqlite_url: str, tmp_path: Path
) -> None:
    (tmp_path / "bare.db").touch()  # a database, with no outbox schema applied
    bare = f"sqlite:///{tmp_path / 'bare.db'}"
    settings = load_settings(
        {"db": [f"good={sqlite_url}", f"bare={bare}"], "broker": "memory://"}, environ={}
    )
    group = RelayGroup.from_settings(settings)
    with pytest.raises(SchemaError, match=r"^database bare: the outbox schema .* lacks"):
        await asyncio.wait_for(group.run(), 20)
    assert group.relays["good"].stopping, "the other relay was stopped, not left running"


async def _published_sqlite_databases(tmp_path: Path, names: tuple[str, ...]) -> dict[str, str]:
    """SQLite outboxes named ``names``, each holding two PUBLISHED messages."""
    from outboxer.stores import create_store
    from tests.integration.test_http_api import enqueue as enqueue_numbered

    urls = {name: f"sqlite:///{tmp_path / name}.db" for name in names}
    for url in urls.values():
        async with create_store(url) as store:
            await store.apply_schema()
        enqueue_numbered(url, 2)
        async with create_store(url) as store:
            claimed = await store.claim("default", "relay-test", 2, 60.0, False)
            await store.settle("default", claimed.lease, [m.stored_seq for m in claimed], [], [], 9)
    return urls


def _post(path: str, body: dict[str, object]) -> Request:
    return Request(
        "POST", path, headers={"content-type": "application/json"}, body=json.dumps(body).encode()
    )


def _replay_request(body: dict[str, object]) -> Request:
    return _post("/messages/replay", body)


async def test_a_replay_to_a_destination_one_database_lacks_changes_no_database(
    tmp_path: Path,
) -> None:
    """Databases change one after another, each in its own transaction: the destination is
    checked on every one before the first writes, or east would keep copies that the 400
    answer denies (and a retry would replay them twice)."""
    urls = await _published_sqlite_databases(tmp_path, ("east", "west"))
    (tmp_path / "outboxer.toml").write_text(
        'broker = "memory://"\n'
        f'[databases.east]\nurl = "{urls["east"]}"\n'
        '[databases.east.destinations.partner]\nbroker = "memory://partner"\n'
        f'[databases.west]\nurl = "{urls["west"]}"\n'
    )
    settings = load_settings(config_file=tmp_path / "outboxer.toml", environ={})
    api = HttpApi(api_stores(settings), settings)
    try:
        answer = await api.handle(_replay_request({"all": True, "to": "partner"}))
        assert answer.status == 400, answer.body
        assert b"partner" in answer.body
        for url in urls.values():
            assert [row["status"] for row in await rows(url)] == ["PUBLISHED"] * 2
    finally:
        await api.close()


async def test_a_change_that_fails_on_a_later_database_says_what_the_earlier_ones_did(
    tmp_path: Path,
) -> None:
    """east commits its replay, then west fails: the error answer names west and carries
    east's result, so the operator retries west alone instead of replaying east twice."""
    import sqlite3

    urls = await _published_sqlite_databases(tmp_path, ("east", "west"))
    settings = load_settings({"db": [f"{n}={u}" for n, u in urls.items()]}, environ={})
    api = HttpApi(api_stores(settings), settings)
    try:
        with sqlite3.connect(tmp_path / "west.db") as conn:  # west's outbox is gone
            conn.execute("DROP TABLE outbox")
        answer = await api.handle(_replay_request({"all": True}))
        assert answer.status == 503, answer.body
        body = json.loads(answer.body)
        assert body["failed_database"] == "west"
        assert body["committed"] == {"east": {"replayed": 2, "to": None, "shredded": 0}}
        assert "database error" in body["error"]
        assert sorted(row["status"] for row in await rows(urls["east"])) == (
            ["PENDING"] * 2 + ["PUBLISHED"] * 2
        )
    finally:
        await api.close()
