"""A private PostgreSQL primary with a streaming hot standby, for failover tests.

The primary (A) is made with initdb, the standby (B) with ``pg_basebackup -R`` from it, each
on a free port of 127.0.0.1. A failover as a fencing tool or a managed service does it:
``fence`` turns A read-only for every session, the open ones included
(``default_transaction_read_only``, what Patroni or pg_auto_failover set on a demoted
primary; Aurora's old writer keeps its sessions as a reader), and ``promote`` makes B the
primary. A URL naming both hosts with ``target_session_attrs=read-write`` reaches whichever
is writable. Both servers end with the block, by ``pg_ctl stop`` (then SIGKILL by pid).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from outboxer.streamtesting import PG_BIN, _as_postgres, _free_port
from tests.services import IN_CI


@dataclass
class Pair:
    base: Path
    primary_port: int
    standby_port: int

    def url(self, database: str = "postgres") -> str:
        """Both hosts, the writable one chosen at each connect."""
        return (
            f"postgresql://postgres@127.0.0.1:{self.primary_port},127.0.0.1:{self.standby_port}"
            f"/{database}?target_session_attrs=read-write"
        )

    def primary_url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.primary_port}/{database}"

    def standby_url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.standby_port}/{database}"

    def fence(self) -> None:
        """A turns read-only for every session, the open ones at their next statement."""
        import psycopg

        with psycopg.connect(self.primary_url(), autocommit=True) as conn:
            conn.execute("ALTER SYSTEM SET default_transaction_read_only = on")
            conn.execute("SELECT pg_reload_conf()")

    def promote(self) -> None:
        """B leaves recovery (waits until it accepts writes)."""
        _run(PG_BIN / "pg_ctl", "-D", str(self.base / "standby"), "-w", "-t", "20", "promote")

    def caught_up(self, database: str, timeout: float = 10.0) -> None:
        """Wait until B has replayed everything A had written when this was called."""
        import psycopg

        with psycopg.connect(self.primary_url(database), autocommit=True) as conn:
            # Asynchronous commits (the relay's) included: the WAL writer flushes them soon.
            row = conn.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()
        assert row is not None
        target = row[0]
        deadline = time.monotonic() + timeout
        with psycopg.connect(self.standby_url(database), autocommit=True) as conn:
            while True:
                replayed = conn.execute(
                    "SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", (target,)
                ).fetchone()
                if replayed and replayed[0]:
                    return
                assert time.monotonic() < deadline, "the standby did not catch up"
                time.sleep(0.02)


def _run(*command: object) -> None:
    argv = _as_postgres([str(part) for part in command])
    done = subprocess.run(argv, check=False, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(argv)}: {done.stdout}{done.stderr}")


def _stop(data: Path) -> None:
    """pg_ctl stop, then SIGKILL of the postmaster by its pid if it is still there."""
    pid_file = data / "postmaster.pid"
    try:
        pid = int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return
    subprocess.run(
        _as_postgres([str(PG_BIN / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"]),
        check=False,
        capture_output=True,
    )
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, 0)
        os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def primary_and_standby(database: str) -> Iterator[Pair]:
    """A primary holding ``database`` and its streaming hot standby, while the block runs
    (skipped without PostgreSQL's binaries, failed in CI)."""
    if not (PG_BIN / "pg_basebackup").exists():
        message = f"no PostgreSQL binaries in {PG_BIN} (set OUTBOXER_PG_BIN)"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    base = Path(tempfile.mkdtemp(prefix="outboxer-failover-pg-"))
    primary, standby, sockets = base / "primary", base / "standby", base / "sockets"
    sockets.mkdir()
    if os.geteuid() == 0:
        shutil.chown(base, "postgres")
        shutil.chown(sockets, "postgres")
    pair = Pair(base, _free_port(), _free_port())
    try:
        _run(PG_BIN / "initdb", "-D", primary, "-U", "postgres", "-A", "trust", "--no-sync")
        common = f"-k {sockets} -c listen_addresses=127.0.0.1 -c fsync=off"
        _run(
            PG_BIN / "pg_ctl", "-D", primary, "-l", base / "primary.log", "-w",
            "-o", f"-p {pair.primary_port} {common}", "start",
        )  # fmt: skip
        _run(
            PG_BIN / "psql", "-h", "127.0.0.1", "-p", pair.primary_port, "-U", "postgres",
            "-c", f"CREATE DATABASE {database}",
        )  # fmt: skip
        _run(
            PG_BIN / "pg_basebackup", "-h", "127.0.0.1", "-p", pair.primary_port,
            "-U", "postgres", "-D", standby, "-R", "-X", "stream", "-c", "fast", "--no-sync",
        )  # fmt: skip
        _run(
            PG_BIN / "pg_ctl", "-D", standby, "-l", base / "standby.log", "-w",
            "-o", f"-p {pair.standby_port} {common}", "start",
        )  # fmt: skip
        yield pair
    finally:
        _stop(standby)
        _stop(primary)
        shutil.rmtree(base, ignore_errors=True)
