"""A consumer whose key ring fetches keys from a KMS (KeyRing.from_callable) must not block
its event loop while a fetch is under way: the relay fetches off the loop, and so must the
consumer (a KMS that takes seconds would otherwise freeze every lane, heartbeat and timer)."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import threading
import uuid
from typing import Any

from outboxer.brokers.memory import memory_broker
from outboxer.consumer import Consumer, Delivery
from outboxer.crypto import KeyRing, encrypt_message
from outboxer.message import Message
from outboxer.retry import Backoff
from outboxer.testing import make_message

FAST = Backoff(base=0.01, multiplier=2, cap=0.05, jitter=0)


def test_a_kms_fetch_does_not_block_the_consumer_loop(sqlite_url: str) -> None:
    key = os.urandom(32)
    sealed = encrypt_message(make_message("t", {"n": 1}, key="a"), KeyRing({"k1": key}))
    broker = f"unit-{uuid.uuid4().hex[:8]}"
    memory_broker(broker).clear()
    memory_broker(broker).messages.append(sealed)
    with sqlite3.connect(sqlite_url.removeprefix("sqlite:///")) as conn:
        conn.execute("CREATE TABLE applied (n INT)")

    fetching = threading.Event()
    loop_ran = threading.Event()  # set by a task on the consumer's loop
    answered: list[bool] = []

    def fetch(key_id: str) -> bytes | None:
        fetching.set()
        # The loop sets this unless the fetch is blocking it.
        answered.append(loop_ran.wait(timeout=3))
        return key if key_id == "k1" else None

    def record(delivery: Delivery, conn: sqlite3.Connection) -> None:
        conn.execute("INSERT INTO applied VALUES (?)", (delivery.payload["n"],))

    consumer = Consumer(
        db=sqlite_url,
        broker=f"memory://{broker}",
        group="g",
        handler=record,
        keyring=KeyRing.from_callable(fetch, "k1"),
        exit_when_idle=True,
        backoff=FAST,
    )

    async def main() -> Any:
        async def on_the_loop() -> None:
            while not fetching.is_set():
                await asyncio.sleep(0.002)
            loop_ran.set()

        watcher = asyncio.create_task(on_the_loop())
        stats = await consumer.run_async()
        watcher.cancel()
        return stats

    stats = asyncio.run(main())
    assert answered == [True], "the KMS fetch blocked the consumer's event loop"
    assert stats.applied == 1
    with sqlite3.connect(sqlite_url.removeprefix("sqlite:///")) as conn:
        assert conn.execute("SELECT n FROM applied").fetchall() == [(1,)]


def test_a_hostile_key_id_is_a_bounded_dead_letter_and_never_reaches_the_kms(
    sqlite_url: str,
) -> None:
    from outboxer.crypto import HEADER_KEY_ID

    real = encrypt_message(make_message("t", {"n": 1}, key="a"), KeyRing({"k1": os.urandom(32)}))
    hostile = Message(
        id=real.id,
        topic=real.topic,
        payload=real.payload,
        key=real.key,
        headers={**real.headers, HEADER_KEY_ID: "../" + "A" * 100_000},
        content_type=real.content_type,
        destination=real.destination,
    )
    broker = f"unit-{uuid.uuid4().hex[:8]}"
    memory_broker(broker).clear()
    memory_broker(broker).messages.append(hostile)
    asked: list[str] = []

    def fetch(key_id: str) -> bytes | None:
        asked.append(key_id)
        return None

    consumer = Consumer(
        db=sqlite_url,
        broker=f"memory://{broker}",
        group="g",
        handler=lambda delivery, conn: None,
        keyring=KeyRing.from_callable(fetch, "k1"),
        exit_when_idle=True,
        backoff=FAST,
    )
    stats = asyncio.run(consumer.run_async())
    assert asked == []
    assert stats.dead_lettered == 1
    with sqlite3.connect(sqlite_url.removeprefix("sqlite:///")) as conn:
        [(error, attempts)] = conn.execute("SELECT error, attempts FROM dead_letters").fetchall()
    assert attempts == 0 and error.startswith("KeyNotFoundError")
    assert len(error) < 300
