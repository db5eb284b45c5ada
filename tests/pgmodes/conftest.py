"""A private PostgreSQL 15 with wal_level=logical, owned by this test session.

The shared server (5432) runs with wal_level=replica and must not be restarted while
other suites use it; logical decoding tests (the WAL outbox, the Debezium layout) start
their own server on a free port and stop it at the end of the session.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from outboxer.streamtesting import private_postgres
from tests.services import IN_CI


@pytest.fixture(scope="session")
def logical_pg() -> Iterator[str]:
    """Admin URL of a private PostgreSQL with wal_level=logical."""
    try:
        server = private_postgres()
        url = server.__enter__()
    except FileNotFoundError as exc:
        if IN_CI:
            pytest.fail(str(exc))
        pytest.skip(str(exc))
    try:
        yield url
    finally:
        server.__exit__(None, None, None)


@pytest.fixture
def logical_url(logical_pg: str) -> Iterator[str]:
    """A fresh database on the private server; its slots are dropped with it."""
    import psycopg

    name = f"outboxer_w_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(logical_pg, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name}")
    yield logical_pg.rsplit("/", 1)[0] + "/" + name
    with psycopg.connect(logical_pg, autocommit=True) as admin:
        admin.execute(
            "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots "
            "WHERE database = %s AND active_pid IS NOT NULL",
            (name,),
        )
        admin.execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
            "WHERE database = %s",
            (name,),
        )
        admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
