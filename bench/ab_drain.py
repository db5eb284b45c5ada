"""Drain figures of two source trees side by side, in one session, alternating.

    .venv/bin/python bench/ab_drain.py --base /tmp/base/src [--rounds 3] [--backlog 100000]

``--base`` is the ``src`` directory of another commit (``git archive <commit> src | tar -x``).
Each tree gets its own template (its own migrations, the same backlog as bench/run.py) and
its own database ceiling (its own store's claim and settle); the relay runs the tree's CLI
(``PYTHONPATH`` put in front of the venv's editable install). Rounds alternate which tree
drains first; each round starts with the RabbitMQ adapter ceiling (the same for both trees:
no database). Prints, per tree, the median (min-max) of the relay's rate to
RabbitMQ, relay CPU per message, the database ceiling and relay / min(ceilings), with the
load average of each run.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from brokers import adapter_ceiling, sink
from harness import Databases, load_messages, log, run_relays

HERE = Path(__file__).resolve().parent
BATCH, CONCURRENCY = 500, 4


def _worker(argv: list[str]) -> None:
    """Runs in a subprocess with the tree's outboxer on sys.path: make a template or time claims."""
    mode, arg = argv[0], argv[1:]
    if mode == "template":
        import outboxer

        run_id, label, count, keys = arg[0], arg[1], int(arg[2]), int(arg[3])
        dbs = Databases()
        dbs.run_id = f"{run_id}_{label}"
        url, seconds = dbs.template(count, keys)
        print(json.dumps({"url": url, "seconds": seconds, "outboxer": outboxer.__file__}))
    elif mode == "dbceiling":
        print(json.dumps({"rate": asyncio.run(_db_ceiling(arg[0]))}))


async def _db_ceiling(url: str) -> float:
    """bench/run.py's database ceiling, for a store with or without leases."""
    import outboxer
    from outboxer.stores.postgres import PostgresStore

    store = PostgresStore(url)
    await store.connect()
    relay_id = f"bench-ab-{os.getpid()}"
    max_attempts = outboxer.Settings().max_attempts
    total = 0

    async def loop() -> None:
        nonlocal total
        while True:
            claimed: Any = await store.claim("default", relay_id, BATCH, 60.0, False)
            if not claimed:
                return
            owner = getattr(claimed, "lease", relay_id)  # before the lease: the relay id
            seqs = [m.stored_seq for m in claimed]
            result = await store.settle("default", owner, seqs, [], [], max_attempts)
            total += result.published

    try:
        started = time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(CONCURRENCY)))
        return total / (time.perf_counter() - started)
    finally:
        await store.close()


def _in_tree(src: str | None, *args: str) -> dict[str, Any]:
    env = dict(os.environ)
    if src:
        env["PYTHONPATH"] = src
    done = subprocess.run(
        [sys.executable, str(HERE / "ab_drain.py"), "--worker", *args],
        env=env,
        capture_output=True,
        text=True,
    )
    if done.returncode:
        raise RuntimeError(f"worker {args[0]} failed:\n{done.stderr[-3000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def _drain(dbs: Databases, template: str, src: str | None) -> dict[str, float]:
    db = dbs.clone(template, "drain")
    previous = os.environ.pop("PYTHONPATH", None)
    if src:
        os.environ["PYTHONPATH"] = src
    try:

        async def go() -> Any:
            target = await sink("rabbitmq").open()
            try:
                run = await asyncio.to_thread(
                    run_relays, db, target.url, batch_size=BATCH, concurrency=CONCURRENCY
                )
                return run, await target.count()
            finally:
                await target.close()

        load = os.getloadavg()[0]
        run, arrived = asyncio.run(go())
    finally:
        os.environ.pop("PYTHONPATH", None)
        if previous is not None:
            os.environ["PYTHONPATH"] = previous
        dbs.drop(db)
    if arrived != run.published or set(run.counts) != {"PUBLISHED"} or run.warnings:
        raise RuntimeError(f"bad drain: {run.counts}, {arrived} arrived, {run.warnings[:3]}")
    return {"rate": run.rate, "cpu_us": 1e6 * run.cpu_seconds / run.published, "load": load}


def _ceiling(dbs: Databases, template: str, src: str | None) -> float:
    db = dbs.clone(template, "dbceiling")
    try:
        return float(_in_tree(src, "dbceiling", db)["rate"])
    finally:
        dbs.drop(db)


def _summary(values: list[float], fmt: str) -> str:
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(sys.argv[2:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base", required=True, help="src directory of the other tree")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--backlog", type=int, default=100_000)
    parser.add_argument("--keys", type=int, default=10_000)
    args = parser.parse_args()
    from run import attempt  # retries a measurement that a service restart disturbed

    trees: dict[str, str | None] = {"base": str(Path(args.base).resolve()), "head": None}
    dbs = Databases()
    try:
        templates = {}
        for name, src in trees.items():
            made = _in_tree(src, "template", dbs.run_id, name, str(args.backlog), str(args.keys))
            dbs.created.append(made["url"].rsplit("/", 1)[1])
            templates[name] = made["url"]
            log(
                f"{name}: template of {args.backlog:,} in {made['seconds']:.1f} s, {made['outboxer']}"
            )
        messages = load_messages(templates["head"], args.backlog)
        broker: list[float] = []
        results: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
        for n in range(args.rounds):
            broker.append(
                attempt(
                    "ceiling",
                    lambda: (
                        asyncio.run(adapter_ceiling("rabbitmq", messages, BATCH, CONCURRENCY)).rate
                    ),
                )
            )
            log(f"round {n + 1}: rabbitmq adapter ceiling {broker[-1]:,.0f} msg/s")
            order = list(trees) if n % 2 == 0 else list(reversed(trees))
            for name in order:
                figures = attempt(
                    f"{name} drain", functools.partial(_drain, dbs, templates[name], trees[name])
                )
                figures["db"] = attempt(
                    f"{name} db ceiling",
                    functools.partial(_ceiling, dbs, templates[name], trees[name]),
                )
                results[name].append(figures)
                log(
                    f"round {n + 1} {name}: relay {figures['rate']:,.0f} msg/s, "
                    f"{figures['cpu_us']:.1f} µs CPU/msg, db ceiling {figures['db']:,.0f} msg/s, "
                    f"load {figures['load']:.2f}"
                )
    finally:
        dbs.drop_all()
    broker_ceiling = statistics.median(broker)
    print(f"rabbitmq adapter ceiling: {_summary(broker, ',.0f')} msg/s")
    print("tree  relay msg/s          CPU µs/msg        db ceiling msg/s     vs_ceiling    load")
    for name, runs in results.items():
        ratios = [r["rate"] / min(broker_ceiling, r["db"]) for r in runs]
        print(
            f"{name:5} {_summary([r['rate'] for r in runs], ',.0f'):20} "
            f"{_summary([r['cpu_us'] for r in runs], '.1f'):17} "
            f"{_summary([r['db'] for r in runs], ',.0f'):20} {_summary(ratios, '.2f'):13} "
            f"{_summary([r['load'] for r in runs], '.1f')}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
