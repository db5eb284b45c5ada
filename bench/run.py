"""outboxer's bench: relay throughput and its ceilings, the simple relay, write-path cost,
commit-to-confirm latency, scaling and relay CPU, against the local services.

    .venv/bin/python bench/run.py [--quick] [--json out.json] [--runs N] [--only SECTIONS]

Prints a table (median, min, max of the runs, and each target of bench/README.md with
pass/FAIL) and writes every figure as JSON. Progress goes to stderr. ``--quick`` shrinks
every size (the CI smoke test); its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import multiprocessing
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import outboxer
import writers
from brokers import (
    BROKERS,
    RABBITMQ_SHAPES,
    RabbitSink,
    adapter_ceiling,
    close_leftovers,
    publish_paced,
    rabbitmq_shape,
    raw_ceiling,
    sink,
)
from harness import (
    ADMIN_URL,
    AMQP_URL,
    DESTINATION,
    BoxMeter,
    Databases,
    Figure,
    FloorProcess,
    RelayProcess,
    RelayRun,
    Report,
    Target,
    cpu_of,
    load_messages,
    log,
    percentile,
    published_times,
    run_relays,
    server_facts,
    wait_listening,
)
from outboxer.message import Message
from outboxer.stores import create_store
from simple_relay import simple_relay
from stores import DIALECTS, StoreDatabases
from stores import drain as store_drain

SECTIONS = ("throughput", "simple", "write", "latency", "scaling", "stores", "sweep")
SETTINGS = outboxer.Settings()
BATCH, CONCURRENCY = SETTINGS.batch_size, SETTINGS.concurrency
WRITERS = (1, 8)
BATCH_SIZES = (1, 10, 100, 500)
RELAY_COUNTS = (1, 2, 4)
#: Batch sizes are scaled on RabbitMQ and on memory:// (no broker limit: the relay and database).
SCALING_BROKERS = ("rabbitmq", "memory")
SERVICES = {"postgresql": 5432, "rabbitmq": 5672, "redis": 6379, "mariadb": 3306}
#: At half load the writers commit at most this many transactions/s in all.
HALF_LOAD_TRANSACTIONS = 250
#: The latency sweep's loads: commits/s (one message each) from SWEEP_WRITERS writers.
SWEEP_RATES = (100, 200, 500, 1000, 2000)
SWEEP_WRITERS = 4
#: The load at which the sweep also runs the floor relay (bench/floor_relay.py), the control
#: for the relay CPU target there.
SWEEP_FLOOR_RATE = 1000
#: The CPU of one wait of each kind a relay cycle makes (bench/wake_cost.py), measured after
#: the sweep: figure sweep.control.<what>.
WAKE_COSTS = ("timer_wake_us", "pg_round_trip_us", "amqp_confirm_us", "cycle_waits_us")
#: What the sweep measures per load (figure sweep.<rate>.<what>).
SWEEP_FIGURES = (
    ("rate", "msg/s"),
    ("consumer_p50_ms", "ms"),
    ("consumer_p99_ms", "ms"),
    ("p50_ms", "ms"),
    ("p99_ms", "ms"),
    ("broker_p50_ms", "ms"),
    ("broker_p99_ms", "ms"),
    ("relay_cpu_us_per_msg", "CPU us/msg"),
    ("box_busy", "cores"),
    ("broker_box_busy", "cores"),
)


@dataclass(frozen=True)
class Sizes:
    backlog: int  # messages prefilled for the drains
    keys: int
    runs: int  # runs per figure
    simple_seconds: float
    write_seconds: float
    trickle_seconds: float
    half_seconds: float
    scaling_seconds: float
    #: Upper bound of the "half the maximum rate" load (--quick keeps the smoke test light).
    half_rate_cap: float = math.inf
    #: Messages each shape of the RabbitMQ broker maximum publishes.
    broker_max_messages: int = 8_000
    #: The "half" latency load in msg/s, instead of half of section 1's relay rate (--half-rate).
    half_rate: float | None = None
    #: Messages prefilled for the MariaDB and SQLite drains (over as many keys per message).
    store_backlog: int = 20_000
    #: Seconds of each load of the latency sweep.
    sweep_seconds: float = 4.0


FULL = Sizes(
    backlog=100_000,
    keys=10_000,
    runs=3,
    simple_seconds=3.0,
    write_seconds=1.5,
    trickle_seconds=10.0,
    half_seconds=4.0,
    scaling_seconds=1.5,
)
QUICK = Sizes(
    backlog=2_000,
    keys=200,
    runs=1,
    simple_seconds=0.5,
    write_seconds=0.25,
    trickle_seconds=0.6,
    half_seconds=0.5,
    scaling_seconds=0.3,
    half_rate_cap=500.0,
    broker_max_messages=500,
    store_backlog=1_000,
    sweep_seconds=0.4,
)


def _write_names() -> list[tuple[str, str]]:
    names = []
    for n in WRITERS:
        for relay in ("relay_off", "relay_on"):
            base = f"write.w{n}.{relay}"
            for mode in writers.MODES:
                names += [
                    (f"{base}.{mode}.txn_per_s", "txn/s"),
                    (f"{base}.{mode}.p50_ms", "ms"),
                    (f"{base}.{mode}.p99_ms", "ms"),
                ]
            names += [
                (f"{base}.throughput_ratio", "x"),
                (f"{base}.p50_ratio", "x"),
                (f"{base}.p99_ratio", "x"),
            ]
            # The control: the same event INSERTed into a plain table (bound of what any outbox costs).
            names += [
                (f"{base}.control_throughput_ratio", "x"),
                (f"{base}.control_p50_ratio", "x"),
                (f"{base}.control_p99_ratio", "x"),
                (f"{base}.enqueue_over_control", "x"),
                (f"{base}.table_over_control", "x"),
                (f"{base}.enqueue_over_table", "x"),
            ]
            if relay == "relay_off":  # where the time goes: CPU per transaction
                names += [
                    (f"{base}.{mode}.{side}_cpu_us", "CPU us/txn")
                    for mode in writers.MODES
                    for side in ("client", "server")
                ]
            else:
                names += [(f"{base}.relay_cpu_us_per_msg", "CPU us/msg")]
    return names


#: Every figure the JSON holds, in table order: (name, unit), grouped by section.
FIGURES: dict[str, list[tuple[str, str]]] = {
    "throughput": [
        *[(f"throughput.relay.{b}", "msg/s") for b in BROKERS],
        *[(f"throughput.broker_ceiling.{b}", "msg/s") for b in BROKERS],
        *[(f"throughput.raw_client.{b}", "msg/s") for b in ("rabbitmq", "redis")],
        ("throughput.broker_max.rabbitmq", "msg/s"),
        ("throughput.db_ceiling", "msg/s"),
        *[(f"throughput.vs_ceiling.{b}", "x") for b in BROKERS],
        *[(f"cpu.relay.{b}", "CPU s/1k msg") for b in BROKERS],
        # Where the machine's CPU went during each measurement, in cores (see harness.BoxMeter).
        *[
            (f"cpu.box.relay.{b}.{who}", "cores")
            for b in BROKERS
            for who in ("busy", "postgres", *(("broker",) if b != "memory" else ()), "client")
        ],
        *[
            (f"cpu.box.broker_ceiling.{b}.{who}", "cores")
            for b in ("rabbitmq", "redis")
            for who in ("busy", "broker", "client")
        ],
        *[(f"cpu.box.db_ceiling.{who}", "cores") for who in ("busy", "postgres", "client")],
    ],
    "simple": [
        ("simple_relay.rabbitmq", "msg/s"),
        ("simple_relay.speedup", "x"),
        ("simple_relay.speedup_bound", "x"),
    ],
    "write": _write_names(),
    "latency": [
        (f"latency.{load}.{what}", unit)
        for load in ("trickle", "half")
        for what, unit in (
            ("rate", "msg/s"),
            ("p50_ms", "ms"),
            ("p99_ms", "ms"),
            ("max_ms", "ms"),
            ("consumer_p50_ms", "ms"),
            ("consumer_p99_ms", "ms"),
            ("broker_p50_ms", "ms"),
            ("broker_p99_ms", "ms"),
            ("box_busy", "cores"),
            # where the box's CPU went: the relay, the services, the rest
            # (the writers, the bench's consumer, the kernel)
            ("box_relay", "cores"),
            ("box_postgres", "cores"),
            ("box_rabbitmq", "cores"),
            ("box_other", "cores"),
            ("broker_box_busy", "cores"),
            ("relay_cpu_us_per_msg", "CPU us/msg"),
        )
    ],
    "scaling": [
        *[
            (f"scaling.{broker}.batch.{b}", "msg/s")
            for broker in SCALING_BROKERS
            for b in BATCH_SIZES
        ],
        *[(f"scaling.{broker}.batch500_over_batch1", "x") for broker in SCALING_BROKERS],
        ("scaling.rabbitmq.batch500_over_batch1_bound", "x"),
        *[(f"scaling.rabbitmq.relays.{n}", "msg/s") for n in RELAY_COUNTS],
    ],
    "stores": [
        ("stores.broker_ceiling.rabbitmq", "msg/s"),
        *[
            (f"stores.{dialect}.{what}", unit)
            for dialect in DIALECTS
            for what, unit in (
                ("relay", "msg/s"),
                ("db_ceiling", "msg/s"),
                ("vs_ceiling", "x"),
                ("relay_cpu_us_per_msg", "CPU us/msg"),
                ("box_busy", "cores"),
            )
        ],
    ],
    "sweep": [
        *[(f"sweep.{rate}.{what}", unit) for rate in SWEEP_RATES for what, unit in SWEEP_FIGURES],
        (f"sweep.{SWEEP_FLOOR_RATE}.per_batch", "msg"),
        (f"sweep.floor.{SWEEP_FLOOR_RATE}.relay_cpu_us_per_msg", "CPU us/msg"),
        (f"sweep.floor.{SWEEP_FLOOR_RATE}.per_batch", "msg"),
        (f"sweep.floor.{SWEEP_FLOOR_RATE}.consumer_p50_ms", "ms"),
        (f"sweep.{SWEEP_FLOOR_RATE}.relay_over_floor", "x"),
        *[(f"sweep.control.{what}", "CPU us") for what in WAKE_COSTS],
        (f"sweep.control.{SWEEP_FLOOR_RATE}.cycle_waits_us_per_msg", "CPU us/msg"),
    ],
}

#: The goals written in bench/README.md.
TARGETS = [
    Target("throughput.vs_ceiling.rabbitmq", ">=", 0.8, "relay >= 0.8 x min(ceilings), RabbitMQ"),
    Target("throughput.vs_ceiling.redis", ">=", 0.6, "relay >= 0.6 x min(ceilings), Redis Streams"),
    Target("throughput.vs_ceiling.memory", ">=", 0.6, "relay >= 0.6 x min(ceilings), memory://"),
    Target("simple_relay.speedup", ">=", 10.0, "relay >= 10 x the simple relay (RabbitMQ)"),
    Target(
        "write.w8.relay_off.throughput_ratio",
        ">=",
        0.9,
        "8 writers: enqueue keeps >= 0.9 x bare throughput",
    ),
    Target(
        "write.w8.relay_off.p99_ratio", "<=", 1.15, "8 writers: p99 commit latency <= 1.15 x bare"
    ),
    Target("write.w8.relay_on.throughput_ratio", ">=", 0.9, "same, relay draining: >= 0.9 x bare"),
    Target("write.w8.relay_on.p99_ratio", "<=", 1.15, "same, relay draining: p99 <= 1.15 x bare"),
    Target("latency.trickle.p50_ms", "<=", 5.0, "commit -> confirm p50 <= 5 ms at 10 msg/s"),
    Target("latency.trickle.p99_ms", "<=", 25.0, "commit -> confirm p99 <= 25 ms at 10 msg/s"),
    Target(
        "latency.half.p99_ms", "<=", 50.0, "commit -> confirm p99 <= 50 ms at half the max rate"
    ),
    Target(
        "scaling.rabbitmq.batch500_over_batch1", ">=", 20.0, "batch 500 >= 20 x batch 1, RabbitMQ"
    ),
    Target(
        "scaling.memory.batch500_over_batch1", ">=", 20.0, "batch 500 >= 20 x batch 1, memory://"
    ),
    *[
        Target(
            f"stores.{dialect}.vs_ceiling",
            ">=",
            0.6,
            f"{dialect}: relay >= 0.6 x min(ceilings), RabbitMQ",
        )
        for dialect in DIALECTS
    ],
    Target("sweep.200.consumer_p50_ms", "<=", 3.0, "commit -> consumer p50 <= 3 ms at 200/s"),
    Target("sweep.200.consumer_p99_ms", "<=", 10.0, "commit -> consumer p99 <= 10 ms at 200/s"),
    Target("sweep.1000.consumer_p50_ms", "<=", 5.0, "commit -> consumer p50 <= 5 ms at 1,000/s"),
    Target(
        "sweep.1000.relay_cpu_us_per_msg", "<=", 100.0, "relay CPU <= 100 us/msg at 1,000 msg/s"
    ),
]

T = TypeVar("T")
#: A latency load: name, transactions/s, writers, messages per transaction, seconds.
Load = tuple[str, float, int, int, float]
#: Relay log words that mean a service went away during the run.
_OUTAGE = (
    "unreachable",
    "claim failed",
    "settle failed",
    "could not record",
    "will be retried",
    "failed, attempt",
    "abandoned",
    "taken over",
    "refuses",
)


# ----- robustness: the services are shared --------------------------------------------------


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def wait_for_services(timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        down = [name for name, port in SERVICES.items() if not _port_open(port)]
        if not down:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"services down: {', '.join(down)}")
        log(f"waiting for {', '.join(down)} to come back")
        time.sleep(2)


#: Cores busy outside PostgreSQL, RabbitMQ, Redis and the measured relay or client above which
#: a measurement is taken once more: something else was using the machine meanwhile.
NOISE_CORES = 0.3
#: Measurements kept although the machine stayed busy (for meta.noisy).
NOISY: list[str] = []
#: Whether such a measurement is taken again (not with --quick: its numbers mean nothing, and
#: on a shared machine each retake only lengthens the CI smoke test).
RETAKE_NOISY = True


class Noisy(Exception):
    def __init__(self, box: dict[str, float], result: object) -> None:
        super().__init__(f"{box['other']:.2f} cores were busy with other processes")
        self.result = result


def quiet(result: T, box: dict[str, float]) -> T:
    """``result``, unless other processes used the machine meanwhile (then raise Noisy)."""
    if RETAKE_NOISY and box.get("seconds", 0.0) >= 1.0 and box.get("other", 0.0) > NOISE_CORES:
        raise Noisy(box, result)
    return result


def attempt(label: str, action: Callable[[], T], tries: int = 3) -> T:
    """Run one measurement; if a service went away meanwhile (others restart them), redo it.

    A measurement taken while other processes kept the machine busy is redone once; if it
    is busy again, the second one is kept and named in ``meta.noisy``.
    """
    failures, noisy = 0, 0
    while True:
        try:
            return action()
        except Noisy as exc:
            noisy += 1
            if noisy > 1:
                log(f"{label}: {exc} again; kept")
                NOISY.append(label)
                return exc.result  # type: ignore[return-value]
            log(f"{label}: {exc}; again")
            time.sleep(3)
        except Exception as exc:
            failures += 1
            if failures >= tries:
                raise
            log(
                f"{label}: attempt {failures} disturbed ({type(exc).__name__}: {str(exc)[:300]}); again"
            )
            time.sleep(2)
            wait_for_services()


# ----- the bench ----------------------------------------------------------------------------


class Bench:
    def __init__(self, sizes: Sizes, report: Report) -> None:
        self.sizes = sizes
        self.report = report
        self.dbs = Databases()
        self.template = ""
        self._pool: ProcessPoolExecutor | None = None

    @property
    def runs(self) -> int:
        return self.sizes.runs

    def pool(self) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(
                max(WRITERS), mp_context=multiprocessing.get_context("spawn")
            )
            list(self._pool.map(writers.warm_up, range(max(WRITERS))))
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
        self.dbs.drop_all()
        left = asyncio.run(close_leftovers())
        if left:
            self.report.meta["left_on_brokers"] = left

    def prepare(self) -> None:
        log(f"prefilling {self.sizes.backlog:,} messages over {self.sizes.keys:,} keys")
        self.template, seconds = self.dbs.template(self.sizes.backlog, self.sizes.keys)
        self.report.meta["prefill_seconds"] = round(seconds, 2)
        self.report.meta["prefill_rate"] = round(self.sizes.backlog / seconds)
        self.report.meta["postgres"] = server_facts(self.template)

    def median(self, name: str, default: float) -> float:
        figure = self.report.figures.get(name)
        return figure.median if figure and figure.runs else default

    # ----- 1. throughput and ceilings, 6. CPU ------------------------------------------------

    def drain(
        self,
        broker: str,
        *,
        relays: int = 1,
        batch_size: int = BATCH,
        stop_after: float | None = None,
    ) -> RelayRun:
        db = self.dbs.clone(self.template, "drain")
        try:

            async def go() -> tuple[RelayRun, int | None]:
                target = await sink(broker).open()
                try:
                    run = await asyncio.to_thread(
                        run_relays,
                        db,
                        target.url,
                        relays=relays,
                        batch_size=batch_size,
                        concurrency=CONCURRENCY,
                        stop_after=stop_after,
                    )
                    return run, await target.count()
                finally:
                    await target.close()

            run, arrived = asyncio.run(go())
        finally:
            self.dbs.drop(db)
        # An outage (the broker or database restarted by another suite) makes the relay log;
        # such a run is taken again. Other warnings are kept for the report.
        trouble = [line for line in run.warnings if any(word in line for word in _OUTAGE)]
        if trouble:
            raise RuntimeError("relay logged trouble: " + " | ".join(trouble[:3]))
        seen = self.report.meta.setdefault("relay_warnings", [])
        for line in run.warnings:
            text = line.split(" WARNING ", 1)[-1].split(" ERROR ", 1)[-1]
            if text not in seen and len(seen) < 20:
                seen.append(text)
        if stop_after is None and run.counts != {"PUBLISHED": self.sizes.backlog}:
            raise RuntimeError(f"drain left {run.counts}")
        if arrived is not None and arrived < run.published:
            raise RuntimeError(f"{broker}: {arrived} arrived, {run.published} recorded published")
        return quiet(run, run.box)

    def add_box(self, prefix: str, box: dict[str, float], broker: str | None) -> None:
        """Record a BoxMeter reading: busy, postgres (unless a broker ceiling), broker, client."""
        names = {"busy": box["busy"], "client": box["client"]}
        if "broker_ceiling" not in prefix:
            names["postgres"] = box["postgres"]
        if broker in ("rabbitmq", "redis"):
            names["broker"] = box[broker]
        for who, cores in names.items():
            self.report.add(f"{prefix}.{who}", "cores", cores)

    def db_ceiling(self) -> tuple[float, dict[str, float]]:
        db = self.dbs.clone(self.template, "dbceiling")
        try:
            rate, box = asyncio.run(_db_ceiling(db, BATCH, CONCURRENCY))
        finally:
            self.dbs.drop(db)
        return quiet((rate, box), box)

    @staticmethod
    def ceiling(measure: Callable[..., Any], *args: Any) -> Any:
        result = asyncio.run(measure(*args))
        return result if result is None else quiet(result, result.box)

    def throughput(self) -> None:
        report, sizes = self.report, self.sizes
        # The same messages as the drains, all of them: a queue or stream that grows to the
        # backlog's size is slower than one that holds a sample of it.
        messages = load_messages(self.template, sizes.backlog)
        for run in range(1, self.runs + 1):
            for broker in BROKERS:
                log(f"throughput run {run}: relay drains {sizes.backlog:,} to {broker}")
                result = attempt(f"relay {broker}", functools.partial(self.drain, broker))
                report.add(f"throughput.relay.{broker}", "msg/s", result.rate)
                report.add(f"cpu.relay.{broker}", "CPU s/1k msg", result.cpu_per_1000)
                self.add_box(f"cpu.box.relay.{broker}", result.box, broker)
                log(
                    f"  {result.rate:,.0f} msg/s, {result.cpu_per_1000:.3f} CPU s/1k, "
                    f"box {_cores(result.box)}"
                )
            for broker in BROKERS:
                ceiling = attempt(
                    f"ceiling {broker}",
                    functools.partial(
                        self.ceiling, adapter_ceiling, broker, messages, BATCH, CONCURRENCY
                    ),
                )
                report.add(f"throughput.broker_ceiling.{broker}", "msg/s", ceiling.rate)
                if broker != "memory":
                    self.add_box(f"cpu.box.broker_ceiling.{broker}", ceiling.box, broker)
                # For reference only (no target): taken once, to keep the bench under 10 minutes.
                raw = (
                    attempt(
                        f"raw {broker}",
                        functools.partial(
                            self.ceiling, raw_ceiling, broker, messages, BATCH, CONCURRENCY
                        ),
                    )
                    if run == 1
                    else None
                )
                if raw is not None:
                    report.add(f"throughput.raw_client.{broker}", "msg/s", raw.rate)
                log(
                    f"  broker ceiling {broker}: {ceiling.rate:,.0f} msg/s, box {_cores(ceiling.box)}"
                    + (f" (raw {raw.rate:,.0f})" if raw else "")
                )
            report.add("throughput.broker_max.rabbitmq", "msg/s", self.broker_max(messages))
            rate, box = attempt("db ceiling", self.db_ceiling)
            report.add("throughput.db_ceiling", "msg/s", rate)
            self.add_box("cpu.box.db_ceiling", box, None)
            log(f"  db ceiling: {rate:,.0f} msg/s, box {_cores(box)}")
        db = report.figures["throughput.db_ceiling"].median
        for broker in BROKERS:
            ceiling = min(report.figures[f"throughput.broker_ceiling.{broker}"].median, db)
            ratio = report.figure(
                f"throughput.vs_ceiling.{broker}",
                "x",
                note=f"relay / min(broker {broker}, database) = relay / {ceiling:,.0f}",
            )
            ratio.runs = [r / ceiling for r in report.figures[f"throughput.relay.{broker}"].runs]
        report.figures["throughput.broker_max.rabbitmq"].note = self.broker_max_note()

    def broker_max(self, messages: list[Message]) -> float:
        """The best rate a plain aio-pika client gets RabbitMQ to confirm, over RABBITMQ_SHAPES.

        Each shape publishes the first ``broker_max_messages`` rows to a fresh exchange and
        queue; which shape won, and every shape's rate, go to ``meta.broker_max``.
        """
        sample = messages[: self.sizes.broker_max_messages]
        rates: dict[str, float] = {}
        for shape in RABBITMQ_SHAPES:
            rates[shape] = attempt(
                f"broker max ({shape})",
                functools.partial(self.ceiling, rabbitmq_shape, shape, sample),
            ).rate
        best = max(rates, key=rates.__getitem__)
        self.report.meta.setdefault("broker_max", []).append(
            {
                "best": best,
                "messages": len(sample),
                "rates": {k: round(v) for k, v in rates.items()},
            }
        )
        log(
            f"  broker max rabbitmq: {rates[best]:,.0f} msg/s ({best}); "
            + ", ".join(f"{k} {v:,.0f}" for k, v in rates.items())
        )
        return rates[best]

    def broker_max_note(self) -> str:
        best = ", ".join(run["best"] for run in self.report.meta.get("broker_max", []))
        return (
            f"best of {len(RABBITMQ_SHAPES)} plain aio-pika shapes (meta.broker_max), "
            f"{self.sizes.broker_max_messages:,} messages each; best per run: {best}"
        )

    # ----- 7. MariaDB and SQLite ------------------------------------------------------------

    def stores(self) -> None:
        """The relay's drain to RabbitMQ on MariaDB and SQLite, against their ceilings."""
        report, sizes = self.report, self.sizes
        count = sizes.store_backlog
        keys = max(1, sizes.keys * count // sizes.backlog)  # as many messages per key
        dbs = StoreDatabases(self.dbs.run_id)
        try:
            templates = {}
            for dialect in DIALECTS:
                log(f"stores: prefilling {count:,} messages over {keys:,} keys into {dialect}")
                templates[dialect], seconds = dbs.template(dialect, count, keys)
                report.meta.setdefault("store_prefill_seconds", {})[dialect] = round(seconds, 2)
            messages = load_messages(self.template, count)  # the same rows (same seed)
            for run in range(1, self.runs + 1):
                ceiling = attempt(
                    "ceiling rabbitmq",
                    functools.partial(
                        self.ceiling, adapter_ceiling, "rabbitmq", messages, BATCH, CONCURRENCY
                    ),
                )
                report.add("stores.broker_ceiling.rabbitmq", "msg/s", ceiling.rate)
                log(f"stores run {run}: broker ceiling rabbitmq {ceiling.rate:,.0f} msg/s")
                for dialect in DIALECTS:
                    drained = attempt(
                        f"relay {dialect}",
                        functools.partial(self.store_drain, dbs, templates[dialect], count),
                    )
                    rate, box = attempt(
                        f"db ceiling {dialect}",
                        functools.partial(self.store_ceiling, dbs, templates[dialect]),
                    )
                    report.add(f"stores.{dialect}.relay", "msg/s", drained.rate)
                    report.add(
                        f"stores.{dialect}.relay_cpu_us_per_msg",
                        "CPU us/msg",
                        1000.0 * drained.cpu_per_1000,
                    )
                    report.add(f"stores.{dialect}.box_busy", "cores", drained.box["busy"])
                    report.add(f"stores.{dialect}.db_ceiling", "msg/s", rate)
                    log(
                        f"  {dialect}: relay {drained.rate:,.0f} msg/s "
                        f"({1000 * drained.cpu_per_1000:.0f} CPU us/msg, box "
                        f"{_cores(drained.box)}), db ceiling {rate:,.0f} msg/s ({_cores(box)})"
                    )
        finally:
            dbs.drop_all()
        broker = report.figures["stores.broker_ceiling.rabbitmq"].median
        for dialect in DIALECTS:
            bound = min(broker, report.figures[f"stores.{dialect}.db_ceiling"].median)
            ratio = report.figure(
                f"stores.{dialect}.vs_ceiling",
                "x",
                note=f"relay / min(broker rabbitmq, {dialect}) = relay / {bound:,.0f}",
            )
            ratio.runs = [r / bound for r in report.figures[f"stores.{dialect}.relay"].runs]

    def store_drain(self, dbs: StoreDatabases, template: str, count: int) -> RelayRun:
        db = dbs.clone(template)
        try:

            async def go() -> tuple[RelayRun, int | None]:
                target = await sink("rabbitmq").open()
                try:
                    run = await asyncio.to_thread(store_drain, db, target.url)
                    return run, await target.count()
                finally:
                    await target.close()

            run, arrived = asyncio.run(go())
        finally:
            dbs.drop(db)
        if run.warnings:
            raise RuntimeError("relay logged: " + " | ".join(run.warnings[:3]))
        if run.counts != {"PUBLISHED": count} or arrived != count:
            raise RuntimeError(f"drain left {run.counts}, {arrived} arrived")
        return quiet(run, run.box)

    def store_ceiling(self, dbs: StoreDatabases, template: str) -> tuple[float, dict[str, float]]:
        db = dbs.clone(template)
        try:
            rate, box = asyncio.run(_db_ceiling(db, BATCH, CONCURRENCY))
        finally:
            dbs.drop(db)
        return quiet((rate, box), box)

    # ----- 2. the simple relay ---------------------------------------------------------------

    def simple_once(self) -> float:
        db = self.dbs.clone(self.template, "simple")
        try:

            async def go() -> tuple[int, float, dict[str, float]]:
                target = await RabbitSink().open()
                try:
                    meter = BoxMeter().start()
                    published, seconds = await simple_relay(
                        db, AMQP_URL, target.tag, self.sizes.simple_seconds
                    )
                    return published, seconds, meter.stop()
                finally:
                    await target.close()

            published, seconds, box = asyncio.run(go())
        finally:
            self.dbs.drop(db)
        return quiet(published / seconds, box)

    def simple(self) -> None:
        for run in range(1, self.runs + 1):
            log(f"simple relay run {run}: {self.sizes.simple_seconds} s to rabbitmq")
            rate = attempt("simple relay", self.simple_once)
            self.report.add("simple_relay.rabbitmq", "msg/s", rate)
            log(f"  {rate:,.0f} msg/s")
        simple = self.report.figures["simple_relay.rabbitmq"].median
        ours = self.report.figures.get("throughput.relay.rabbitmq")
        if ours is None or not ours.runs:  # --only simple: measure ours here
            ours = Figure(
                "relay", "msg/s", [attempt("relay rabbitmq", lambda: self.drain("rabbitmq")).rate]
            )
            log(f"  outboxer relay: {ours.median:,.0f} msg/s")
        speedup = self.report.figure(
            "simple_relay.speedup",
            "x",
            note=f"outboxer relay ({ours.median:,.0f} msg/s) / simple relay, same backlog",
        )
        speedup.runs = [rate / simple for rate in ours.runs]
        most = self.report.figures.get("throughput.broker_max.rabbitmq")
        note = ""
        if most is None or not most.runs:  # --only simple: measure the broker maximum here
            messages = load_messages(self.template, self.sizes.broker_max_messages)
            most = Figure("broker max", "msg/s", [self.broker_max(messages)])
            note = f"; {self.broker_max_note()}"
        bound = self.report.figure(
            "simple_relay.speedup_bound",
            "x",
            note=f"broker max RabbitMQ ({most.median:,.0f} msg/s) / simple relay: the most any relay"
            f" could reach over the simple one on this box{note}",
        )
        bound.runs = [rate / simple for rate in most.runs]

    # ----- 3. write path ---------------------------------------------------------------------

    def write_once(self, db: str, count: int, mode: str, seed: int) -> dict[str, Any]:
        pool = self.pool()
        start_at = time.time() + 0.3 + 0.05 * count
        end_at = start_at + self.sizes.write_seconds
        futures = [
            pool.submit(writers.write_for, db, mode, start_at, end_at, self.sizes.keys, seed + i)
            for i in range(count)
        ]
        results = [future.result() for future in futures]
        late = max(result["late_s"] for result in results)
        if late > 0.02:
            raise RuntimeError(f"a writer started {late:.3f} s late")
        count = sum(r["count"] for r in results)
        return {
            "rate": count / self.sizes.write_seconds,
            "count": count,
            "latencies": [value for result in results for value in result["latencies_ms"]],
            "client_cpu_us": 1e6 * sum(r["client_cpu_s"] for r in results) / count,
            "server_cpu_us": 1e6 * sum(r["server_cpu_s"] for r in results) / count,
        }

    def write(self) -> None:
        report = self.report
        modes = writers.MODES
        for count in WRITERS:
            for relay_on in (False, True):
                base = f"write.w{count}.{'relay_on' if relay_on else 'relay_off'}"
                idle = (
                    " (control writes no outbox rows: the relay idles, as in bare runs)"
                    if relay_on
                    else ""
                )
                db = self.dbs.empty("write")
                writers.create_business_table(db)
                relay = None
                try:
                    if relay_on:
                        relay = RelayProcess(
                            db, f"memory://bench-{uuid.uuid4().hex[:8]}", exit_when_idle=False
                        )
                        wait_listening(db)
                    for run in range(1, self.runs + 1):
                        shift = (run - 1) % len(modes)  # rotate who goes first
                        got: dict[str, dict[str, Any]] = {}
                        for mode in modes[shift:] + modes[:shift]:
                            relay_cpu = cpu_of(relay.pid) if relay is not None else 0.0
                            got[mode] = attempt(
                                base, functools.partial(self.write_once, db, count, mode, run * 100)
                            )
                            if relay is not None and mode == "enqueue":
                                report.add(
                                    f"{base}.relay_cpu_us_per_msg",
                                    "CPU us/msg",
                                    1e6 * (cpu_of(relay.pid) - relay_cpu) / got[mode]["count"],
                                )
                        for mode in modes:
                            result, latencies = got[mode], got[mode]["latencies"]
                            report.add(f"{base}.{mode}.txn_per_s", "txn/s", result["rate"])
                            report.add(f"{base}.{mode}.p50_ms", "ms", percentile(latencies, 50))
                            report.add(f"{base}.{mode}.p99_ms", "ms", percentile(latencies, 99))
                            if relay is None:
                                report.add(
                                    f"{base}.{mode}.client_cpu_us",
                                    "CPU us/txn",
                                    result["client_cpu_us"],
                                )
                                report.add(
                                    f"{base}.{mode}.server_cpu_us",
                                    "CPU us/txn",
                                    result["server_cpu_us"],
                                )
                        rate = {mode: got[mode]["rate"] for mode in modes}
                        p50 = {mode: percentile(got[mode]["latencies"], 50) for mode in modes}
                        p99 = {mode: percentile(got[mode]["latencies"], 99) for mode in modes}
                        report.add(f"{base}.throughput_ratio", "x", rate["enqueue"] / rate["bare"])
                        report.add(f"{base}.p50_ratio", "x", p50["enqueue"] / p50["bare"])
                        report.add(f"{base}.p99_ratio", "x", p99["enqueue"] / p99["bare"])
                        report.add(
                            f"{base}.control_throughput_ratio",
                            "x",
                            rate["control"] / rate["bare"],
                            note="control / bare throughput: a plain INSERT of the same event,"
                            " no outboxer code" + idle,
                        )
                        report.add(
                            f"{base}.control_p50_ratio",
                            "x",
                            p50["control"] / p50["bare"],
                            note="control / bare p50" + idle,
                        )
                        report.add(
                            f"{base}.control_p99_ratio",
                            "x",
                            p99["control"] / p99["bare"],
                            note="control / bare p99" + idle,
                        )
                        report.add(
                            f"{base}.enqueue_over_control",
                            "x",
                            rate["enqueue"] / rate["control"],
                            note="enqueue / control throughput: what outboxer costs beyond writing"
                            " the event row (key lock, trigger, indexes, Python)"
                            + (" and the relay draining meanwhile" if relay_on else ""),
                        )
                        report.add(
                            f"{base}.table_over_control",
                            "x",
                            rate["table"] / rate["control"],
                            note="table / control throughput: the same INSERT into the outbox"
                            " table itself, no key lock, no outboxer code: what the table's"
                            " indexes, defaults and trigger cost",
                        )
                        report.add(
                            f"{base}.enqueue_over_table",
                            "x",
                            rate["enqueue"] / rate["table"],
                            note="enqueue / table throughput: what the key lock and outboxer's"
                            " Python cost beyond the table's own INSERT",
                        )
                        log(
                            f"{base} run {run}: "
                            + ", ".join(
                                f"{mode} {rate[mode]:,.0f} txn/s p99 {p99[mode]:.2f} ms"
                                for mode in modes
                            )
                        )
                    if relay is not None:
                        relay.terminate()
                        relay.reap(block=True)
                        if relay.status != 0:
                            raise RuntimeError(
                                f"write-path relay exited {relay.status}: {relay.output()}"
                            )
                finally:
                    if relay is not None:
                        relay.close()
                    self.dbs.drop(db)

    # ----- 4. latency ------------------------------------------------------------------------

    def latency(self) -> None:
        # Half the relay's maximum rate (section 1), from 4 writers committing at most
        # HALF_LOAD_TRANSACTIONS transactions/s (several messages each if need be), so that the
        # writers leave this 2-core machine's CPU to the relay, PostgreSQL and RabbitMQ.
        max_rate = self.median("throughput.relay.rabbitmq", 2000.0)
        half = self.sizes.half_rate or min(max_rate / 2, self.sizes.half_rate_cap)
        per_txn = max(1, math.ceil(half / HALF_LOAD_TRANSACTIONS))
        self.report.meta["latency"] = {
            "trickle_rate": 10,
            "half_rate": round(half),
            "half_writers": 4,
            "half_messages_per_transaction": per_txn,
        }
        for run in range(1, self.runs + 1):
            log(
                f"latency run {run}: 10 msg/s for {self.sizes.trickle_seconds} s, "
                f"{half:,.0f} msg/s for {self.sizes.half_seconds} s ({per_txn}/txn)"
            )
            plan = [
                ("trickle", 10.0, 1, 1, self.sizes.trickle_seconds),
                ("half", half / per_txn, 4, per_txn, self.sizes.half_seconds),
            ]
            loads = attempt("latency", functools.partial(self.latency_once, plan))
            for load, got in loads.items():
                values = got["latencies"]
                self.report.add(f"latency.{load}.rate", "msg/s", got["rate"])
                self.report.add(f"latency.{load}.p50_ms", "ms", percentile(values, 50))
                self.report.add(f"latency.{load}.p99_ms", "ms", percentile(values, 99))
                self.report.add(f"latency.{load}.max_ms", "ms", max(values))
                self.report.add(f"latency.{load}.box_busy", "cores", got["box"]["busy"])
                for who in ("postgres", "rabbitmq", "other"):
                    self.report.add(f"latency.{load}.box_{who}", "cores", got["box"].get(who, 0.0))
                self.report.add(f"latency.{load}.box_relay", "cores", got["box"]["client"])
                self.report.add(
                    f"latency.{load}.broker_box_busy", "cores", got["broker_box"]["busy"]
                )
                self.report.add(
                    f"latency.{load}.relay_cpu_us_per_msg",
                    "CPU us/msg",
                    got["relay_cpu_us_per_msg"],
                )
                arrivals = got["consumer"]
                self.report.add(f"latency.{load}.consumer_p50_ms", "ms", percentile(arrivals, 50))
                self.report.add(f"latency.{load}.consumer_p99_ms", "ms", percentile(arrivals, 99))
                control = got["broker"]
                self.report.add(f"latency.{load}.broker_p50_ms", "ms", percentile(control, 50))
                self.report.add(f"latency.{load}.broker_p99_ms", "ms", percentile(control, 99))
                log(
                    f"  {load}: {got['rate']:,.0f} msg/s, to confirm p50 {percentile(values, 50):.2f} ms, "
                    f"p99 {percentile(values, 99):.2f} ms, max {max(values):.2f} ms; to consumer p50 "
                    f"{percentile(arrivals, 50):.2f} ms, p99 {percentile(arrivals, 99):.2f} ms; "
                    f"box {_cores(got['box'])}; broker alone p50 {percentile(control, 50):.2f} ms, "
                    f"p99 {percentile(control, 99):.2f} ms, box {_cores(got['broker_box'])}"
                )

    def latency_once(
        self, plan: Sequence[Load], floor: Load | None = None
    ) -> dict[str, dict[str, Any]]:
        db = self.dbs.empty("latency")
        try:
            writers.create_business_table(db)
            return asyncio.run(self._latency_run(db, plan, floor))
        finally:
            self.dbs.drop(db)

    async def _latency_run(
        self, db: str, plan: Sequence[Load], floor: Load | None = None
    ) -> dict[str, dict[str, Any]]:
        """One relay (CLI, defaults) to a fresh exchange and queue, which a consumer drains;
        for each load of ``plan`` (name, transactions/s, writers, messages per transaction,
        seconds) in turn, latencies to the confirm and to the consumer. Then the control, without the relay:
        the writers commit the same events into a plain table at the same rate while one
        process publishes the same waves (one per transaction) straight to the same exchange
        through outboxer's publisher: what RabbitMQ, the consumer and the writers' database
        load alone cost in latency on this box.

        The confirm, as the relay sees it: ``published_at`` is the start of the settle that
        the relay runs once RabbitMQ confirmed the message, so it errs late (it includes the
        settle call's own wait), never early.

        ``floor``: one more load, after the relay is stopped, with the floor relay
        (bench/floor_relay.py) in its place, named ``floor.<name>``. ``per_batch``: messages
        per settle, each settle's rows sharing one ``published_at``.
        """
        target = await RabbitSink().open()
        arrived: dict[str, float] = {}

        async def on_message(message: Any) -> None:
            arrived.setdefault(str(message.message_id), time.time())

        relay = None
        loop = asyncio.get_running_loop()
        try:
            await target.consume(on_message)
            relay = RelayProcess(db, target.url, exit_when_idle=False)
            await asyncio.to_thread(wait_listening, db)

            async def paced(
                rate: float, count: int, messages: int, seconds: float
            ) -> dict[str, Any]:
                """``count`` writers commit ``rate`` transactions/s in all; latencies, CPU."""
                assert relay is not None
                start_at = time.time() + 0.3
                end_at = start_at + seconds
                futures = [
                    loop.run_in_executor(
                        self.pool(),
                        writers.write_paced,
                        db,
                        rate / count,
                        messages,
                        start_at,
                        end_at,
                        self.sizes.keys,
                        i,
                        "enqueue",
                        i / count,
                    )
                    for i in range(count)
                ]
                await asyncio.sleep(max(0.0, start_at - time.time()))
                meter, relay_cpu = BoxMeter().start(), cpu_of(relay.pid)
                results = await asyncio.gather(*futures)
                committed = [pair for result in results for pair in result["committed"]]
                confirmed = await asyncio.to_thread(
                    published_times, db, [mid for mid, _ in committed]
                )
                deadline = time.monotonic() + 15
                pending = [mid for mid, _ in committed]
                while any(mid not in arrived for mid in pending) and time.monotonic() < deadline:  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
                relay_cpu = cpu_of(relay.pid) - relay_cpu
                box = meter.stop(client_cpu=relay_cpu)
                missing = sum(mid not in arrived for mid, _ in committed)
                if missing:
                    raise RuntimeError(
                        f"{missing} of {len(committed)} messages never reached the consumer"
                    )
                # The control, no relay: the writers commit the same events into a plain table
                # while one process publishes the same waves straight to the same exchange.
                start_at = time.time() + 0.3
                end_at = start_at + seconds
                control_writers = [
                    loop.run_in_executor(
                        self.pool(),
                        writers.write_paced,
                        db,
                        rate / count,
                        messages,
                        start_at,
                        end_at,
                        self.sizes.keys,
                        100 + i,
                        "control",
                        i / count,
                    )
                    for i in range(count)
                ]
                publisher = loop.run_in_executor(
                    self.pool(),
                    publish_paced,
                    target.url,
                    rate,
                    messages,
                    start_at,
                    end_at,
                    self.sizes.keys,
                    99,
                )
                await asyncio.sleep(max(0.0, start_at - time.time()))
                meter = BoxMeter().start()
                control, *_ = await asyncio.gather(publisher, *control_writers)
                # A settle sets one published_at (its transaction's now()) on its whole batch.
                batches = len(set(confirmed.values()))
                return {
                    "rate": len(committed) / seconds,
                    "box": box,
                    "broker": control["latencies"],
                    "broker_box": meter.stop(),
                    "relay_cpu_us_per_msg": 1e6 * relay_cpu / len(committed),
                    "per_batch": len(committed) / batches if batches else math.nan,
                    "latencies": [(confirmed[mid] - at) * 1000.0 for mid, at in committed],
                    "consumer": [(arrived[mid] - at) * 1000.0 for mid, at in committed],
                }

            await paced(20, 1, 1, 1.0)  # warm up: relay awake, connections in use
            loads = {
                name: await paced(rate, count, messages, seconds)
                for name, rate, count, messages, seconds in plan
            }
            if floor is not None:
                relay.close()
                relay = FloorProcess(db, AMQP_URL, target.tag)
                await paced(20, 1, 1, 1.0)
                name, rate, count, messages, seconds = floor
                loads[f"floor.{name}"] = await paced(rate, count, messages, seconds)
            return loads
        finally:
            if relay is not None:
                relay.close()
            await target.close()

    # ----- 8. latency sweep -----------------------------------------------------------------

    def sweep(self) -> None:
        """Commit -> consumer (and -> confirm) latency at each of SWEEP_RATES, one relay."""
        plan = [
            (str(rate), float(rate), SWEEP_WRITERS, 1, self.sizes.sweep_seconds)
            for rate in SWEEP_RATES
        ]
        floor = (
            f"{SWEEP_FLOOR_RATE}",
            float(SWEEP_FLOOR_RATE),
            SWEEP_WRITERS,
            1,
            self.sizes.sweep_seconds,
        )
        for run in range(1, self.runs + 1):
            log(f"sweep run {run}: {', '.join(map(str, SWEEP_RATES))} commits/s, then the floor")
            loads = attempt("sweep", functools.partial(self.latency_once, plan, floor))
            floor_got = loads.pop(f"floor.{SWEEP_FLOOR_RATE}")
            relay_got = loads[str(SWEEP_FLOOR_RATE)]
            for what, value in (
                ("relay_cpu_us_per_msg", floor_got["relay_cpu_us_per_msg"]),
                ("per_batch", floor_got["per_batch"]),
                ("consumer_p50_ms", percentile(floor_got["consumer"], 50)),
            ):
                unit = dict(FIGURES["sweep"])[f"sweep.floor.{SWEEP_FLOOR_RATE}.{what}"]
                self.report.add(f"sweep.floor.{SWEEP_FLOOR_RATE}.{what}", unit, value)
            self.report.add(f"sweep.{SWEEP_FLOOR_RATE}.per_batch", "msg", relay_got["per_batch"])
            self.report.add(
                f"sweep.{SWEEP_FLOOR_RATE}.relay_over_floor",
                "x",
                relay_got["relay_cpu_us_per_msg"] / floor_got["relay_cpu_us_per_msg"],
            )
            waits = wake_costs()
            for what in WAKE_COSTS:
                self.report.add(f"sweep.control.{what}", "CPU us", waits[what])
            # The waits alone, spread over the relay's messages per batch at this load.
            self.report.add(
                f"sweep.control.{SWEEP_FLOOR_RATE}.cycle_waits_us_per_msg",
                "CPU us/msg",
                waits["cycle_waits_us"] / relay_got["per_batch"],
            )
            log(
                f"  a cycle's waits alone (idle box): {waits['cycle_waits_us']:.0f} CPU us "
                f"(timer {waits['timer_wake_us']:.0f}, PostgreSQL round trip "
                f"{waits['pg_round_trip_us']:.0f}, RabbitMQ confirm {waits['amqp_confirm_us']:.0f}), "
                f"{waits['cycle_waits_us'] / relay_got['per_batch']:.0f} us/msg at the relay's batch"
            )
            log(
                f"  floor at {SWEEP_FLOOR_RATE}/s: {floor_got['relay_cpu_us_per_msg']:.0f} CPU "
                f"us/msg at {floor_got['per_batch']:.1f} msg/batch (the relay: "
                f"{relay_got['relay_cpu_us_per_msg']:.0f} at {relay_got['per_batch']:.1f})"
            )
            for load, got in loads.items():
                figures = {
                    "rate": got["rate"],
                    "consumer_p50_ms": percentile(got["consumer"], 50),
                    "consumer_p99_ms": percentile(got["consumer"], 99),
                    "p50_ms": percentile(got["latencies"], 50),
                    "p99_ms": percentile(got["latencies"], 99),
                    "broker_p50_ms": percentile(got["broker"], 50),
                    "broker_p99_ms": percentile(got["broker"], 99),
                    "relay_cpu_us_per_msg": got["relay_cpu_us_per_msg"],
                    "box_busy": got["box"]["busy"],
                    "broker_box_busy": got["broker_box"]["busy"],
                }
                for what, unit in SWEEP_FIGURES:
                    self.report.add(f"sweep.{load}.{what}", unit, figures[what])
                log(
                    f"  {load}/s: consumer p50 {figures['consumer_p50_ms']:.2f} ms, p99 "
                    f"{figures['consumer_p99_ms']:.2f} ms; confirm p50 {figures['p50_ms']:.2f} ms; "
                    f"broker alone p50 {figures['broker_p50_ms']:.2f} ms; relay "
                    f"{figures['relay_cpu_us_per_msg']:.0f} CPU us/msg; box {_cores(got['box'])}"
                )

    # ----- 5. scaling ------------------------------------------------------------------------

    def scaling(self) -> None:
        report, seconds = self.report, self.sizes.scaling_seconds
        for run in range(1, self.runs + 1):
            for broker in SCALING_BROKERS:
                for batch in BATCH_SIZES:
                    result = attempt(
                        f"{broker} batch {batch}",
                        functools.partial(self.drain, broker, batch_size=batch, stop_after=seconds),
                    )
                    report.add(f"scaling.{broker}.batch.{batch}", "msg/s", result.rate)
                    log(f"scaling run {run}: {broker} batch {batch}: {result.rate:,.0f} msg/s")
            for count in RELAY_COUNTS:
                result = attempt(
                    f"{count} relays",
                    functools.partial(self.drain, "rabbitmq", relays=count, stop_after=seconds),
                )
                report.add(f"scaling.rabbitmq.relays.{count}", "msg/s", result.rate)
                log(f"scaling run {run}: {count} relays: {result.rate:,.0f} msg/s")
        for broker in SCALING_BROKERS:
            one = report.figures[f"scaling.{broker}.batch.1"].runs
            five = report.figures[f"scaling.{broker}.batch.500"].runs
            ratio = report.figure(
                f"scaling.{broker}.batch500_over_batch1", "x", note="paired per run"
            )
            ratio.runs = [b / a for a, b in zip(one, five, strict=True)]
        ceiling = report.figures.get("throughput.broker_ceiling.rabbitmq")
        if ceiling is None or not ceiling.runs:
            log(
                "scaling: no RabbitMQ broker ceiling in this run; batch500_over_batch1_bound skipped"
            )
            return
        bound = report.figure(
            "scaling.rabbitmq.batch500_over_batch1_bound",
            "x",
            note=f"broker ceiling ({ceiling.median:,.0f} msg/s) / batch 1: what batch"
            " 500 at exactly the ceiling would reach",
        )
        bound.runs = [
            ceiling.median / rate for rate in report.figures["scaling.rabbitmq.batch.1"].runs
        ]


def _cores(box: dict[str, float]) -> str:
    return ", ".join(
        f"{name} {cores:.2f}" for name, cores in box.items() if cores >= 0.05 and name != "seconds"
    )


async def _db_ceiling(url: str, batch: int, concurrency: int) -> tuple[float, dict[str, float]]:
    """The relay's claim and settle statements with no broker: everything counts as published."""
    store = create_store(url)
    await store.connect()
    relay_id = f"bench-db-ceiling-{os.getpid()}"
    total = 0

    async def loop() -> None:
        nonlocal total
        while True:
            claimed = await store.claim(DESTINATION, relay_id, batch, 60.0, False)
            if not claimed:
                return
            result = await store.settle(
                DESTINATION,
                claimed.lease,
                [m.stored_seq for m in claimed],
                [],
                [],
                SETTINGS.max_attempts,
            )
            total += result.published

    try:
        meter = BoxMeter().start()
        started = time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(concurrency)))
        seconds = time.perf_counter() - started
        box = meter.stop()
    finally:
        await store.close()
    return total / seconds, box


# ----- output -------------------------------------------------------------------------------


def _fmt(value: float, unit: str) -> str:
    if math.isnan(value):
        return "-"
    if unit in ("msg/s", "txn/s"):
        return f"{value:,.0f}"
    if unit == "x":
        return f"{value:.2f}"
    return f"{value:.3f}" if unit.startswith("CPU") else f"{value:.2f}"


def table(report: Report, sections: Sequence[str]) -> str:
    targets = {t.figure: t for t in TARGETS}
    lines = [f"{'figure':<44} {'median':>10} {'min':>10} {'max':>10}  {'unit':<13} target"]
    for section in sections:
        lines.append(f"-- {section} " + "-" * 90)
        for name, unit in FIGURES[section]:
            figure = report.figures.get(name, Figure(name, unit))
            goal = ""
            if name in targets:
                t = targets[name]
                goal = f"{t.op} {t.bound:g}  {'pass' if t.passed(figure.median) else 'FAIL'}"
            lines.append(
                f"{name:<44} {_fmt(figure.median, unit):>10} {_fmt(figure.low, unit):>10} "
                f"{_fmt(figure.high, unit):>10}  {unit:<13} {goal}"
            )
    return "\n".join(lines)


def wake_costs() -> dict[str, float]:
    """bench/wake_cost.py in a fresh interpreter: the CPU of each kind of wait of a cycle."""
    script = Path(__file__).resolve().parent / "wake_cost.py"
    done = subprocess.run(
        [sys.executable, str(script), ADMIN_URL],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    figures: dict[str, float] = json.loads(done.stdout)
    return figures


def sweep_table(report: Report) -> str:
    """The latency sweep, one row per load: medians of the runs."""
    columns = [what for what, _ in SWEEP_FIGURES]
    lines = ["commits/s  " + "  ".join(f"{c:>20}" for c in columns)]
    for rate in SWEEP_RATES:
        cells = []
        for what, unit in SWEEP_FIGURES:
            figure = report.figures.get(f"sweep.{rate}.{what}")
            cells.append(_fmt(figure.median, unit) if figure and figure.runs else "-")
        lines.append(f"{rate:>9,}  " + "  ".join(f"{cell:>20}" for cell in cells))
    return "\n".join(lines)


def sweep_plot(report: Report, path: Path) -> None:
    """The sweep as a PNG: commit -> consumer and commit -> confirm, p50 and p99, beside the
    control (the same waves straight to RabbitMQ, no relay), against the load."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit(
            "--plot needs matplotlib: .venv/bin/pip install matplotlib (the dev group)"
        ) from exc
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    series = (
        ("consumer_p50_ms", "commit -> consumer p50", "C0", "-"),
        ("consumer_p99_ms", "commit -> consumer p99", "C0", "--"),
        ("p50_ms", "commit -> confirm p50", "C1", "-"),
        ("p99_ms", "commit -> confirm p99", "C1", "--"),
        ("broker_p50_ms", "control (no relay) p50", "C7", "-"),
        ("broker_p99_ms", "control (no relay) p99", "C7", "--"),
    )
    for what, label, color, style in series:
        points = [
            (rate, report.figures[f"sweep.{rate}.{what}"].median)
            for rate in SWEEP_RATES
            if f"sweep.{rate}.{what}" in report.figures
        ]
        if points:
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, style, color=color, marker="o", label=label)
    for target in TARGETS:
        if target.figure.startswith("sweep.") and target.figure.endswith("_ms"):
            rate = int(target.figure.split(".")[1])
            ax.plot([rate], [target.bound], "x", color="C3", markersize=9)
    ax.plot([], [], "x", color="C3", label="targets")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(list(SWEEP_RATES), [f"{r:,}" for r in SWEEP_RATES])
    ax.set_xlabel("commits/s (one message each, 4 writers)")
    ax.set_ylabel("ms (median of runs)")
    load = report.meta.get("loadavg_start", [math.nan])[0]
    ax.set_title(f"outboxer latency sweep ({report.meta.get('git', '')}, load avg {load:.1f})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _clean(value: Any) -> Any:
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def as_json(report: Report, sections: Sequence[str]) -> dict[str, Any]:
    names = [name for section in sections for name, _ in FIGURES[section]]
    figures = {name: report.figures[name].as_dict() for name in names if name in report.figures}
    targets = [
        {
            "figure": t.figure,
            "target": f"{t.op} {t.bound:g}",
            "text": t.text,
            "value": report.figures[t.figure].median if t.figure in report.figures else None,
            "pass": t.passed(report.figures[t.figure].median)
            if t.figure in report.figures
            else None,
        }
        for t in TARGETS
        if t.figure in names
    ]
    return _clean({"meta": report.meta, "figures": figures, "targets": targets})


def _git() -> str:
    """The commit measured, with ``+dirty`` if src/ has uncommitted changes."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], capture_output=True, text=True, cwd=Path(__file__).parent, check=False
        ).stdout.strip()

    try:
        return git("rev-parse", "--short", "HEAD") + (
            "+dirty" if git("status", "--porcelain", "../src") else ""
        )
    except OSError:
        return "?"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one run (smoke test)")
    parser.add_argument("--json", metavar="FILE", help="write the figures here")
    parser.add_argument("--runs", type=int, help="runs per figure (default 3, --quick 1)")
    parser.add_argument("--only", help=f"comma-separated sections of {','.join(SECTIONS)}")
    parser.add_argument(
        "--half-rate",
        type=float,
        metavar="MSG_PER_S",
        help="the latency section's 'half' load, instead of half the relay's rate",
    )
    parser.add_argument("--plot", metavar="PNG", help="draw the latency sweep here")
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    global RETAKE_NOISY
    RETAKE_NOISY = not args.quick
    if args.runs:
        sizes = Sizes(**{**asdict(sizes), "runs": args.runs})
    if args.half_rate is not None:
        if args.half_rate <= 0:
            parser.error("--half-rate must be positive")
        sizes = Sizes(**{**asdict(sizes), "half_rate": args.half_rate})
    sections = [s.strip() for s in args.only.split(",")] if args.only else list(SECTIONS)
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")

    report = Report()
    started = time.time()
    report.meta.update(
        {
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "quick": args.quick,
            "sizes": asdict(sizes),
            "relay": {"batch_size": BATCH, "concurrency": CONCURRENCY},
            "outboxer": outboxer.__version__,
            "git": _git(),
            "cpus": os.cpu_count(),
            "loadavg_start": os.getloadavg(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
    )
    wait_for_services(timeout=10)
    bench = Bench(sizes, report)
    report.meta["run_id"] = bench.dbs.run_id  # databases are outboxer_bench_<run_id>_*
    try:
        bench.prepare()
        for section in sections:
            began = time.time()
            getattr(bench, section)()
            report.meta.setdefault("section_seconds", {})[section] = round(time.time() - began, 1)
    finally:
        bench.close()
    report.meta["seconds"] = round(time.time() - started, 1)
    report.meta["noisy"] = NOISY
    report.meta["loadavg_end"] = os.getloadavg()
    print(table(report, sections))
    if "sweep" in sections:
        print("\nlatency sweep (medians)\n" + sweep_table(report))
        if args.plot:
            sweep_plot(report, Path(args.plot))
            log(f"wrote {args.plot}")
    print(
        f"\n{len(report.figures)} figures; whole run {report.meta['seconds']:.0f} s; "
        f"load average at start {report.meta['loadavg_start'][0]:.2f}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(as_json(report, sections), indent=2) + "\n")
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
