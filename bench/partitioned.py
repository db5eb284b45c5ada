"""The partitioned outbox beside the default table, in one run: write path, drain, retention.

    .venv/bin/python bench/partitioned.py [--writers 4] [--seconds 5] [--messages 20000]
                                          [--retained 1000000] [--runs 1] [--json out.json]

One private PostgreSQL 15 (fsync and synchronous_commit on, started on a free port and
stopped at the end), a fresh database per layout and section, the layouts interleaved:

* write: ``--writers`` connections commit a business INSERT plus one ``enqueue`` for
  ``--seconds`` (bench/pgmodes.py's write phase): commits/s, p50/p99 commit latency, WAL
  bytes per transaction;
* drain: ``--messages`` committed messages, then ``Relay.drain()`` into the memory broker
  (bench/pgmodes.py's drain phase): msg/s and the relay's WAL bytes per message. The
  partitioned table first gets the ``--past-days`` daily partitions (8) that a 7-day
  retention keeps behind today: each statement of the relay is planned over all of them;
* retention: ``--retained`` PUBLISHED rows eight to ten days old (one ``INSERT … SELECT …
  generate_series``, spread over three days), then ``outboxer.relay.cleanup`` with a
  7-day retention, as ``outboxer cleanup`` runs it: the default table DELETEs them in
  batches of ``cleanup_batch`` (1000), then needs a VACUUM for the dead rows (timed too);
  the partitioned one drops the two partitions wholly past retention. Seconds, WAL bytes,
  and the p99 commit latency of one writer committing meanwhile.

DELETE's cost grows with the rows; a DROP's does not (one per partition): the figures of
the README scale the measured DELETE to 10 million rows and say so.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg

import pgmodes
from outboxer.config import DAY, Settings
from outboxer.enqueue import Outbox
from outboxer.relay import cleanup
from outboxer.stores.pgpartitions import PartitionPolicy
from outboxer.stores.postgres import PostgresStore
from outboxer.streamtesting import private_postgres

LAYOUTS = ("table", "partitioned")

RETAINED_SQL = """
INSERT INTO outboxer.outbox (id, destination, topic, key, payload, content_type, headers,
                             status, attempts, next_attempt_at, created_at, updated_at,
                             published_at)
SELECT CAST(lpad(to_hex(g), 32, '0') AS uuid), 'default', 'orders.created',
       'customer-' || lpad(CAST(g %% 1000 AS text), 5, '0'),
       convert_to('{"order_id":' || g || ',"note":"' || repeat('x', 120) || '"}', 'UTF8'),
       'application/json', '{}', 'PUBLISHED', 1, t.at, t.at, t.at, t.at
FROM generate_series(1, %(count)s) AS g
CROSS JOIN LATERAL (
    SELECT date_trunc('day', now()) - interval '10 days'
           + (interval '3 days' - interval '1 second') * g / %(count)s AS at) AS t
"""


async def prepare(admin: str, layout: str) -> str:
    """A fresh database with an orders table and the outbox in ``layout``."""
    name = f"bench_{layout}_{uuid.uuid4().hex[:6]}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")  # type: ignore[arg-type]
    url = admin.rsplit("/", 1)[0] + "/" + name
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE TABLE orders (id bigserial PRIMARY KEY, body jsonb NOT NULL)")
    async with PostgresStore(url) as store:
        await store.apply_schema(partitioned=layout == "partitioned")
    return url


async def past_partitions(url: str, days: int) -> None:
    """Daily partitions back to ``days`` ago, as a partitioned outbox keeps through its
    retention: one PUBLISHED row of that day, which the upkeep moves into the partitions
    it makes for it (going back from today)."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO outboxer.outbox (id, topic, payload, content_type, status, "
            "created_at, updated_at) VALUES (gen_random_uuid(), 'seed', '', 'text/plain', "
            "'PUBLISHED', date_trunc('day', now()) - make_interval(days => %(days)s), "
            "date_trunc('day', now()) - make_interval(days => %(days)s))",
            {"days": days},
        )
    async with PostgresStore(url) as store:
        await store.maintain_partitions(PartitionPolicy())


async def retain(url: str, layout: str, count: int) -> float:
    """``count`` PUBLISHED rows 8 to 10 days old; seconds. The partitioned layout first gets
    partitions for those days."""
    if layout == "partitioned":
        await past_partitions(url, 10)
    started = time.perf_counter()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SET session_replication_role = replica")  # history: no wake-up per row
        conn.execute(RETAINED_SQL, {"count": count})  # type: ignore[arg-type]
        conn.execute("VACUUM (ANALYZE) outboxer.outbox")
        conn.execute("CHECKPOINT")
    return time.perf_counter() - started


def _commit_latencies(url: str, stop: threading.Event, latencies: list[float]) -> None:
    """One writer committing a business row and a message, over and over, until ``stop``."""
    outbox = Outbox()
    with psycopg.connect(url) as conn:
        while not stop.is_set():
            started = time.perf_counter()
            conn.execute("INSERT INTO orders (body) VALUES ('{}')")
            outbox.enqueue(conn, "order.placed", {"n": 1})
            conn.commit()
            latencies.append(time.perf_counter() - started)
            time.sleep(0.005)


async def retention_phase(
    url: str, layout: str, count: int, writer_seconds: float
) -> dict[str, float]:
    fill = await retain(url, layout, count)
    settings = Settings(published_retention=7 * DAY, abandoned_retention=7 * DAY)
    # The writer alone first: its latency, and the WAL of one of its commits, which the
    # cleanup's WAL figure then leaves out.
    baseline: list[float] = []
    stop = threading.Event()
    writer = threading.Thread(target=_commit_latencies, args=(url, stop, baseline))
    lsn = pgmodes._wal_lsn(url)
    writer.start()
    await asyncio.sleep(writer_seconds)
    stop.set()
    writer.join()
    wal_per_commit = pgmodes._wal_since(url, lsn) / max(1, len(baseline))
    during: list[float] = []
    stop = threading.Event()
    writer = threading.Thread(target=_commit_latencies, args=(url, stop, during))
    writer.start()
    lsn = pgmodes._wal_lsn(url)
    started = time.perf_counter()
    async with PostgresStore(url) as store:
        deleted = await cleanup(store, settings, max_batches=10**9)
    seconds = time.perf_counter() - started
    wal = pgmodes._wal_since(url, lsn) - len(during) * wal_per_commit
    vacuum = 0.0
    if layout == "table":  # the dead rows are the DELETE's bill, paid now or by autovacuum
        started = time.perf_counter()
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("VACUUM outboxer.outbox")
        vacuum = time.perf_counter() - started
    stop.set()
    writer.join()
    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT count(*) FROM outboxer.outbox WHERE created_at < now() - interval '7 days'"
        ).fetchone()
    left = int(row[0]) if row else -1
    baseline.sort()
    during.sort()
    return {
        "retained": count,
        "fill_seconds": round(fill, 1),
        "deleted": deleted,
        "left": left,
        "cleanup_seconds": round(seconds, 3),
        "vacuum_seconds": round(vacuum, 2),
        "wal_bytes": round(max(0.0, wal)),
        "writer_p99_ms_before": round(baseline[int(len(baseline) * 0.99)] * 1000, 2),
        "writer_p99_ms_during": round(during[int(len(during) * 0.99)] * 1000, 2),
        "writer_max_ms_during": round(during[-1] * 1000, 2),
    }


def _median(runs: list[dict[str, dict[str, dict[str, float]]]]) -> dict[str, Any]:
    return {
        layout: {
            phase: {
                name: round(statistics.median(run[layout][phase][name] for run in runs), 3)
                for name in values
            }
            for phase, values in phases.items()
        }
        for layout, phases in runs[0].items()
    }


async def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--writers", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--retained", type=int, default=1_000_000)
    parser.add_argument(
        "--past-days",
        type=int,
        default=8,
        help="daily partitions behind today during the drain, as a 7-day retention keeps",
    )
    parser.add_argument(
        "--writer-seconds",
        type=float,
        default=2.0,
        help="how long the retention section's writer commits alone, before the cleanup",
    )
    parser.add_argument("--runs", type=int, default=1, help="figures are the median of the runs")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    runs: list[dict[str, dict[str, dict[str, float]]]] = []
    with private_postgres(fsync=True) as admin:
        for run in range(args.runs):
            figures: dict[str, dict[str, dict[str, float]]] = {layout: {} for layout in LAYOUTS}
            for phase in ("write", "drain", "retention"):
                for layout in LAYOUTS:  # interleaved: a noisy minute hits both
                    print(f"partitioned: run {run + 1}: {phase} {layout} ...", file=sys.stderr)
                    url = await prepare(admin, layout)
                    if phase == "write":
                        result = await pgmodes.write_phase(url, "table", args.writers, args.seconds)
                    elif phase == "drain":
                        if layout == "partitioned":
                            await past_partitions(url, args.past_days)
                        result = await pgmodes.drain_phase(url, "table", args.messages)
                    else:
                        result = await retention_phase(
                            url, layout, args.retained, args.writer_seconds
                        )
                    figures[layout][phase] = result
                    pgmodes.discard(admin, url)
            runs.append(figures)
    results = _median(runs)
    table, parted = results["table"], results["partitioned"]
    print(f"{'':<34} {'table':>12} {'partitioned':>12} {'ratio':>7}")
    rows = [
        ("write commits/s", "write", "commits_per_s"),
        ("write p50 ms", "write", "p50_ms"),
        ("write p99 ms", "write", "p99_ms"),
        ("write WAL bytes/tx", "write", "wal_bytes_per_tx"),
        ("drain msg/s", "drain", "msgs_per_s"),
        ("drain relay WAL bytes/msg", "drain", "relay_wal_bytes_per_msg"),
        ("retention: cleanup s", "retention", "cleanup_seconds"),
        ("retention: VACUUM after it s", "retention", "vacuum_seconds"),
        ("retention: WAL bytes", "retention", "wal_bytes"),
        ("retention: rows left past 7 d", "retention", "left"),
        ("writer p99 ms before cleanup", "retention", "writer_p99_ms_before"),
        ("writer p99 ms during cleanup", "retention", "writer_p99_ms_during"),
        ("writer max ms during cleanup", "retention", "writer_max_ms_during"),
    ]
    for label, phase, name in rows:
        left, right = table[phase][name], parted[phase][name]
        ratio = f"{right / left:.2f}" if left else "-"
        print(f"{label:<34} {left:>12,} {right:>12,} {ratio:>7}")
    print(
        f"retained rows: {args.retained:,} (fill {table['retention']['fill_seconds']} s / "
        f"{parted['retention']['fill_seconds']} s); 10 million would take the DELETE about "
        f"{table['retention']['cleanup_seconds'] * 10_000_000 / args.retained:,.0f} s "
        "(it grows with the rows), the DROP about the same as here"
    )
    if args.json:
        report = json.dumps({"args": vars(args), "results": results}, indent=2)
        Path(args.json).write_text(report, encoding="utf-8")  # noqa: ASYNC240 (once, at the end)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))
