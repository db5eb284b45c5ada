"""The PostgreSQL outbox modes side by side: write-path cost and drain throughput.

    .venv/bin/python bench/pgmodes.py [--messages 20000] [--writers 4] [--seconds 5] [--json out.json]

Everything runs on one private PostgreSQL 15 (wal_level=logical, fsync and
synchronous_commit on) that the bench starts on a free port and stops at the end, one
fresh database per mode, so the modes meet the same server:

Every figure is the median of ``--runs`` runs (3), the modes interleaved in each.

* write: ``--writers`` connections commit transactions of one business INSERT plus one
  ``enqueue`` for ``--seconds``; commits/s, p50/p99 commit latency, and WAL bytes per
  transaction. ``bare`` is the business INSERT alone.
* drain: ``--messages`` committed messages (transactions of 100), then the time a relay
  takes to publish them all, and the WAL the relay's own bookkeeping writes per message to the in-memory broker (batch 500): the default table
  through ``outboxer.relay.Relay``, log and WAL through ``outboxer.streamrelay``.
  The Debezium layout has no drain here: Debezium publishes it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg

from outboxer.brokers.memory import MemoryPublisher, memory_broker
from outboxer.config import Settings
from outboxer.enqueue import Outbox
from outboxer.relay import Relay
from outboxer.stores.pgdebezium import PgDebezium
from outboxer.stores.pglog import PgLog
from outboxer.stores.pgwal import PgWal
from outboxer.stores.postgres import PostgresStore
from outboxer.streamrelay import StreamSource, run_stream_relay
from outboxer.streamtesting import private_postgres, wait_until

MODES = ("table", "log", "wal", "debezium")
PAYLOAD = {"order_id": 123, "customer": "customer-00012", "total": "123.45", "note": "x" * 200}


async def prepare(admin: str, mode: str) -> str:
    name = f"bench_{mode}_{uuid.uuid4().hex[:6]}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    url = admin.rsplit("/", 1)[0] + "/" + name
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE TABLE orders (id bigserial PRIMARY KEY, body jsonb NOT NULL)")
    if mode in ("table", "bare"):
        async with PostgresStore(url) as store:
            await store.apply_schema()
    elif mode == "log":
        async with PgLog(url) as log:
            await log.apply_schema()
    elif mode == "wal":
        wal = PgWal(url, slot_prefix=name)
        async with wal:
            await wal.create_slot("default")
    elif mode == "debezium":
        async with PgDebezium(url) as table:
            await table.apply_schema()
        with psycopg.connect(url, autocommit=True) as conn:  # as the connector would
            conn.execute("CREATE PUBLICATION dbz FOR TABLE outboxer.outbox_debezium")
            conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (name,))
    return url


def _wal_lsn(url: str) -> str:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT CAST(pg_current_wal_lsn() AS text)").fetchone()
    assert row is not None
    return str(row[0])


def _wal_since(url: str, lsn: str) -> float:
    """WAL bytes written since ``lsn`` (by the whole private server: only the bench runs there)."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s)", (lsn,)).fetchone()
    return float(row[0]) if row else 0.0


def discard(admin: str, url: str) -> None:
    """Drop a mode's database and its slots (a slot would keep WAL for the later runs)."""
    name = url.rsplit("/", 1)[1]
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
            "WHERE database = %s",
            (name,),
        )
        conn.execute(f"DROP DATABASE {name} WITH (FORCE)")


async def write_phase(url: str, mode: str, writers: int, seconds: float) -> dict[str, float]:
    outbox = Outbox(mode=mode) if mode != "bare" else None
    latencies: list[float] = []
    deadline = time.monotonic() + seconds

    async def writer(w: int) -> None:
        async with await psycopg.AsyncConnection.connect(url) as conn:
            i = 0
            while time.monotonic() < deadline:
                started = time.perf_counter()
                await conn.execute("INSERT INTO orders (body) VALUES (%s)", (json.dumps(PAYLOAD),))
                if outbox is not None:
                    await outbox.enqueue_async(conn, "order.placed", PAYLOAD, key=f"c-{w}-{i % 50}")
                await conn.commit()
                latencies.append(time.perf_counter() - started)
                i += 1

    before = _wal_lsn(url)
    started = time.monotonic()
    await asyncio.gather(*(writer(w) for w in range(writers)))
    elapsed = time.monotonic() - started
    wal_bytes = _wal_since(url, before)
    latencies.sort()
    return {
        "commits_per_s": round(len(latencies) / elapsed, 1),
        "p50_ms": round(latencies[len(latencies) // 2] * 1000, 2),
        "p99_ms": round(latencies[int(len(latencies) * 0.99)] * 1000, 2),
        "wal_bytes_per_tx": round(wal_bytes / max(1, len(latencies))),
    }


async def fill(url: str, mode: str, messages: int) -> None:
    outbox = Outbox(mode=mode)
    async with await psycopg.AsyncConnection.connect(url) as conn:
        for start in range(0, messages, 100):
            items = [
                {"topic": "order.placed", "payload": PAYLOAD, "key": f"c-{n % 50}"}
                for n in range(start, min(messages, start + 100))
            ]
            await outbox.enqueue_many_async(conn, items)
            await conn.commit()


async def drain_phase(url: str, mode: str, messages: int) -> dict[str, float]:
    await fill(url, mode, messages)
    name = f"bench-{uuid.uuid4().hex[:6]}"
    broker = memory_broker(name)
    publisher = MemoryPublisher(f"memory://{name}")
    wal_before = _wal_lsn(url)
    started = time.monotonic()
    if mode == "table":
        await Relay(PostgresStore(url), {"default": publisher}, Settings(batch_size=500)).drain()
    else:
        source: StreamSource = (
            PgLog(url).reader("default")
            if mode == "log"
            else PgWal(url, slot_prefix=url.rsplit("/", 1)[1]).reader("default")
        )
        await source.connect()
        stop = asyncio.Event()
        relay = asyncio.create_task(run_stream_relay(source, publisher, stop=stop, batch_size=500))
        await wait_until(lambda: len(broker.messages) >= messages or relay.done(), 600, 0.005)
        stop.set()
        await relay
        await source.close()
    elapsed = time.monotonic() - started
    published = len(broker.messages)
    broker.clear()
    relay_wal = _wal_since(url, wal_before)
    return {
        "relay_wal_bytes_per_msg": round(relay_wal / max(1, published)),
        "messages": published,
        "seconds": round(elapsed, 2),
        "msgs_per_s": round(published / elapsed),
    }


def _medians(runs: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Each figure's median over the runs."""
    return {
        mode: {
            phase: {
                name: round(statistics.median(run[mode][phase][name] for run in runs), 2)
                for name in values
            }
            for phase, values in phases.items()
        }
        for mode, phases in runs[0].items()
    }


async def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--writers", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--runs", type=int, default=3, help="figures are the median of the runs")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    runs: list[dict[str, dict[str, Any]]] = []
    with private_postgres(fsync=True) as admin:
        for run in range(args.runs):  # modes interleaved: a noisy minute hits them all
            figures: dict[str, dict[str, Any]] = {}
            for mode in ("bare", *MODES):
                print(f"pgmodes: run {run + 1}/{args.runs}: {mode} ...", file=sys.stderr)
                url = await prepare(admin, mode)
                figures[mode] = {"write": await write_phase(url, mode, args.writers, args.seconds)}
                discard(admin, url)
                if mode in ("table", "log", "wal"):
                    url = await prepare(admin, mode)
                    figures[mode]["drain"] = await drain_phase(url, mode, args.messages)
                    discard(admin, url)
            runs.append(figures)
    results = _medians(runs)
    bare = results["bare"]["write"]["commits_per_s"]
    print(
        f"{'mode':<9} {'commits/s':>10} {'vs bare':>8} {'p50 ms':>7} {'p99 ms':>7} {'WAL B/tx':>9} {'drain msg/s':>12}"
    )
    for mode, figures in results.items():
        write = figures["write"]
        drain = figures.get("drain", {}).get("msgs_per_s", "-")
        relay_wal = figures.get("drain", {}).get("relay_wal_bytes_per_msg", "-")
        print(
            f"{mode:<9} {write['commits_per_s']:>10} {write['commits_per_s'] / bare:>8.2f} "
            f"{write['p50_ms']:>7} {write['p99_ms']:>7} {write['wal_bytes_per_tx']:>9} {drain!s:>12} {relay_wal!s:>16}"
        )
    if args.json:
        report = json.dumps({"args": vars(args), "results": results}, indent=2)
        Path(args.json).write_text(report, encoding="utf-8")  # noqa: ASYNC240 (once, at the end)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))
