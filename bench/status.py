"""Status on a big table: ``status``, ``/status``, ``/metrics``, the message lists and the
dashboard, against the old whole-table queries as the control.

    .venv/bin/python bench/status.py [--rows 5000000] [--only postgres,mariadb,sqlite]
                                     [--mysql-rows 500000] [--sqlite-rows 1000000]
                                     [--backlog 3000] [--json out.json]

Each database gets a fresh outbox (the schema of ``outboxer schema apply``) holding ``--rows``
PUBLISHED rows, written by one ``INSERT … SELECT`` (PostgreSQL: generate_series into the
table made UNLOGGED for the load, every index in place; ids time-ordered as outboxer's are;
~100-byte payloads; 70 % for destination ``default``, 30 % ``partner``, in runs of 1,000
rows; 0.1 % needed a second attempt), then a real backlog (``--backlog``) written by
``enqueue_many`` and taken through the store: PENDING, PROCESSING, FAILED and ABANDONED
rows. PostgreSQL then
gets ``VACUUM (ANALYZE)``, what autovacuum does to a table that grew. Every figure is the
median (and max) of ``--repeat`` calls through the real code paths (the store; the HTTP
API's handler with its status cache off), in ms; the control runs the queries this release
replaced: the GROUP BY over the whole table (``Store.status`` on a table it counts row by
row) and the old lists (``status = ANY(…) ORDER BY seq``; the dashboard read 1,000 rows of
it). The target: status under 50 ms on PostgreSQL with 5 million PUBLISHED rows. The last
lines compare the estimated PUBLISHED counts with the exact ones. Every database and file
the bench creates is dropped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import psycopg
import pymysql

from harness import Databases, log, write_backlog
from outboxer.config import load_settings
from outboxer.http import HttpApi, Request
from outboxer.stores import Failure, Store, create_store
from outboxer.stores.mysql import mysql_connect_args
from outboxer.stores.sqlite import open_connection

MYSQL_ADMIN = os.environ.get("OUTBOXER_BENCH_MYSQL", "mysql://root@127.0.0.1:3306/test")
TARGET_MS = 50.0
#: The backlog (--backlog): rows written by enqueue_many; a third of them are claimed, and
#: of those 30 % fail, 10 % are abandoned and the rest stay in flight.
BACKLOG = 3000

# One row per n: ids time-ordered (the id's text sorts as n), destinations in runs of 1,000
# (70 % default), 0.1 % retried once, settled a day ago (before the backlog) in batches of
# 500 rows, each batch at its own moment, as a relay settles them.
PG_HISTORY = """
INSERT INTO outboxer.outbox (id, destination, topic, key, payload, content_type, status,
                             attempts, next_attempt_at, created_at, updated_at, published_at)
SELECT CAST(lpad(to_hex(n), 32, '0') AS uuid),
       CASE WHEN n / 1000 %% 10 < 7 THEN 'default' ELSE 'partner' END,
       'orders.created', 'customer-' || n %% 2000,
       convert_to('{"order_id":' || n || ',"note":"' || repeat('x', 70) || '"}', 'UTF8'),
       'application/json', 'PUBLISHED', CASE WHEN n %% 1000 = 0 THEN 1 ELSE 0 END,
       now() - interval '1 day', now() - interval '1 day',
       now() - interval '1 day' + n / 500 * interval '1 ms',
       now() - interval '1 day' + n / 500 * interval '1 ms'
FROM generate_series(1, %(rows)s) AS n
"""
MYSQL_HISTORY = """
INSERT INTO outbox (id, destination, topic, `key`, payload, content_type, status, attempts,
                    next_attempt_at, created_at, updated_at, published_at)
SELECT CONCAT('00000000-0000-0000-0000-', LPAD(HEX(n), 12, '0')),
       IF(n DIV 1000 %% 10 < 7, 'default', 'partner'), 'orders.created',
       CONCAT('customer-', n %% 2000),
       CONCAT('{"order_id":', n, ',"note":"', REPEAT('x', 70), '"}'), 'application/json',
       'PUBLISHED', IF(n %% 1000 = 0, 1, 0),
       UTC_TIMESTAMP(6) - INTERVAL 1 DAY, UTC_TIMESTAMP(6) - INTERVAL 1 DAY,
       UTC_TIMESTAMP(6) - INTERVAL 1 DAY + INTERVAL n DIV 500 * 1000 MICROSECOND,
       UTC_TIMESTAMP(6) - INTERVAL 1 DAY + INTERVAL n DIV 500 * 1000 MICROSECOND
FROM (SELECT {number} + 1 AS n FROM {digits}) AS numbers
WHERE n <= %(rows)s
ORDER BY n
"""
SQLITE_HISTORY = """
WITH RECURSIVE numbers(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM numbers WHERE n < :rows)
INSERT INTO outbox (id, destination, topic, key, payload, content_type, status, attempts,
                    next_attempt_at, created_at, updated_at, published_at)
SELECT printf('00000000-0000-0000-0000-%012x', n),
       CASE WHEN n / 1000 % 10 < 7 THEN 'default' ELSE 'partner' END, 'orders.created',
       'customer-' || n % 2000,
       CAST('{"order_id":' || n || ',"note":"' || printf('%.70c', 'x') || '"}' AS BLOB),
       'application/json', 'PUBLISHED', CASE WHEN n % 1000 = 0 THEN 1 ELSE 0 END,
       (julianday('now') - 2440587.5) * 86400.0 - 86400,
       (julianday('now') - 2440587.5) * 86400.0 - 86400,
       (julianday('now') - 2440587.5) * 86400.0 - 86400 + n / 500 * 0.001,
       (julianday('now') - 2440587.5) * 86400.0 - 86400 + n / 500 * 0.001
FROM numbers
"""

# The queries this release replaced, as the control.
OLD_LIST = {
    "postgres": "SELECT seq, id, destination, topic, key, status, attempts, last_error, "
    "locked_by, created_at, updated_at, next_attempt_at, published_at FROM outboxer.outbox "
    "WHERE status = ANY(%(statuses)s) ORDER BY seq LIMIT %(limit)s",
    "mariadb": "SELECT seq, id, destination, topic, `key`, status, attempts, last_error, "
    "locked_by, created_at, updated_at, next_attempt_at, published_at FROM outbox "
    "WHERE status IN %(statuses)s ORDER BY seq LIMIT %(limit)s",
    "sqlite": "SELECT seq, id, destination, topic, key, status, attempts, last_error, "
    "locked_by, created_at, updated_at, next_attempt_at, published_at FROM outbox "
    "WHERE status IN (SELECT value FROM json_each(:statuses)) ORDER BY seq LIMIT :limit",
}


def load_history(dialect: str, url: str, rows: int) -> float:
    """``rows`` PUBLISHED rows in one INSERT … SELECT; seconds."""
    started = time.perf_counter()
    if dialect == "postgres":
        with psycopg.connect(url, autocommit=True) as conn:
            # The load only: no WAL for 5 million rows (the read plans are the same).
            conn.execute("ALTER TABLE outboxer.outbox SET UNLOGGED")
            conn.execute("SET session_replication_role = replica")  # no wake-up trigger per row
            conn.execute(PG_HISTORY, {"rows": rows})  # type: ignore[arg-type]
    elif dialect == "mariadb":
        # 0 .. 10^places - 1 from a cross join of digit tables (MySQL has no generate_series).
        places = len(str(max(rows - 1, 1)))
        digit = "(" + " UNION ALL ".join(f"SELECT {d} AS d" for d in range(10)) + ")"
        digits = ", ".join(f"{digit} AS p{i}" for i in range(places))
        number = " + ".join(f"{10**i} * p{i}.d" for i in range(places))
        sql = MYSQL_HISTORY.replace("{digits}", digits).replace("{number}", number)
        with pymysql.connect(**mysql_connect_args(url), autocommit=True) as conn:
            conn.cursor().execute(sql, {"rows": rows})
    else:
        conn = open_connection(url.removeprefix("sqlite:///"))
        try:
            conn.execute(SQLITE_HISTORY, {"rows": rows})
        finally:
            conn.close()
    return time.perf_counter() - started


def write_real_backlog(dialect: str, url: str, count: int) -> None:
    """``count`` rows through enqueue_many, on the dialect's own driver."""
    if dialect == "postgres":
        with psycopg.connect(url) as conn:
            write_backlog(conn, count, 500)
    elif dialect == "mariadb":
        with pymysql.connect(**mysql_connect_args(url)) as conn:
            write_backlog(conn, count, 500)
    else:
        conn = open_connection(url.removeprefix("sqlite:///"))
        conn.isolation_level = "DEFERRED"  # enqueue_many in a transaction, as a writer would
        try:
            write_backlog(conn, count, 500)
        finally:
            conn.close()


async def take_some(store: Store, backlog: int) -> None:
    """Claim a third of the backlog: 30 % of it fails, 10 % is abandoned, the rest stays in
    flight."""
    claimed = await store.claim("default", "bench", max(backlog // 3, 1), 600.0, False)
    seqs = [m.stored_seq for m in claimed]
    failed, abandoned = len(seqs) * 3 // 10, len(seqs) // 10
    failures = [Failure(seq, "broker said no", 600.0, False) for seq in seqs[:failed]]
    failures += [Failure(seq, "rejected", 0.0, True) for seq in seqs[failed : failed + abandoned]]
    await store.settle("default", claimed.lease, [], failures, [], 5)


def analyze(dialect: str, url: str) -> float:
    started = time.perf_counter()
    if dialect == "postgres":
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("VACUUM (ANALYZE) outboxer.outbox")
    return time.perf_counter() - started


async def timed(
    call: Callable[[], Awaitable[Any]], repeat: int, *, warm: bool = True
) -> list[float]:
    if warm:
        await call()  # connections, caches, prepared statements
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        await call()
        times.append(1000 * (time.perf_counter() - started))
    return times


def old_list_call(dialect: str, url: str, statuses: list[str], limit: int) -> Callable[[], Any]:
    sql = OLD_LIST[dialect]

    async def call() -> None:
        def run() -> None:
            if dialect == "postgres":
                with psycopg.connect(url) as conn:
                    conn.execute(sql, {"statuses": statuses, "limit": limit}).fetchall()  # type: ignore[arg-type]
            elif dialect == "mariadb":
                with pymysql.connect(**mysql_connect_args(url)) as conn, conn.cursor() as cursor:
                    cursor.execute(sql, {"statuses": statuses, "limit": limit})
                    cursor.fetchall()
            else:
                conn = open_connection(url.removeprefix("sqlite:///"))
                try:
                    conn.execute(sql, {"statuses": json.dumps(statuses), "limit": limit}).fetchall()
                finally:
                    conn.close()

        await asyncio.to_thread(run)

    return call


async def measure(dialect: str, url: str, repeat: int, controls: int) -> dict[str, Any]:
    store = create_store(url)
    api_store = create_store(url)  # the API has a store of its own, as in a relay
    api = HttpApi(api_store, load_settings({"db": url}, environ={}), status_cache_seconds=0.0)
    exact_store = create_store(url)
    exact_store.exact_status_rows = 10**12  # counts row by row: the old GROUP BY
    figures: dict[str, Any] = {}

    def get(path: str, **query: str) -> Callable[[], Awaitable[Any]]:
        async def call() -> None:
            response = await api.handle(
                Request("GET", path, {name: [value] for name, value in query.items()})
            )
            assert response.status == 200, response.body[:200]

        return call

    async with store, exact_store:
        try:
            calls: dict[str, Callable[[], Awaitable[Any]]] = {
                "status": store.status,
                "status_report": store.status_report,
                "GET /status": get("/status"),
                "GET /metrics": get("/metrics"),
                "list FAILED,ABANDONED 20": lambda: store.list_messages(
                    ["FAILED", "ABANDONED"], 20
                ),
                "list PUBLISHED 50": lambda: store.list_messages(["PUBLISHED"], 50),
                "list every status 1000": lambda: store.list_messages(
                    ["PENDING", "PROCESSING", "FAILED", "ABANDONED", "PUBLISHED"], 1000
                ),
                "GET / (dashboard)": get("/"),
            }
            for name, call in calls.items():
                figures[name] = await timed(call, repeat)
                log(f"  {dialect} {name}: {statistics.median(figures[name]):.2f} ms")
            controls_calls: dict[str, Callable[[], Awaitable[Any]]] = {
                "control: status, GROUP BY over the table": exact_store.status,
                "control: old list FAILED,ABANDONED 1000 (dashboard)": old_list_call(
                    dialect, url, ["FAILED", "ABANDONED"], 1000
                ),
                "control: old list PUBLISHED 50": old_list_call(dialect, url, ["PUBLISHED"], 50),
            }
            for name, call in controls_calls.items():
                # Seconds each on a big table: not warmed, its first run counts.
                figures[name] = await timed(call, controls, warm=False)
                log(f"  {dialect} {name}: {statistics.median(figures[name]):.1f} ms")
            estimated = {entry.destination: entry for entry in await store.status()}
            exact = {entry.destination: entry for entry in await exact_store.status()}
            figures["estimates"] = {
                name: {
                    "estimated": estimated[name].counts.get("PUBLISHED", 0),
                    "exact": entry.counts.get("PUBLISHED", 0),
                    "flagged": estimated[name].published_estimated,
                    "others_equal": {
                        s: n for s, n in estimated[name].counts.items() if s != "PUBLISHED"
                    }
                    == {s: n for s, n in entry.counts.items() if s != "PUBLISHED"},
                }
                for name, entry in exact.items()
            }
        finally:
            await api_store.close()
    return figures


def report(dialect: str, rows: int, backlog: int, figures: dict[str, Any]) -> None:
    print(f"\n{dialect}: {rows:,} PUBLISHED rows + a backlog of {backlog:,}")
    print(f"{'figure':58} {'median ms':>10} {'max ms':>9}  target")
    for name, values in figures.items():
        if name == "estimates":
            continue
        median = statistics.median(values)
        verdict = ""
        if dialect == "postgres" and name in (
            "status",
            "status_report",
            "GET /status",
            "GET /metrics",
        ):
            verdict = f"< {TARGET_MS:g}: {'pass' if median < TARGET_MS else 'FAIL'}"
        print(f"{name:58} {median:10.2f} {max(values):9.2f}  {verdict}")
    control = statistics.median(figures["control: status, GROUP BY over the table"])
    print(
        f"{'ratio: control GROUP BY / status':58} {control / statistics.median(figures['status']):10.0f}x"
    )
    for name, numbers in figures["estimates"].items():
        error = (numbers["estimated"] - numbers["exact"]) / max(numbers["exact"], 1)
        print(
            f"PUBLISHED {name:9} estimated {numbers['estimated']:>10,} exact {numbers['exact']:>10,} "
            f"({error:+.2%}); flagged {numbers['flagged']}; other counts equal: {numbers['others_equal']}"
        )


def run_dialect(
    dialect: str,
    rows: int,
    args: argparse.Namespace,
    run_id: str,
    cleanup: list[Callable[[], None]],
) -> dict[str, Any]:
    if dialect == "postgres":
        dbs = Databases()
        dbs.run_id = run_id  # outboxer_bench_<run_id>_…, as the MariaDB database
        cleanup.append(dbs.drop_all)
        url = dbs.empty("status")
    elif dialect == "mariadb":
        name = f"outboxer_bench_{run_id}_status"
        admin_args = mysql_connect_args(MYSQL_ADMIN)
        with pymysql.connect(**admin_args, autocommit=True) as admin:
            admin.cursor().execute(f"CREATE DATABASE {name}")

        def drop() -> None:
            with pymysql.connect(**admin_args, autocommit=True) as admin:
                admin.cursor().execute(f"DROP DATABASE IF EXISTS {name}")

        cleanup.append(drop)
        url = MYSQL_ADMIN.rsplit("/", 1)[0] + "/" + name
    else:
        folder = Path(tempfile.mkdtemp(prefix="outboxer-bench-status-"))
        cleanup.append(lambda: shutil.rmtree(folder, ignore_errors=True))
        url = f"sqlite:///{folder / 'outbox.db'}"

    async def prepare() -> None:
        store = create_store(url)
        async with store:
            await store.apply_schema()

    asyncio.run(prepare())
    log(f"{dialect}: writing {rows:,} PUBLISHED rows (one INSERT … SELECT)")
    seconds = load_history(dialect, url, rows)
    log(f"  {seconds:.1f} s")
    write_real_backlog(dialect, url, args.backlog)

    async def backlog() -> None:
        store = create_store(url)
        async with store:
            await take_some(store, args.backlog)

    asyncio.run(backlog())
    log(f"  analysed in {analyze(dialect, url):.1f} s")
    return asyncio.run(measure(dialect, url, args.repeat, args.controls))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=5_000_000, help="PostgreSQL's PUBLISHED rows")
    parser.add_argument("--mysql-rows", type=int, default=500_000)
    parser.add_argument("--sqlite-rows", type=int, default=1_000_000)
    parser.add_argument("--only", default="postgres,mariadb,sqlite")
    parser.add_argument("--backlog", type=int, default=BACKLOG, help="unfinished rows")
    parser.add_argument("--repeat", type=int, default=20, help="calls per figure")
    parser.add_argument("--controls", type=int, default=2, help="calls per control figure")
    parser.add_argument("--json", help="write every figure here")
    args = parser.parse_args()
    sizes = {"postgres": args.rows, "mariadb": args.mysql_rows, "sqlite": args.sqlite_rows}
    cleanup: list[Callable[[], None]] = []
    run_id = uuid.uuid4().hex[:8]
    results: dict[str, Any] = {"meta": {"run_id": run_id, "rows": sizes}}
    started = time.perf_counter()
    try:
        for dialect in args.only.split(","):
            results[dialect] = run_dialect(dialect, sizes[dialect], args, run_id, cleanup)
            report(dialect, sizes[dialect], args.backlog, results[dialect])
    finally:
        for step in reversed(cleanup):
            try:
                step()
            except Exception as exc:  # report it, and go on dropping the rest
                log(f"could not clean up: {exc}")
    print(
        f"\nwhole bench {time.perf_counter() - started:.0f} s; load average {os.getloadavg()[0]:.1f}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
