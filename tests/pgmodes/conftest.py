"""A private PostgreSQL 15 with wal_level=logical, owned by this test session.

The shared server (5432) runs with wal_level=replica and must not be restarted while
other suites use it; logical decoding tests (the WAL outbox, the Debezium layout) start
their own server on a free port and stop it by its data directory at the end.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.services import IN_CI

PG_BIN = Path(os.environ.get("OUTBOXER_PG_BIN", "/usr/lib/postgresql/15/bin"))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _as_postgres(command: list[str]) -> list[str]:
    """initdb and pg_ctl refuse to run as root: run them as the postgres user then."""
    return ["runuser", "-u", "postgres", "--", *command] if os.geteuid() == 0 else command


@pytest.fixture(scope="session")
def logical_pg() -> Iterator[str]:
    """Admin URL of a private PostgreSQL with wal_level=logical."""
    if not (PG_BIN / "initdb").exists():
        message = f"no PostgreSQL binaries in {PG_BIN} (set OUTBOXER_PG_BIN)"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    base = Path(tempfile.mkdtemp(prefix="outboxer-logical-pg-"))
    data, sockets = base / "data", base / "sockets"
    sockets.mkdir()
    if os.geteuid() == 0:
        shutil.chown(base, "postgres")
        shutil.chown(sockets, "postgres")
    subprocess.run(
        _as_postgres([str(PG_BIN / "initdb"), "-D", str(data), "-U", "postgres", "-A", "trust"]),
        check=True,
        capture_output=True,
    )
    port = _free_port()
    options = (
        f"-p {port} -k {sockets} -c listen_addresses=127.0.0.1 -c wal_level=logical "
        "-c max_replication_slots=20 -c max_wal_senders=10 -c fsync=off"
    )
    subprocess.run(
        _as_postgres(
            [
                str(PG_BIN / "pg_ctl"),
                "-D",
                str(data),
                "-o",
                options,
                "-l",
                str(base / "log"),
                "-w",
                "start",
            ]
        ),
        check=True,
        capture_output=True,
    )
    try:
        yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run(
            _as_postgres([str(PG_BIN / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop"]),
            check=False,
            capture_output=True,
        )
        shutil.rmtree(base, ignore_errors=True)


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
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = %s",
            (name,),
        )
        admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
