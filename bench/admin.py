"""Operators' changes at scale: replay, purge and their dry runs against the write path.

    .venv/bin/python bench/admin.py [--rows 20000] [--keys 1000] [--databases postgres,mysql,sqlite]

Per database, in one run: enqueue ``--rows`` messages over ``--keys`` keys with
``enqueue_many`` (the write path, batches of 500: the baseline), mark them PUBLISHED, then
time a dry run of ``replay --all`` (a count), the replay itself (one transaction: key
locks, the originals read a page at a time, the copies inserted), ``purge --dry-run`` and
the purge of the copies. Prints seconds, rows per second and replay / enqueue_many.

PostgreSQL holds one advisory lock per key copied until the replay commits, up to 1,000
keys (``Outbox.max_key_locks``); a replay of more locks the table instead: ``--keys 5000``
measures that path.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sqlite3
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import outboxer
from outboxer import admin
from outboxer.admin import MessageFilter
from outboxer.stores import create_store

PG_ADMIN = os.environ.get("OUTBOXER_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
MYSQL_ADMIN = os.environ.get("OUTBOXER_TEST_MYSQL", "mysql://root@127.0.0.1:3306/test")
WRITE_BATCH = 500


def fresh(kind: str, workdir: Path) -> tuple[str, Callable[[], Any], Callable[[], None]]:
    """A new empty database of ``kind``: its URL, a DB-API connect, and its drop."""
    name = f"outboxer_bench_admin_{uuid.uuid4().hex[:8]}"
    if kind == "sqlite":
        path = workdir / f"{name}.db"
        return f"sqlite:///{path}", lambda: sqlite3.connect(path), lambda: None
    if kind == "mysql":
        import pymysql

        from outboxer.stores.mysql import mysql_connect_args

        admin_args = mysql_connect_args(MYSQL_ADMIN)
        with pymysql.connect(**admin_args, autocommit=True) as conn:
            conn.cursor().execute(f"CREATE DATABASE {name}")
        url = MYSQL_ADMIN.rsplit("/", 1)[0] + "/" + name

        def drop_mysql() -> None:
            with pymysql.connect(**admin_args, autocommit=True) as conn:
                conn.cursor().execute(f"DROP DATABASE IF EXISTS {name}")

        return url, lambda: pymysql.connect(**mysql_connect_args(url)), drop_mysql
    import psycopg

    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    url = PG_ADMIN.rsplit("/", 1)[0] + "/" + name

    def drop_pg() -> None:
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")

    return url, lambda: psycopg.connect(url), drop_pg


async def measure(kind: str, rows: int, keys: int, workdir: Path) -> dict[str, float]:
    url, connect, drop = fresh(kind, workdir)
    try:
        async with create_store(url) as store:
            await store.apply_schema()
        conn = connect()
        started = time.perf_counter()
        for start in range(0, rows, WRITE_BATCH):
            outboxer.enqueue_many(
                conn,
                [
                    {"topic": "order.placed", "payload": {"n": n}, "key": f"k{n % keys}"}
                    for n in range(start, min(rows, start + WRITE_BATCH))
                ],
            )
            conn.commit()
        figures = {"enqueue_many": time.perf_counter() - started}
        conn.cursor().execute(
            f"UPDATE {'outboxer.outbox' if kind == 'postgres' else 'outbox'} "
            "SET status = 'PUBLISHED'"
        )
        conn.commit()
        conn.close()
        async with create_store(url) as store:
            everything, copies = MessageFilter(), MessageFilter(statuses=("PENDING",))
            steps: tuple[tuple[str, Callable[[], Any]], ...] = (
                (
                    "replay dry run",
                    lambda: admin.replay(store, everything, everything=True, dry_run=True),
                ),
                ("replay", lambda: admin.replay(store, everything, everything=True)),
                ("purge dry run", lambda: admin.purge(store, copies, dry_run=True)),
                ("purge", lambda: admin.purge(store, copies)),
            )
            for label, step in steps:
                started = time.perf_counter()
                result = await step()
                figures[label] = time.perf_counter() - started
                assert result.count == rows, (label, result)
        return figures
    finally:
        drop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--keys", type=int, default=1_000)
    parser.add_argument("--databases", default="postgres,mysql,sqlite")
    args = parser.parse_args()
    print(f"{args.rows} rows over {args.keys} keys; load average {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory() as workdir:
        for kind in args.databases.split(","):
            figures = asyncio.run(measure(kind, args.rows, args.keys, Path(workdir)))
            print(f"\n{kind}")
            for label, seconds in figures.items():
                print(f"  {label:<16} {seconds:8.3f} s  {args.rows / seconds:>10,.0f} rows/s")
            ratio = figures["replay"] / figures["enqueue_many"]
            print(f"  replay / enqueue_many (same rows): {ratio:.2f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
