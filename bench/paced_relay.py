"""Relay CPU per message and commit -> consumer latency at a fixed commit rate, two source
trees side by side in one session, alternating.

    .venv/bin/python bench/paced_relay.py [--base /tmp/base/src] [--rate 1000] [--seconds 6]
        [--rounds 2] [--profile DIR]

``--base`` is the ``src`` directory of another commit (``git archive <commit> src | tar -x``);
without it only this tree runs. ``--base-setting NAME=VALUE`` runs the base relay with a
setting changed (this tree's, without ``--base``): a knob against its default. Per round and tree: a fresh database (this tree's schema),
a fresh RabbitMQ exchange and queue that a consumer here drains, one relay (the tree's
CLI, defaults, ``PYTHONPATH`` put in front of the venv's editable install), idle and
listening first; then ``--writers`` writers commit ``--rate`` transactions/s in all, one
message each, for ``--seconds``. Figures of the load: the relay process's CPU (user +
system, all threads, read from /proc) per message, which stays steady on a busy box where
latency does not; commit -> consumer p50 and p99; messages per batch and claims that found
nothing per second (the database's count of claim and settle calls, ``track_functions``
set on the bench database; approximate: it includes the second around the load); and how
far behind schedule the writers fell (on a loaded box they do: the load is then burstier
than its rate says). Rounds alternate which tree runs first. ``--profile DIR`` runs each relay under ``py-spy record --gil`` (raw, for
flamegraphs or ``sort | uniq``): its figures then include py-spy's sampling, so compare
only profiled runs with each other. ``--floor`` runs ``bench/floor_relay.py`` as a third tree
under the same load: a minimal batched relay on the same drivers (no key order, lease,
retry, metrics or tracing) that publishes through outboxer's own wave publisher and
polls every ``busy_poll_interval`` (its default), the control for what a relay costs per
message on this box whatever it does;
``--floor-aiormq`` runs it with aiormq's ``basic_publish`` per message instead.
``--quiet-destinations N`` gives the relay N more destinations (a config file; the same
broker) that no writer writes for: what a relay of many destinations spends on the quiet
ones while one is busy (their claims count among those that found nothing).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import psycopg

import writers
from brokers import AMQP_URL, RabbitSink
from harness import (
    Databases,
    FloorProcess,
    RelayProcess,
    cpu_of,
    log,
    percentile,
    published_times,
    wait_listening,
)

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
KEYS = 10_000
FLOOR = Path("floor")  # the tree names of bench/floor_relay.py: outboxer's wave publisher,
FLOOR_AIORMQ = Path("floor-aiormq")  # and aiormq's basic_publish per message


def sys_cpu_of(pid: int) -> float:
    """System CPU seconds of a running process so far (the kernel's share of cpu_of)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[12]) / os.sysconf("SC_CLK_TCK")


def calls_so_far(db: str) -> tuple[int, int]:
    """Claims and settles the relay made in this database so far (pg_stat_user_functions;
    the stats collector lags behind by up to a second: wait that long before)."""
    with psycopg.connect(db, autocommit=True) as conn:
        calls = dict(
            conn.execute(
                "SELECT substring(funcname from '_([a-z]+)$'), sum(calls) "
                "FROM pg_stat_user_functions WHERE schemaname = 'outboxer' GROUP BY 1"
            ).fetchall()
        )
    return int(calls.get("claim", 0)), int(calls.get("settle", 0))


async def paced_run(
    dbs: Databases,
    pool: ProcessPoolExecutor,
    tree: Path,
    args: argparse.Namespace,
    tag: str,
    settings: dict[str, str],
) -> dict[str, float]:
    db = dbs.empty("paced")
    writers.create_business_table(db)
    with psycopg.connect(db, autocommit=True) as conn:  # counts the relay's claims
        conn.execute(f"ALTER DATABASE {db.rsplit('/', 1)[1]} SET track_functions = 'pl'")
    target = await RabbitSink().open()
    arrived: dict[str, float] = {}

    async def on_message(message: Any) -> None:
        arrived.setdefault(str(message.message_id), time.time())

    env = {**os.environ, **settings, "PYTHONPATH": str(tree)}
    relay: RelayProcess | None = None
    spy: subprocess.Popen[bytes] | None = None
    loop = asyncio.get_running_loop()
    try:
        await target.consume(on_message)
        if tree in (FLOOR, FLOOR_AIORMQ):
            relay = FloorProcess(db, AMQP_URL, target.tag, "waves" if tree == FLOOR else "aiormq")
        else:
            extra: tuple[str, ...] = ("--log-level", "INFO")
            if args.quiet_destinations:
                config = Path(tempfile.gettempdir()) / f"outboxer-bench-quiet-{tag}.toml"
                config.write_text(
                    "".join(
                        f'[destinations.quiet{i}]\nbroker = "{target.url}"\n'
                        for i in range(args.quiet_destinations)
                    )
                )
                extra = (*extra, "--config", str(config))
            relay = RelayProcess(db, target.url, exit_when_idle=False, env=env, extra=extra)
            await asyncio.to_thread(wait_listening, db)

        async def paced(rate: float, count: int, seconds: float, seed: int) -> dict[str, Any]:
            start_at = time.time() + 0.3
            end_at = start_at + seconds
            futures = [
                loop.run_in_executor(
                    pool,
                    writers.write_paced,
                    db,
                    rate / count,
                    1,
                    start_at,
                    end_at,
                    KEYS,
                    seed + i,
                    "enqueue",
                    0.0 if args.in_phase else i / count,
                )
                for i in range(count)
            ]
            await asyncio.sleep(max(0.0, start_at - time.time()))
            assert relay is not None
            cpu, sys_cpu = cpu_of(relay.pid), sys_cpu_of(relay.pid)
            results = await asyncio.gather(*futures)
            committed = [pair for result in results for pair in result["committed"]]
            deadline = time.monotonic() + 15
            while any(mid not in arrived for mid, _ in committed) and time.monotonic() < deadline:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
            cpu, sys_cpu = cpu_of(relay.pid) - cpu, sys_cpu_of(relay.pid) - sys_cpu
            missing = sum(mid not in arrived for mid, _ in committed)
            if missing:
                raise RuntimeError(f"{missing} of {len(committed)} never reached the consumer")
            latencies = [(arrived[mid] - at) * 1000.0 for mid, at in committed]
            # A settle gives its whole batch one published_at (its transaction's now()).
            confirmed = await asyncio.to_thread(published_times, db, [m for m, _ in committed])
            return {
                "per_settle": len(committed) / len(set(confirmed.values())),
                "rate": len(committed) / seconds,
                "cpu_us_per_msg": 1e6 * cpu / len(committed),
                "sys_us_per_msg": 1e6 * sys_cpu / len(committed),
                "p50_ms": percentile(latencies, 50),
                "p99_ms": percentile(latencies, 99),
                "late_s": max(result["late_s"] for result in results),
            }

        await paced(20, 1, 1.0, 1000)  # warm up: relay awake, connections in use
        await asyncio.sleep(1.0)
        before = await asyncio.to_thread(calls_so_far, db)
        if args.profile:
            out = Path(args.profile) / f"{tag}.txt"
            command = [args.py_spy, "record", "--gil", "-r", "1000", "-f", "raw", "-o", str(out)]
            spy = subprocess.Popen(  # noqa: ASYNC220 -- started, not waited for
                [*command, "--pid", str(relay.pid)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            await asyncio.sleep(1.0)  # attached
        got = await paced(args.rate, args.writers, args.seconds, 0)
        await asyncio.sleep(1.0)
        after = await asyncio.to_thread(calls_so_far, db)
        claims, settles = after[0] - before[0], after[1] - before[1]
        # The floor calls no function: no count of its empty claims.
        got["empty_claims"] = (claims - settles) / args.seconds if claims else math.nan
        return got
    except Exception:
        if relay is not None:
            log("relay's log:\n" + relay.output())
        raise
    finally:
        if spy is not None:
            spy.send_signal(2)  # SIGINT: py-spy writes its profile and exits
            await asyncio.to_thread(spy.wait, 30)
        if relay is not None:
            relay.close()
        await target.close()
        dbs.drop(db)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, help="src directory of the tree to compare with")
    parser.add_argument(
        "--base-setting",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="run the base relay with this setting (OUTBOXER_NAME=VALUE); without --base, "
        "the base is this tree: one setting against its default, side by side",
    )
    parser.add_argument("--rate", type=float, default=1000.0, help="commits/s in all")
    parser.add_argument("--writers", type=int, default=4)
    parser.add_argument(
        "--in-phase",
        action="store_true",
        help="the writers commit at the same instants (bursts of --writers), as the bench's "
        "paced writers did until 2026-11-25; by default their commits are evenly spaced",
    )
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--profile", metavar="DIR", help="py-spy raw profiles here")
    parser.add_argument(
        "--floor", action="store_true", help="also run bench/floor_relay.py (the control)"
    )
    parser.add_argument(
        "--floor-aiormq",
        action="store_true",
        help="also run bench/floor_relay.py with aiormq's basic_publish per message",
    )
    parser.add_argument(
        "--quiet-destinations",
        type=int,
        default=0,
        metavar="N",
        help="N more destinations on the relay that nobody writes for",
    )
    parser.add_argument(
        "--py-spy", default=shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    )
    args = parser.parse_args()
    base_settings = {}
    for item in args.base_setting:
        name, _, value = item.partition("=")
        base_settings[f"OUTBOXER_{name.upper().replace('-', '_')}"] = value
    base = args.base.resolve() if args.base else SRC if base_settings else None
    trees = {"this": SRC} | ({"base": base} if base is not None else {})
    if args.floor:
        trees["floor"] = FLOOR
    if args.floor_aiormq:
        trees["floor-aiormq"] = FLOOR_AIORMQ
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    figures: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    dbs = Databases()
    with ProcessPoolExecutor(args.writers) as pool:
        try:
            for n in range(args.rounds):
                order = list(trees) if n % 2 == 0 else list(reversed(trees))
                for name in order:
                    settings = base_settings if name == "base" else {}
                    got = asyncio.run(
                        paced_run(dbs, pool, trees[name], args, f"{name}-{n}", settings)
                    )
                    load = os.getloadavg()[0]
                    got["load"] = load
                    figures[name].append(got)
                    log(
                        f"round {n + 1} {name}: {got['rate']:,.0f} msg/s, relay CPU "
                        f"{got['cpu_us_per_msg']:.0f} us/msg ({got['sys_us_per_msg']:.0f} "
                        f"system), consumer p50 {got['p50_ms']:.2f} ms p99 "
                        f"{got['p99_ms']:.2f} ms, {got['per_settle']:.1f} msg/batch, "
                        f"{got['empty_claims']:.0f} empty claims/s, writers late up to "
                        f"{got['late_s'] * 1000:.0f} ms, load {load:.1f}"
                    )
        finally:
            dbs.drop_all()
    print(f"\n{args.rate:,.0f} commits/s from {args.writers} writers, {args.seconds} s, medians")
    for name, runs in figures.items():

        def med(what: str, runs: list[dict[str, float]] = runs) -> str:
            values = [run[what] for run in runs]
            return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"

        print(
            f"{name:12} ({trees[name]}): relay CPU us/msg {med('cpu_us_per_msg')}, "
            f"consumer p50 ms {med('p50_ms')}, p99 ms {med('p99_ms')}, load {med('load')}"
        )
    this = statistics.median(run["cpu_us_per_msg"] for run in figures["this"])
    for other in ("base", "floor", "floor-aiormq"):
        if other in figures:
            cpu = statistics.median(run["cpu_us_per_msg"] for run in figures[other])
            print(f"relay CPU this / {other}: {this / cpu:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
