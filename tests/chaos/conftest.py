"""Fixtures of the chaos suite: private servers (tests/chaos/servers.py), a fresh outbox
database on the private PostgreSQL per test, a consumer on the private RabbitMQ, relays."""

from __future__ import annotations

import asyncio
import secrets
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import psycopg
import pytest

from outboxer.stores import create_store
from tests.chaos import servers
from tests.chaos.harness import RabbitSink, RelayFleet
from tests.chaos.servers import PrivatePostgres, PrivateRabbitMQ

# The private servers, once per session (tests/chaos/servers.py).
private_postgres = servers.private_postgres
private_rabbitmq = servers.private_rabbitmq


PRIVATE_SERVERS = {"private_postgres", "private_rabbitmq"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if PRIVATE_SERVERS & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.chaos)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "chaos: fault-injection scenarios on private servers (deselect: -m 'not chaos')",
    )


@pytest.fixture(scope="session")
def chaos_template(private_postgres: PrivatePostgres) -> str:
    """A database on the private server with the outbox schema, cloned by each test."""
    name = "chaos_template"
    with psycopg.connect(private_postgres.url(), autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")

    async def apply() -> None:
        async with create_store(private_postgres.url(name)) as store:
            await store.apply_schema()

    asyncio.run(apply())
    return name


@pytest.fixture
def make_chaos_db(
    private_postgres: PrivatePostgres, chaos_template: str
) -> Iterator[Callable[[], str]]:
    """``make_chaos_db()``: the URL (with the private server's password) of a fresh database
    holding an empty outbox; dropped after the test."""
    names: list[str] = []

    def make() -> str:
        name = f"chaos_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(private_postgres.url(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name} TEMPLATE {chaos_template}")
        names.append(name)
        return private_postgres.url(name)

    yield make
    if private_postgres.pid is not None:
        with psycopg.connect(private_postgres.url(), autocommit=True) as conn:
            for name in names:
                conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture
def chaos_db(make_chaos_db: Callable[[], str]) -> str:
    return make_chaos_db()


@pytest.fixture
def http_token() -> str:
    return "http-" + secrets.token_hex(12)


@pytest.fixture
def make_rabbit_sink(private_rabbitmq: PrivateRabbitMQ) -> Iterator[Callable[[], RabbitSink]]:
    """``make_rabbit_sink()``: a consumer of a fresh exchange on the private RabbitMQ (a
    durable queue bound to ``#``); relays publish there with
    ``private_rabbitmq.url(sink.exchange)``."""
    sinks: list[RabbitSink] = []

    def make() -> RabbitSink:
        exchange = f"chaos-{uuid.uuid4().hex[:10]}"
        sink = RabbitSink(private_rabbitmq.url(exchange).split("?")[0], exchange).start()
        sinks.append(sink)
        return sink

    yield make
    for sink in sinks:
        sink.stop()


@pytest.fixture
def rabbit_sink(make_rabbit_sink: Callable[[], RabbitSink]) -> RabbitSink:
    return make_rabbit_sink()


@pytest.fixture
def make_fleet(tmp_path: Path, http_token: str) -> Iterator[Callable[..., RelayFleet]]:
    """``make_fleet(db_url, broker_url, args)``: relays whose logs go to this test's tmp_path;
    whatever of them still runs after the test is killed."""
    created: list[RelayFleet] = []

    def make(db_url: str, broker_url: str, args: Sequence[str]) -> RelayFleet:
        fleet = RelayFleet(db_url, broker_url, tmp_path, args=args, http_token=http_token)
        created.append(fleet)
        return fleet

    yield make
    for fleet in created:
        fleet.terminate_all()
