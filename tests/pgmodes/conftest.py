"""A private PostgreSQL 15 with wal_level=logical, owned by this test session.

The shared server (5432) runs with wal_level=replica and must not be restarted while
other suites use it; logical decoding tests (the WAL outbox, the Debezium layout) start
their own server on a free port and stop it at the end of the session.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from outboxer.streamtesting import private_postgres
from tests.services import IN_CI


@contextlib.contextmanager
def private_server() -> Iterator[str]:
    """A private PostgreSQL with wal_level=logical while the block runs: its admin URL
    (skipped without PostgreSQL's binaries, failed in CI)."""
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


@pytest.fixture(scope="session")
def logical_pg() -> Iterator[str]:
    """Admin URL of a private PostgreSQL with wal_level=logical."""
    with private_server() as url:
        yield url


@contextlib.contextmanager
def fresh_database(admin_url: str, prefix: str) -> Iterator[str]:
    """A new database on the private server at ``admin_url`` while the block runs: its URL;
    its slots are dropped with it."""
    import psycopg

    name = f"{prefix}{uuid.uuid4().hex[:12]}"
    with psycopg.connect(admin_url, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name}")
    try:
        yield admin_url.rsplit("/", 1)[0] + "/" + name
    finally:
        with psycopg.connect(admin_url, autocommit=True) as admin:
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


@pytest.fixture
def logical_url(logical_pg: str) -> Iterator[str]:
    """A fresh database on the private server; its slots are dropped with it."""
    with fresh_database(logical_pg, "outboxer_w_") as url:
        yield url


@pytest.fixture(scope="module")
def small_slot_pg() -> Iterator[str]:
    """Admin URL of a private server (one per test module: the limit would invalidate other
    tests' slots) that keeps at most 1MB of WAL for a slot (max_slot_wal_keep_size)."""
    import psycopg

    with private_server() as url:
        with psycopg.connect(url, autocommit=True) as admin:
            admin.execute("ALTER SYSTEM SET max_slot_wal_keep_size = '1MB'")
            admin.execute("ALTER SYSTEM SET wal_keep_size = 0")
            admin.execute("SELECT pg_reload_conf()")
        yield url


@pytest.fixture
def small_slot_wal(small_slot_pg: str) -> Iterator[Any]:
    """A WAL outbox (PgWal) in a fresh database of ``small_slot_pg``."""
    from outboxer.stores.pgwal import PgWal

    with fresh_database(small_slot_pg, "outboxer_ws_") as url:
        yield PgWal(url, slot_prefix=url.rsplit("/", 1)[1], keepalive_seconds=0.05)
