"""The relay's drain on MariaDB and SQLite, beside their database ceilings (bench/run.py: stores).

Each drain starts from a copy of a template holding the backlog (the same rows as the
PostgreSQL template, written through ``enqueue_many``): MariaDB copies every table with
``CREATE TABLE … LIKE`` and ``INSERT … SELECT``, SQLite copies the file. The relay (the CLI,
default settings) waits behind a gate, as on PostgreSQL: the bench holds the destination's
claim lock (MariaDB: its row in ``outbox_destinations`` FOR UPDATE; SQLite: a write
transaction) until every claim waits on it, so imports and connections are not timed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pymysql

import outboxer
from harness import BoxMeter, RelayProcess, RelayRun, cpu_of, write_backlog
from outboxer.stores import create_store
from outboxer.stores.mysql import mysql_connect_args
from outboxer.stores.sqlite import open_connection

MYSQL_ADMIN = os.environ.get("OUTBOXER_BENCH_MYSQL", "mysql://root@127.0.0.1:3306/test")
DIALECTS = ("mariadb", "sqlite")
DESTINATION = "default"


def _mysql(url: str, **options: Any) -> Any:
    return pymysql.connect(**mysql_connect_args(url), **options)


async def _apply_schema(url: str) -> None:
    store = create_store(url)
    await store.connect()
    try:
        await store.apply_schema()
    finally:
        await store.close()


@dataclass
class StoreDatabases:
    """Templates and copies of them, on MariaDB (databases) and SQLite (files)."""

    run_id: str
    created: list[str] = field(default_factory=list)
    folder: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="outboxer-bench-")))
    _count: int = 0

    def _name(self, label: str) -> str:
        self._count += 1
        return f"outboxer_bench_{self.run_id}_{label}_{self._count}"

    def _mysql_url(self, name: str) -> str:
        return MYSQL_ADMIN.rsplit("/", 1)[0] + "/" + name

    def template(self, dialect: str, count: int, keys: int) -> tuple[str, float]:
        """A database of ``dialect`` holding ``count`` PENDING messages; (url, seconds)."""
        import asyncio

        name = self._name("template")
        if dialect == "sqlite":
            url = f"sqlite:///{self.folder / name}.db"
            asyncio.run(_apply_schema(url))
            conn = open_connection(str(self.folder / f"{name}.db"))
            conn.isolation_level = "DEFERRED"  # enqueue_many in a transaction, as a writer would
            try:
                seconds = write_backlog(conn, count, keys)
                conn.execute("ANALYZE")
                conn.commit()
                conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            finally:
                conn.close()
            return url, seconds
        with _mysql(MYSQL_ADMIN, autocommit=True) as admin:
            admin.cursor().execute(f"CREATE DATABASE {name}")
        self.created.append(name)
        url = self._mysql_url(name)
        asyncio.run(_apply_schema(url))
        with _mysql(url) as conn:
            seconds = write_backlog(conn, count, keys)
            conn.cursor().execute("ANALYZE TABLE outbox")
        return url, seconds

    def clone(self, template: str) -> str:
        name = self._name("drain")
        if template.startswith("sqlite:"):
            source = Path(template.removeprefix("sqlite:///"))
            shutil.copyfile(source, self.folder / f"{name}.db")
            return f"sqlite:///{self.folder / name}.db"
        source = template.rsplit("/", 1)[1]
        with _mysql(MYSQL_ADMIN, autocommit=True) as admin:
            cursor = admin.cursor()
            cursor.execute(f"CREATE DATABASE {name}")
            self.created.append(name)
            cursor.execute(f"SHOW TABLES FROM {source}")
            for (table,) in cursor.fetchall():
                cursor.execute(f"CREATE TABLE {name}.{table} LIKE {source}.{table}")
                cursor.execute(  # generated columns compute themselves
                    "SELECT column_name FROM information_schema.columns WHERE table_schema = %s"
                    " AND table_name = %s AND is_generated = 'NEVER' ORDER BY ordinal_position",
                    (source, table),
                )
                columns = ", ".join(f"`{column}`" for (column,) in cursor.fetchall())
                cursor.execute(
                    f"INSERT INTO {name}.{table} ({columns}) SELECT {columns} FROM {source}.{table}"
                )
        return self._mysql_url(name)

    def drop(self, url: str) -> None:
        if url.startswith("sqlite:"):
            path = Path(url.removeprefix("sqlite:///"))
            for suffix in ("", "-wal", "-shm"):
                Path(f"{path}{suffix}").unlink(missing_ok=True)
            return
        name = url.rsplit("/", 1)[1]
        with _mysql(MYSQL_ADMIN, autocommit=True) as admin:
            admin.cursor().execute(f"DROP DATABASE IF EXISTS {name}")
        if name in self.created:
            self.created.remove(name)

    def drop_all(self) -> None:
        for name in list(self.created):
            self.drop(self._mysql_url(name))
        shutil.rmtree(self.folder, ignore_errors=True)


@contextlib.contextmanager
def _gate(url: str) -> Iterator[Any]:
    """Hold the destination's claim lock until the block's caller lets go (``release()``)."""
    if url.startswith("sqlite:"):
        conn = open_connection(url.removeprefix("sqlite:///"))
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
        finally:
            conn.close()
        return
    conn = _mysql(url)
    try:
        cursor = conn.cursor()
        cursor.execute(
            "INSERT IGNORE INTO outbox_destinations (destination) VALUES (%s)", (DESTINATION,)
        )
        conn.commit()
        cursor.execute(
            "SELECT destination FROM outbox_destinations WHERE destination = %s FOR UPDATE",
            (DESTINATION,),
        )
        yield conn
    finally:
        conn.close()


def _waiting(url: str, relays: list[RelayProcess], cpu: dict[int, float]) -> bool:
    """Whether every claim of the relays waits at the gate."""
    if url.startswith("sqlite:"):
        # No lock view: a relay that opened the file and used no CPU for 0.3 s waits on it.
        path = url.removeprefix("sqlite:///")
        for relay in relays:
            fds = Path(f"/proc/{relay.pid}/fd")
            if not any(os.path.realpath(fd) == os.path.realpath(path) for fd in fds.iterdir()):
                return False
            now = cpu_of(relay.pid)
            if cpu.get(relay.pid) != now:
                cpu[relay.pid] = now
                return False
        return True
    with _mysql(url, autocommit=True) as conn:
        cursor = conn.cursor()
        cursor.execute(
            "SELECT count(*) FROM information_schema.innodb_trx t "
            "JOIN information_schema.processlist p ON p.id = t.trx_mysql_thread_id "
            "WHERE t.trx_state = 'LOCK WAIT' AND p.db = DATABASE()"
        )
        row = cursor.fetchone()
    return bool(row and row[0] >= len(relays) * int(outboxer.Settings().concurrency))


def _finished(url: str) -> tuple[int, float, dict[str, int]]:
    """PUBLISHED rows, the epoch of the last settle, and every status's count."""
    if url.startswith("sqlite:"):
        conn = open_connection(url.removeprefix("sqlite:///"))
        try:
            published, last = conn.execute(
                "SELECT count(*), max(published_at) FROM outbox WHERE status = 'PUBLISHED'"
            ).fetchone()
            counts = dict(conn.execute("SELECT status, count(*) FROM outbox GROUP BY status"))
        finally:
            conn.close()
        return int(published), float(last or 0.0), counts
    with _mysql(url, autocommit=True) as conn:
        cursor = conn.cursor()
        cursor.execute("SET time_zone = '+00:00'")  # published_at is UTC_TIMESTAMP(6)
        cursor.execute(
            "SELECT count(*), UNIX_TIMESTAMP(max(published_at)) FROM outbox "
            "WHERE status = 'PUBLISHED'"
        )
        row = cursor.fetchone()
        cursor.execute("SELECT status, count(*) FROM outbox GROUP BY status")
        counts = {str(status): int(n) for status, n in cursor.fetchall()}
    return int(row[0]), float(row[1] or 0.0), counts


def drain(url: str, broker_url: str, timeout: float = 300.0) -> RelayRun:
    """One relay drains the table at ``url`` to ``broker_url``, timed from the gate's opening."""
    relay: RelayProcess | None = None
    with _gate(url) as gate:
        relay = RelayProcess(url, broker_url)
        try:
            deadline, cpu = time.monotonic() + 60, {}
            while not _waiting(url, [relay], cpu):
                if relay.reap():
                    raise RuntimeError(f"relay exited before the start:\n{relay.output()}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"relay did not reach its claim in 60 s:\n{relay.output()}")
                time.sleep(0.1)
            relay.mark()
            meter = BoxMeter().start()
            opened = time.time()
            gate.rollback()
        except BaseException:
            relay.close()
            raise
    try:
        while not relay.reap():
            if time.time() - opened > timeout:
                raise RuntimeError(f"relay still running after {timeout:.0f} s:\n{relay.output()}")
            time.sleep(0.05)
        box = meter.stop(client_cpu=relay.cpu_seconds)
        if relay.status != 0:
            raise RuntimeError(f"relay exited with {relay.status}:\n{relay.output()}")
        warnings = [
            line for line in relay.output().splitlines() if " WARNING " in line or " ERROR " in line
        ]
        published, last, counts = _finished(url)
    finally:
        relay.close()
    return RelayRun(published, max(last - opened, 1e-6), relay.cpu_seconds, counts, warnings, box)
