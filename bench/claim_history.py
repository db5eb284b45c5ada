"""Claim cost with a long published history retained (no retention), against none.

    .venv/bin/python bench/claim_history.py [--history 10000000] [--backlog 20000]

Two fresh PostgreSQL databases get the same backlog (bench/run.py's rows, ``enqueue_many``);
one also holds ``--history`` PUBLISHED rows in front of it, written by one
``INSERT … SELECT … FROM generate_series`` (time-ordered ids, as outboxer's are; ~150-byte
payloads, over the backlog's keys; triggers off for the load: these rows are history, no
relay waits for them), then ``VACUUM ANALYZE`` (what autovacuum does to such a table). The
bench then claims and settles batches of 500 on both, alternating batch by batch, through
``PostgresStore`` (the relay's SQL), and prints the claim's and the settle's latency on
each: median, p90 and max, in ms. Flat means the same on both.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from typing import Any

import psycopg

import outboxer
from harness import Databases, log, percentile, prefill
from outboxer.stores.postgres import PostgresStore

BATCH = 500
DESTINATION = "default"

HISTORY_SQL = """
INSERT INTO outboxer.outbox (id, destination, topic, key, payload, content_type, headers,
                             status, attempts, next_attempt_at, created_at, updated_at,
                             published_at)
SELECT CAST(lpad(to_hex(g), 32, '0') AS uuid), 'default', 'orders.created',
       'customer-' || lpad(CAST(g %% %(keys)s AS text), 5, '0'),
       convert_to('{"order_id":' || g || ',"note":"' || repeat('x', 120) || '"}', 'UTF8'),
       'application/json', '{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}',
       'PUBLISHED', 1, now() - interval '2 days', now() - interval '2 days',
       now() - interval '1 day', now() - interval '1 day'
FROM generate_series(1, %(count)s) AS g
"""


def build_history(url: str, count: int, keys: int) -> float:
    """``count`` PUBLISHED rows in one INSERT … SELECT; seconds."""
    started = time.perf_counter()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SET session_replication_role = replica")  # no wake-up trigger per row
        conn.execute(HISTORY_SQL, {"count": count, "keys": keys})  # type: ignore[arg-type]
    return time.perf_counter() - started


def vacuum(url: str) -> float:
    started = time.perf_counter()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("VACUUM (ANALYZE) outboxer.outbox")
        conn.execute("CHECKPOINT")
    return time.perf_counter() - started


def size(url: str) -> str:
    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT pg_size_pretty(pg_total_relation_size('outboxer.outbox'))"
        ).fetchone()
    return str(row[0]) if row else "?"


async def alternate(urls: dict[str, str]) -> dict[str, dict[str, list[float]]]:
    """Claim and settle a batch on each database in turn until both are drained."""
    stores = {name: PostgresStore(url) for name, url in urls.items()}
    max_attempts = outboxer.Settings().max_attempts
    times: dict[str, dict[str, list[float]]] = {n: {"claim": [], "settle": []} for n in urls}
    for store in stores.values():
        await store.connect()
    try:
        active = set(stores)
        while active:
            for name in list(stores):
                if name not in active:
                    continue
                store = stores[name]
                started = time.perf_counter()
                claimed: Any = await store.claim(DESTINATION, "bench", BATCH, 60.0, False)
                claimed_at = time.perf_counter()
                if not claimed:
                    active.discard(name)
                    continue
                seqs = [m.stored_seq for m in claimed]
                await store.settle(DESTINATION, claimed.lease, seqs, [], [], max_attempts)
                times[name]["claim"].append(1000 * (claimed_at - started))
                times[name]["settle"].append(1000 * (time.perf_counter() - claimed_at))
    finally:
        for store in stores.values():
            await store.close()
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--history", type=int, default=10_000_000)
    parser.add_argument("--backlog", type=int, default=20_000)
    parser.add_argument("--keys", type=int, default=2_000)
    args = parser.parse_args()
    dbs = Databases()
    try:
        urls = {"none": dbs.empty("nohistory"), "history": dbs.empty("history")}
        log(f"writing {args.history:,} PUBLISHED rows (one INSERT … SELECT generate_series)")
        load = os.getloadavg()[0]
        built = build_history(urls["history"], args.history, args.keys)
        log(f"  {built:.1f} s ({args.history / built:,.0f} rows/s), load average {load:.1f}")
        for name, url in urls.items():
            seconds = prefill(url, args.backlog, args.keys)
            log(f"{name}: backlog of {args.backlog:,} in {seconds:.1f} s")
            log(f"{name}: VACUUM ANALYZE {vacuum(url):.1f} s; outbox {size(url)}")
        load = os.getloadavg()[0]
        times = asyncio.run(alternate(urls))
        print(
            f"history {args.history:,} PUBLISHED rows built in {built:.1f} s; backlog "
            f"{args.backlog:,}; batch {BATCH}; load average {load:.1f} -> {os.getloadavg()[0]:.1f}"
        )
        print("history      statement  batches  median ms  p90 ms  max ms")
        for name, kinds in times.items():
            for kind, values in kinds.items():
                print(
                    f"{name:12} {kind:9} {len(values):8} {percentile(values, 50):10.2f} "
                    f"{percentile(values, 90):7.2f} {max(values):7.2f}"
                )
    finally:
        dbs.drop_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
