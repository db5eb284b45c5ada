"""Scenario 2: the RabbitMQ node restarts (stopped, started again) during a drain."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from tests.chaos.harness import (
    RabbitSink,
    RelayFleet,
    SteadyWriter,
    Workload,
    finish,
    relay_args,
    report,
    retried,
    sleep_until,
    wait_for_drain,
    wait_for_progress,
)
from tests.chaos.servers import PrivateRabbitMQ

KEYS = [f"key-{k:02d}" for k in range(50)]
MESSAGES = 6_000
WRITE_SECONDS = 12.0


@pytest.mark.timeout(240)
def test_rabbitmq_restart_during_a_drain(
    chaos_db: str,
    private_rabbitmq: PrivateRabbitMQ,
    rabbit_sink: RabbitSink,
    make_fleet: Callable[..., RelayFleet],
) -> None:
    workload = Workload()
    fleet = make_fleet(
        chaos_db, private_rabbitmq.url(rabbit_sink.exchange), relay_args(publish_timeout=5)
    )
    fleet.start(2)
    writer = SteadyWriter(workload, chaos_db, KEYS, MESSAGES, MESSAGES / WRITE_SECONDS)
    started = time.monotonic()
    writer.start()

    sleep_until(started + 3.0)
    stopped_at = time.monotonic()
    try:
        private_rabbitmq.stop()
    finally:
        private_rabbitmq.start()
    back_at = time.monotonic()
    recover_s = wait_for_progress(chaos_db)

    writer.finish(timeout=60)
    wait_for_drain(rabbit_sink, workload, chaos_db)
    drained = time.monotonic() - started
    # A publish the broker took but whose confirm the restart swallowed fails, counts an
    # attempt and goes out again: those are the messages in flight at the restart.
    verdict = finish(fleet, workload, rabbit_sink, in_flight_at_faults=retried(chaos_db))
    report(
        "rabbitmq_restart",
        faults=1,
        down_s=back_at - stopped_at,
        messages=verdict.messages,
        rolled_back=verdict.rolled_back,
        duplicates=verdict.duplicates,
        broker_redeliveries=verdict.broker_redeliveries,
        recover_s=recover_s,
        offered_msg_s=MESSAGES / WRITE_SECONDS,
        throughput_msg_s=verdict.messages / drained,
        seconds=drained,
        log_lines=verdict.log_lines,
    )
    assert rabbit_sink.connects >= 2, "the consumer saw the broker go away and come back"
