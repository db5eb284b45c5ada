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
from typing import Any

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


MARIADBD = "/usr/sbin/mariadbd"
#: The private MariaDB's account for the tests (every privilege, no password, from
#: 127.0.0.1: a fresh data directory's root is unix_socket only).
_MARIADB_INIT = (
    "CREATE USER 'root'@'127.0.0.1';\nGRANT ALL ON *.* TO 'root'@'127.0.0.1' WITH GRANT OPTION;\n"
)


class PrivateMariaDB:
    """A ``mariadbd`` of a test module's own: a data directory under /tmp, a free port, a
    temporary directory of its own (as tests/integration/test_audit20_myreadonly_failover.py).
    Never the shared server: a database of it on a full tmpfs must not touch anyone else."""

    def __init__(self) -> None:
        self.home = Path(tempfile.mkdtemp(prefix="outboxer-diskfull-maria-"))
        self.data = self.home / "data"
        self.process: subprocess.Popen[bytes] | None = None
        self.port = 0

    def start(self) -> None:
        import time

        from tests.services import free_port, port_open

        install = shutil.which("mariadb-install-db") or "/usr/bin/mariadb-install-db"
        if not (os.path.exists(MARIADBD) and os.path.exists(install)):
            pytest.skip("mariadbd / mariadb-install-db not installed")
        tmp = self.home / "tmp"
        tmp.mkdir()
        env = {**os.environ, "TMPDIR": str(tmp)}
        user = ["--user=root"] if os.geteuid() == 0 else []
        done = subprocess.run(
            [install, "--no-defaults", *user, f"--datadir={self.data}", "--skip-test-db"],
            check=False,
            capture_output=True,
            timeout=60,
            env=env,
        )
        if done.returncode != 0:
            pytest.fail(f"mariadb-install-db failed: {done.stdout!r} {done.stderr!r}")
        (self.home / "init.sql").write_text(_MARIADB_INIT)
        self.port = free_port()
        log = self.home / "error.log"
        with open(log, "wb") as stderr:
            self.process = subprocess.Popen(
                [
                    MARIADBD,
                    "--no-defaults",
                    *user,
                    f"--datadir={self.data}",
                    f"--port={self.port}",
                    "--bind-address=127.0.0.1",
                    f"--socket={self.home / 'mysqld.sock'}",
                    f"--pid-file={self.home / 'mysqld.pid'}",
                    "--skip-name-resolve",
                    "--skip-log-bin",
                    "--innodb-buffer-pool-size=16M",
                    f"--init-file={self.home / 'init.sql'}",
                    f"--tmpdir={tmp}",
                ],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
            )
        deadline = time.monotonic() + 30
        while True:
            if self.process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the private MariaDB did not start: {log.read_text()[-2000:]}")
            if port_open(self.port):
                try:
                    self.admin("SELECT 1")
                    return
                except Exception:
                    pass
            time.sleep(0.05)

    def url(self, database: str) -> str:
        return f"mysql://root@127.0.0.1:{self.port}/{database}"

    def admin(self, statement: str, database: str | None = None) -> list[tuple[Any, ...]]:
        import pymysql

        conn = pymysql.connect(
            host="127.0.0.1",
            port=self.port,
            user="root",
            database=database,
            autocommit=True,
            connect_timeout=5,
        )
        try:
            with conn.cursor() as cursor:
                cursor.execute(statement)
                return list(cursor.fetchall())
        finally:
            conn.close()

    def close(self) -> None:
        import signal

        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.home, ignore_errors=True)


@pytest.fixture(scope="module")
def diskfull_mariadb() -> Iterator[PrivateMariaDB]:
    """A private MariaDB for one test module (``mariadb_database_on_tmpfs``)."""
    server = PrivateMariaDB()
    try:
        server.start()
        yield server
    finally:
        server.close()


@contextlib.contextmanager
def mariadb_database_on_tmpfs(
    server: PrivateMariaDB, size_mb: int = 16
) -> Iterator[tuple[str, Ballast]]:
    """A database of ``server`` whose directory (its InnoDB tables, one file each) is a
    tmpfs of its own, with the outbox schema; its URL and the tmpfs's ballast. The redo log
    and the system tablespace stay on the server's own disk: once full, a statement that
    must extend a table fails with 1114 (ER_RECORD_FILE_FULL, "The table ... is full").
    Dropped and unmounted at the end, the ballast freed first, even on failure."""
    import asyncio
    import concurrent.futures

    from outboxer.stores import create_store

    name = f"diskfull_{uuid.uuid4().hex[:10]}"
    directory = server.data / name
    directory.mkdir()
    try:
        with tmpfs(size_mb) as mount:
            subprocess.run(["mount", "--bind", str(mount), str(directory)], check=True)
            ballast = Ballast(directory)
            try:

                async def apply() -> None:
                    async with create_store(server.url(name)) as store:
                        await store.apply_schema()

                # A thread of its own: the test's event loop may be running.
                with concurrent.futures.ThreadPoolExecutor(1) as pool:
                    pool.submit(asyncio.run, apply()).result()
                yield server.url(name), ballast
            finally:
                ballast.free()
                with contextlib.suppress(Exception):
                    server.admin(f"DROP DATABASE IF EXISTS {name}")
                if subprocess.run(["umount", str(directory)], check=False).returncode:
                    subprocess.run(["umount", "-l", str(directory)], check=False)
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(directory)
