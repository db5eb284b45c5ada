"""Scenario 3: a broker made slow by a delaying proxy, so that a batch takes longer to publish
than the relay's lease (``--lock-timeout``), with a stall and a cut on top: each key's
messages must still go out in order, from one holder at a time."""

from __future__ import annotations

import ast
import time
from collections.abc import Callable

import pytest

from tests.chaos.harness import (
    RabbitSink,
    RelayFleet,
    Workload,
    finish,
    going_back,
    order_violations,
    relay_args,
    report,
    retried,
    sleep_until,
    wait_for_drain,
)
from tests.chaos.proxy import FaultProxy
from tests.chaos.servers import PrivateRabbitMQ

KEYS = [f"key-{k:02d}" for k in range(40)]
MESSAGES = 320
#: Each way, so a wave (one message per key, confirmed before the next) takes 0.5 s or more.
DELAY = 0.25
LOCK_TIMEOUT = 1.0
#: Longer than the lease, shorter than the publish timeout.
STALL_SECONDS = 2.0
#: 80 rows over 40 keys: 4 waves or more, 2 s or more, longer than the lease.
BATCH = 80


def relay_stats(fleet: RelayFleet) -> list[dict[str, float]]:
    """The counters each relay logged when it stopped."""
    return [
        ast.literal_eval(line.split(" stopped: ", 1)[1])
        for line in fleet.lines()
        if " stopped: {" in line
    ]


@pytest.mark.timeout(180)
def test_slow_broker_with_a_lease_shorter_than_a_batch_keeps_key_order(
    chaos_db: str,
    private_rabbitmq: PrivateRabbitMQ,
    rabbit_sink: RabbitSink,
    make_fleet: Callable[..., RelayFleet],
) -> None:
    workload = Workload()
    workload.write_backlog(chaos_db, KEYS, MESSAGES, transaction_size=25, rollback_every=4)
    proxy = FaultProxy(private_rabbitmq.port).start()
    try:
        proxy.delay(DELAY)
        broker_url = private_rabbitmq.url(rabbit_sink.exchange).replace(
            f":{private_rabbitmq.port}/", f":{proxy.port}/"
        )
        args = relay_args(
            batch_size=BATCH, lock_timeout=LOCK_TIMEOUT, backoff_max=1, publish_timeout=10
        )
        fleet = make_fleet(chaos_db, broker_url, args)
        started = time.monotonic()
        fleet.start(2)
        sleep_until(started + 4.0)
        proxy.stall()
        time.sleep(STALL_SECONDS)
        proxy.resume()
        sleep_until(started + 8.0)
        cut = proxy.cut()

        wait_for_drain(
            rabbit_sink,
            workload,
            chaos_db,
            60,
            also=lambda: (
                f"relays logged {fleet.log_count('taken over by another relay')} "
                f"takeover(s) of their batches; deliveries of a message after a later one of "
                f"its key so far: {going_back(workload, rabbit_sink.deliveries)[:8]}; first "
                f"deliveries out of key order: {order_violations(workload, rabbit_sink.deliveries)[:8]}"
            ),
        )
        drained = time.monotonic() - started
    finally:
        proxy.stop()

    back = going_back(workload, rabbit_sink.deliveries)
    assert not back, (
        f"a key's messages went out from two holders at once ({len(back)} deliveries of a "
        f"message after a later one of its key, e.g. {back[:8]}); relays logged "
        f"{fleet.log_count('taken over by another relay')} takeover(s) of their batches"
    )
    # The cut fails the publishes in flight: they count an attempt and go out again.
    verdict = finish(fleet, workload, rabbit_sink, in_flight_at_faults=retried(chaos_db))
    stats = relay_stats(fleet)
    batch_publish_s = sum(s["publish_seconds"] for s in stats) / max(
        sum(s["batches"] for s in stats), 1
    )
    report(
        "slow_broker",
        faults=3,
        delay_s=DELAY,
        lock_timeout_s=LOCK_TIMEOUT,
        batch_publish_s=batch_publish_s,
        connections_cut=cut,
        messages=verdict.messages,
        rolled_back=verdict.rolled_back,
        duplicates=verdict.duplicates,
        throughput_msg_s=verdict.messages / drained,
        seconds=drained,
        log_lines=verdict.log_lines,
    )
    assert batch_publish_s > LOCK_TIMEOUT, "the scenario needs batches that outlast the lease"
