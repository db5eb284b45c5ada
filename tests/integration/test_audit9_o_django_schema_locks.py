"""Django's ``migrate`` of outboxer's app takes the locks ``outboxer schema apply`` takes:
PostgreSQL's schema-wide advisory lock (another table's apply in the same schema creates the
shared objects) and MySQL's GET_LOCK (two deploys migrating at once ran the same ALTERs).

Each test holds the lock as another apply would, starts ``migrate`` in a subprocess (Django's
settings are process-wide), sees it wait for that very lock, then releases it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable

import psycopg
import pytest

from tests.conftest import mysql_connect
from tests.contrib.test_django import ROOT, SETTINGS, empty_pg_url

__all__ = ["empty_pg_url"]  # the fixture, imported for pytest


def schema_lock_name(database: str, table: str) -> str:
    """mysql.schema_lock_name, spelt out: the name `outboxer schema apply` has always used."""
    return f"outboxer:schema:{database}.{table}"[:64]


def start_migrate(url: str) -> subprocess.Popen[str]:
    """``migrate outboxer`` in the test project; PYTHONPATH kept (a run on an old copy)."""
    path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p)
    env = dict(os.environ, OUTBOXER_TEST_DJANGO_DB=url, PYTHONPATH=path)
    return subprocess.Popen(
        [sys.executable, "-m", "django", "migrate", "outboxer", f"--settings={SETTINGS}"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_until_blocked(process: subprocess.Popen[str], blocked: Callable[[], bool]) -> None:
    """Return once ``blocked()`` says migrate waits for the lock; fail if it ends first."""
    deadline = time.monotonic() + 60
    while not blocked():
        if process.poll() is not None:
            output = process.stdout.read() if process.stdout else ""
            pytest.fail(
                f"migrate ran while the lock was held (exit {process.returncode})\n{output}"
            )
        assert time.monotonic() < deadline, "migrate neither waited nor ended"
        time.sleep(0.02)


def finish(process: subprocess.Popen[str]) -> None:
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 0, output


def test_postgres_migrate_waits_for_the_schema_wide_lock(empty_pg_url: str) -> None:
    with psycopg.connect(empty_pg_url, autocommit=True) as holder:
        # An `outboxer schema apply` of another table of the schema, mid-way.
        holder.execute("SELECT pg_advisory_lock(hashtextextended('outboxer-schema:outboxer', 0))")
        process = start_migrate(empty_pg_url)
        try:

            def blocked() -> bool:
                row = holder.execute(
                    "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid) "
                    "WHERE l.locktype = 'advisory' AND NOT l.granted "
                    "AND a.datname = current_database()"
                ).fetchone()
                return bool(row and row[0])

            wait_until_blocked(process, blocked)
            holder.execute("SELECT pg_advisory_unlock_all()")
            finish(process)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    with psycopg.connect(empty_pg_url) as conn:
        assert conn.execute("SELECT count(*) FROM outboxer.outbox_migrations").fetchone()


def test_mysql_migrate_waits_for_the_schema_apply_lock(mysql_empty_url: str) -> None:
    holder = mysql_connect(mysql_empty_url, autocommit=True)
    try:
        with holder.cursor() as cursor:
            cursor.execute("SELECT DATABASE(), CONNECTION_ID()")
            database, own = cursor.fetchone()
            # Another `migrate` or `outboxer schema apply` of this outbox, mid-way.
            cursor.execute("SELECT GET_LOCK(%s, 0)", (schema_lock_name(database, "outbox"),))
            assert cursor.fetchone()[0] == 1
        process = start_migrate(mysql_empty_url)
        try:

            def blocked() -> bool:
                with holder.cursor() as cursor:
                    cursor.execute(
                        "SELECT COUNT(*) FROM information_schema.PROCESSLIST "
                        "WHERE DB = %s AND ID <> %s AND INFO LIKE 'SELECT GET_LOCK%%'",
                        (database, own),
                    )
                    return bool(cursor.fetchone()[0])

            wait_until_blocked(process, blocked)
            with holder.cursor() as cursor:
                cursor.execute("SELECT RELEASE_LOCK(%s)", (schema_lock_name(database, "outbox"),))
            finish(process)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        with holder.cursor() as cursor:
            cursor.execute("SELECT COUNT(*) FROM outbox_migrations")
            assert cursor.fetchone()[0] > 0
    finally:
        holder.close()
