"""A database whose disk fills up, for real: a small tmpfs (``mount -t tmpfs``, root only)
holds the database's files, and a ballast file written until ENOSPC fills it; deleting the
ballast gives the space back. Where mounting is impossible (not root, a container without
CAP_SYS_ADMIN) the test skips with the reason, and fails under ``CI=true`` (as
``services.require``).

PostgreSQL: a private server (``diskfull_postgres``, one per test module), a tablespace on
the tmpfs and a database in it (its catalogs, tables and indexes there; the WAL stays on the
server's own disk): once full, a statement that must extend a relation fails with SQLSTATE
53100 (disk_full). Never the shared server: while the tablespace is full its checkpoints
fail ("checkpoint request failed"), and with them every CREATE DATABASE of the tests
running beside.
SQLite: the database file (and its -wal) on the tmpfs: SQLITE_FULL.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from tests.chaos.servers import PrivatePostgres, reap_orphans
from tests.services import IN_CI

#: The database on each private server that every test's database is cloned from.
TEMPLATE = "diskfull_template"
_CHUNKS = (1 << 20, 64 << 10, 4 << 10)


def _unavailable(reason: str) -> None:
    if IN_CI:
        pytest.fail(f"disk-full tests need a tmpfs mount: {reason}")
    pytest.skip(f"disk-full tests need a tmpfs mount: {reason}")


@contextlib.contextmanager
def tmpfs(size_mb: int) -> Iterator[Path]:
    """A fresh tmpfs of ``size_mb`` MiB, unmounted (lazily if still busy) at the end."""
    where = Path(tempfile.mkdtemp(prefix="outboxer-diskfull-"))
    if os.geteuid() != 0 or shutil.which("mount") is None:
        where.rmdir()
        _unavailable("not root, or no mount(8)")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m,mode=0755", "tmpfs", str(where)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        where.rmdir()
        _unavailable(done.stderr.strip() or f"mount exited {done.returncode}")
    try:
        yield where
    finally:
        if subprocess.run(["umount", str(where)], capture_output=True, check=False).returncode:
            subprocess.run(["umount", "-l", str(where)], capture_output=True, check=False)
        with contextlib.suppress(OSError):
            where.rmdir()


class Ballast:
    """A file that takes every free byte of its file system (``fill``) until ``free``."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / "ballast"

    def fill(self) -> int:
        """Write zeros until ENOSPC, in ever smaller chunks; the bytes written."""
        written = 0
        with open(self.path, "ab", buffering=0) as file:
            for size in _CHUNKS:
                chunk = bytes(size)
                while True:
                    try:
                        n = file.write(chunk)
                    except OSError as exc:
                        if exc.errno != errno.ENOSPC:
                            raise
                        break
                    written += n or 0
                    if not n:
                        break
        return written

    def free(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def _admin(server: PrivatePostgres, *statements: str) -> None:
    with psycopg.connect(server.url(), autocommit=True) as conn:
        for statement in statements:
            conn.execute(statement)


@pytest.fixture(scope="module")
def diskfull_postgres() -> Iterator[PrivatePostgres]:
    """A private PostgreSQL for one test module, with ``TEMPLATE`` (the outbox schema)."""
    import asyncio

    from outboxer.stores import create_store

    reap_orphans()
    server = PrivatePostgres()
    try:
        server.init()
        _admin(server, f"CREATE DATABASE {TEMPLATE}")

        async def apply() -> None:
            async with create_store(server.url(TEMPLATE)) as store:
                await store.apply_schema()

        asyncio.run(apply())
        yield server
    finally:
        server.close()


@contextlib.contextmanager
def pg_database_on_tmpfs(
    server: PrivatePostgres, size_mb: int = 48
) -> Iterator[tuple[str, Ballast]]:
    """A clone of ``TEMPLATE`` on ``server`` whose files all live in a tablespace on a tmpfs
    of its own; its URL and the tmpfs's ballast. Dropped (database, tablespace) and
    unmounted at the end, the ballast freed first, even on failure."""
    name = f"outboxer_diskfull_{uuid.uuid4().hex[:10]}"
    with tmpfs(size_mb) as mount:
        ballast = Ballast(mount)
        location = mount / "pg"
        location.mkdir()
        shutil.chown(location, "postgres", "postgres")
        try:
            _admin(
                server,
                f"CREATE TABLESPACE {name} LOCATION '{location}'",
                f"CREATE DATABASE {name} TEMPLATE {TEMPLATE} TABLESPACE {name}",
            )
            yield server.url(name), ballast
        finally:
            ballast.free()
            with contextlib.suppress(psycopg.Error):
                _admin(server, f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
            with contextlib.suppress(psycopg.Error):
                _admin(server, f"DROP TABLESPACE IF EXISTS {name}")
