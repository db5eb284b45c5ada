"""The consumer's KMS key fetch (a callable key ring) no longer runs on a fixed pool.

It ran on one process-wide pool of four threads: four calls that never returned held them
all, and every later fetch, of any ring, of any consumer in the process, queued behind
them and timed out after ``object_store_timeout`` without reaching its KMS, until a
restart. It is the relay's bounded fetch now (``crypto.fetch_key_bounded``): one daemon
thread per fetch, at most four left running per key ring; past that, that ring's fetches
fail at once ("have not returned", retryable: an attempt counted, not acked), and once one
of them returns the ring is asked again.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from outboxer.brokers.memory import memory_broker
from outboxer.consumer import Consumer, Delivery
from outboxer.crypto import KeyRing, encrypt_message
from outboxer.payload_relay import MAX_ABANDONED_FETCHES  # the relay's, shared
from outboxer.retry import Backoff
from outboxer.testing import make_message

#: The consumer's bound for a key fetch here (object_store_timeout).
BOUND = 0.2
FAST = Backoff(base=0.01, multiplier=1, cap=0.01, jitter=0)
KEY = os.urandom(32)


@pytest.fixture
def hang() -> Iterator[threading.Event]:
    """Set at the end: the hung KMS calls return, and their threads end before the next
    test (the per-ring cap counts them until then)."""
    event = threading.Event()
    yield event
    event.set()
    deadline = time.monotonic() + 5
    for thread in threading.enumerate():
        if thread.name == "outboxer-key-fetch":
            thread.join(max(0.0, deadline - time.monotonic()))


def sealed_on(broker: str) -> None:
    memory_broker(broker).clear()
    message = make_message("t", {"n": 1}, key="a")
    memory_broker(broker).messages.append(encrypt_message(message, KeyRing({"k1": KEY})))


def applied(sqlite_url: str, group: str) -> list[tuple[Any, ...]]:
    with sqlite3.connect(sqlite_url.removeprefix("sqlite:///")) as conn:
        return conn.execute("SELECT grp, n FROM applied WHERE grp = ?", (group,)).fetchall()


def consumer_for(sqlite_url: str, broker: str, group: str, ring: KeyRing) -> Consumer:
    def record(delivery: Delivery, conn: sqlite3.Connection) -> None:
        conn.execute("INSERT INTO applied VALUES (?, ?)", (group, delivery.payload["n"]))

    return Consumer(
        db=sqlite_url,
        broker=f"memory://{broker}",
        group=group,
        handler=record,
        keyring=ring,
        object_store_timeout=BOUND,
        max_attempts=1000,  # the message must outlive the outage, not be dead-lettered
        backoff=FAST,
        exit_when_idle=True,
    )


async def until(check: Any, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return True
        await asyncio.sleep(0.01)
    return bool(check())


@pytest.fixture
def table(sqlite_url: str) -> str:
    with sqlite3.connect(sqlite_url.removeprefix("sqlite:///")) as conn:
        conn.execute("CREATE TABLE applied (grp TEXT, n INT)")
    return sqlite_url


def test_past_four_hung_calls_the_ring_fails_at_once_and_decrypts_once_the_kms_answers(
    table: str, hang: threading.Event
) -> None:
    """A KMS whose first five calls hang until it recovers (``hang`` set): the consumer goes
    on failing the message retryably, at once rather than one bound per attempt, without a
    thread more per attempt, and applies it once the KMS answers."""
    calls: list[str] = []

    def kms(key_id: str) -> bytes:
        calls.append(key_id)
        if len(calls) <= 5:
            hang.wait()
        return KEY

    broker = f"unit-{uuid.uuid4().hex[:8]}"
    sealed_on(broker)
    consumer = consumer_for(table, broker, "g", KeyRing.from_callable(kms, "k1"))

    async def main() -> None:
        run = asyncio.create_task(consumer.run_async())
        try:
            # Four attempts wait out the bound, their calls left running.
            assert await until(lambda: consumer.stats.failed >= MAX_ABANDONED_FETCHES, 5)
            # The next ones find the ring's four calls still running and fail at once: ten
            # in half the time one of them took queued behind the hung calls.
            since = consumer.stats.failed
            started = time.monotonic()
            fast = await until(lambda: consumer.stats.failed >= since + 10, 5 * BOUND)
            assert fast, (
                f"{consumer.stats.failed - since} failed attempts in {5 * BOUND:g} s "
                f"({time.monotonic() - started:.2f} s): each waited the bound behind the "
                "hung calls"
            )
            assert len(calls) == MAX_ABANDONED_FETCHES, calls  # no thread more per attempt
            assert applied(table, "g") == []
            hang.set()  # the KMS answers again: the hung calls return the key
            assert await until(lambda: applied(table, "g") == [("g", 1)], 5), (
                "the message was not applied once the KMS answered"
            )
        finally:
            consumer.stop()
            await asyncio.wait_for(run, 10)

    asyncio.run(main())
    assert consumer.stats.applied == 1
    assert consumer.stats.dead_lettered == 0


def test_a_hung_kms_behind_one_ring_leaves_another_consumers_ring_fetching(
    table: str, hang: threading.Event
) -> None:
    """Two consumers in one process, each with its KMS: the one that never answers no
    longer takes the other's fetches with it (a shared pool of four threads did, for as
    long as the process lived)."""
    hung_calls: list[str] = []

    def silent_kms(key_id: str) -> bytes:
        hung_calls.append(key_id)
        hang.wait()
        return KEY

    healthy_calls: list[str] = []

    def healthy_kms(key_id: str) -> bytes:
        healthy_calls.append(key_id)
        return KEY

    silent_broker = f"unit-{uuid.uuid4().hex[:8]}"
    healthy_broker = f"unit-{uuid.uuid4().hex[:8]}"
    sealed_on(silent_broker)
    sealed_on(healthy_broker)
    silent = consumer_for(table, silent_broker, "silent", KeyRing.from_callable(silent_kms, "k1"))
    healthy = consumer_for(
        table, healthy_broker, "healthy", KeyRing.from_callable(healthy_kms, "k1")
    )

    async def main() -> None:
        first = asyncio.create_task(silent.run_async())
        try:
            assert await until(lambda: len(hung_calls) >= MAX_ABANDONED_FETCHES, 5)
            assert await until(lambda: silent.stats.failed >= MAX_ABANDONED_FETCHES + 1, 5)
            # The other consumer's KMS answers: its message is applied in a few attempts.
            await asyncio.wait_for(healthy.run_async(), 5)
        finally:
            silent.stop()
            await asyncio.wait_for(first, 10)

    asyncio.run(main())
    assert healthy_calls == ["k1"]
    assert applied(table, "healthy") == [("healthy", 1)]
    assert applied(table, "silent") == []
