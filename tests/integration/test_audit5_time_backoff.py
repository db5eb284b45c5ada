"""The backoff of a message with a very large attempt count: computed at once, not by one
multiplication per attempt, which blocked the relay's event loop for seconds a batch (its
lease renewals, its HTTP API and its other loops waited). PostgreSQL, a real HTTP receiver."""

from __future__ import annotations

import asyncio
import math
import time

import psycopg
import pytest

from outboxer import Backoff
from outboxer.testing import eventually
from tests.receiver import Delivery, Receiver
from tests.relaying import enqueue, relay

ATTEMPTS = 999_000


def test_nominal_delay_of_a_huge_attempt_count_is_immediate() -> None:
    # A multiplier of 1 never reaches the cap: the old loop ran once per attempt (a billion
    # steps here, about a minute); computed, it takes microseconds. The bound is generous.
    started = time.perf_counter()
    assert Backoff(5.0, 1.0, 300.0, 0.0).nominal(10**9) == 5.0
    assert Backoff(1.0, 1.0000001, 300.0, 0.0).nominal(10**7) == pytest.approx(math.e, rel=1e-6)
    assert Backoff(1.0, 2.0, 300.0, 0.0).nominal(10**18) == 300.0
    assert time.perf_counter() - started < 1.0


def unavailable(_: Delivery) -> tuple[int, bytes]:
    return 503, b"try later"


async def test_settling_a_batch_at_a_million_attempts_does_not_stall_the_relay(
    pg_url: str,
) -> None:
    """200 failing messages at their 999,001st attempt of a constant-delay policy (multiplier
    1, max_attempts 1,000,000): the settle took 35 ms a message, 7 s in which the relay's
    event loop ran nothing else."""
    enqueue(pg_url, *[("t", None)] * 200)
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("UPDATE outboxer.outbox SET attempts = %s", (ATTEMPTS,))
    receiver = Receiver(answer=unavailable).start()
    worst = 0.0

    async def tick() -> None:
        nonlocal worst
        while True:
            before = time.monotonic()
            await asyncio.sleep(0.01)
            worst = max(worst, time.monotonic() - before)

    async def settled() -> bool:
        with psycopg.connect(pg_url) as conn:
            row = conn.execute("SELECT min(attempts) FROM outboxer.outbox").fetchone()
        return row is not None and row[0] > ATTEMPTS

    worker = relay(
        pg_url,
        receiver.url,
        backoff_base=1.0,
        backoff_multiplier=1.0,
        backoff_max=60.0,
        max_attempts=1_000_000,
        batch_size=200,
    )
    ticker = asyncio.create_task(tick())
    task = asyncio.create_task(worker.run())
    try:
        await eventually(settled, timeout=30)
    finally:
        worker.stop()
        await asyncio.wait_for(task, 30)
        ticker.cancel()
        receiver.stop()
    assert worst < 2.0, f"the relay's event loop stood still for {worst:.1f}s"
