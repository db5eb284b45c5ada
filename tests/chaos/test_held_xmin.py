"""Scenario 6: an unrelated transaction held open (xmin held back) while the relay drains.

Every claim and settle leaves a dead row version behind, and while an old snapshot is open
none of them can be cleaned up, so a claim that walked them all would slow down as the
drain goes on. Two relays drain the same backlog at the same time, one in a database where
a transaction holds its snapshot for the whole drain, one in a database where none does:
both share the box's noise, and the first must keep 0.8 of the second's throughput.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import psycopg
import pytest

from tests.chaos.harness import (
    RabbitSink,
    RelayFleet,
    Workload,
    finish,
    relay_args,
    report,
    wait_for_drain,
)
from tests.chaos.servers import PrivateRabbitMQ

MESSAGES = 20_000
KEYS = [f"key-{k:04d}" for k in range(1000)]
#: The relay's defaults (batch 500, concurrency 4, a 60 s lease): a drain, no fault of its own.
RELAY_ARGS = relay_args(batch_size=500, concurrency=4, lock_timeout=60)


@pytest.mark.timeout(180)
def test_a_transaction_holding_xmin_back_does_not_slow_the_relay(
    make_chaos_db: Callable[[], str],
    private_rabbitmq: PrivateRabbitMQ,
    make_rabbit_sink: Callable[[], RabbitSink],
    make_fleet: Callable[..., RelayFleet],
) -> None:
    held_db, free_db = make_chaos_db(), make_chaos_db()
    # A report somebody left open: REPEATABLE READ keeps its snapshot, and so the database's
    # xmin horizon, from its first query until it ends; it never touches the outbox.
    holder = psycopg.connect(held_db)
    try:
        holder.execute("CREATE TABLE monthly_report (total numeric)")
        holder.commit()
        holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT count(*) FROM monthly_report")
        runs = {}
        for name, db in (("held", held_db), ("free", free_db)):
            workload = Workload()
            workload.write_backlog(db, KEYS, MESSAGES, transaction_size=500, rollback_every=20)
            sink = make_rabbit_sink()
            runs[name] = (
                workload,
                sink,
                make_fleet(db, private_rabbitmq.url(sink.exchange), RELAY_ARGS),
            )
        started = time.monotonic()
        for _, _, fleet in runs.values():
            fleet.spawn()
        for workload, sink, fleet in runs.values():
            wait_for_drain(sink, workload, fleet.db_url, 120)
        drained = time.monotonic() - started
        with psycopg.connect(held_db) as conn:
            row = conn.execute(
                "SELECT age(backend_xmin) FROM pg_stat_activity WHERE pid = %s",
                (holder.info.backend_pid,),
            ).fetchone()
        xmin_age = int(row[0]) if row and row[0] is not None else 0
    finally:
        holder.close()

    throughput = {}
    for name, (workload, sink, fleet) in runs.items():
        finish(fleet, workload, sink, in_flight_at_faults=set())
        deliveries = sink.deliveries
        throughput[name] = workload.messages / (deliveries[-1].at - deliveries[0].at)
    ratio = throughput["held"] / throughput["free"]
    report(
        "held_xmin",
        faults=1,
        messages=runs["held"][0].messages,
        xmin_age_xids=xmin_age,
        throughput_msg_s=throughput["held"],
        baseline_msg_s=throughput["free"],
        ratio=ratio,
        seconds=drained,
    )
    # Each batch's claim and settle take a transaction id: the horizon stayed behind them.
    assert xmin_age > 2 * MESSAGES / 500, f"the snapshot held xmin back: age {xmin_age}"
    assert ratio >= 0.8, (
        f"with xmin held back the relay published {throughput['held']:.0f} msg/s, "
        f"{ratio:.2f} of the {throughput['free']:.0f} msg/s it managed beside it without"
    )
