"""A claim-check store read that hangs (a hard NFS mount that stopped answering): the
consumer's fetch fails the message retryably after ``object_store_timeout``, hung reads never
hold more than READ_THREADS threads of a store, and a hung read never keeps the process from
exiting."""

from __future__ import annotations

import asyncio
import sqlite3
import subprocess
import sys
import textwrap
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest

from outboxer import claimcheck
from outboxer.brokers.memory import memory_broker
from outboxer.claimcheck import (
    READ_THREADS,
    ClaimCheck,
    FileObjectStore,
    ObjectReadTimeoutError,
    fetch_payload_async,
)
from outboxer.consumer import Consumer, Delivery
from outboxer.message import Message
from outboxer.retry import Backoff
from outboxer.testing import make_message

FAST = Backoff(base=0.01, multiplier=2, cap=0.05, jitter=0)
ROOT = Path(__file__).resolve().parents[2]


class HangingStore(FileObjectStore):
    """Its first ``hangs`` reads block until ``release`` is set (as a read of a dead NFS
    server does, for ever); later ones answer."""

    def __init__(self, directory: Path, hangs: int) -> None:
        super().__init__(directory)
        self.hangs = hangs
        self.release = threading.Event()
        self.entered = 0
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []

    def _hang(self) -> None:
        with self.lock:
            self.entered += 1
            hang = self.entered <= self.hangs
            self.threads.append(threading.current_thread())
        if hang:
            self.release.wait()

    def get(self, name: str) -> bytes:
        self._hang()
        return super().get(name)

    def get_at_most(self, name: str, max_size: int) -> bytes:
        self._hang()
        return super().get_at_most(name, max_size)


def offloaded(store: FileObjectStore, n: int) -> Message:
    return ClaimCheck(store, threshold=10).offload(
        make_message("t", {"n": n, "x": "y" * 50}, key=f"k{n}")
    )


def test_a_hung_read_fails_the_message_retryably_and_the_next_attempt_applies_it(
    sqlite_url: str, tmp_path: Path
) -> None:
    broker = f"unit-{uuid.uuid4().hex[:8]}"
    memory_broker(broker).clear()
    store = HangingStore(tmp_path / "objects", hangs=1)
    message = offloaded(store, 1)
    memory_broker(broker).messages.append(message)
    seen: list[Delivery] = []

    def keep(delivery: Delivery, conn: sqlite3.Connection) -> None:
        seen.append(delivery)

    consumer = Consumer(
        db=sqlite_url,
        broker=f"memory://{broker}",
        group="g",
        handler=keep,
        exit_when_idle=True,
        backoff=FAST,
        max_attempts=3,
        object_store=store,
    )
    # Long enough for the second, answering, read on a loaded machine.
    consumer.object_store_timeout = 1.0

    async def main() -> Any:
        try:
            # Bounded here so that a fetch with no timeout fails this test, not hangs it.
            return await asyncio.wait_for(consumer.run_async(), 15)
        finally:
            store.release.set()  # the hung read's thread may end now

    stats = asyncio.run(main())
    assert [d.payload["n"] for d in seen] == [1]
    assert (stats.failed, stats.applied, stats.dead_lettered) == (1, 1, 0)
    assert store.entered == 2


async def test_hung_reads_hold_at_most_read_threads_threads_of_a_store(tmp_path: Path) -> None:
    store = HangingStore(tmp_path / "objects", hangs=10_000)
    messages = [offloaded(store, n) for n in range(3 * READ_THREADS)]
    try:
        for _ in range(2):  # a second wave finds every slot still taken: no new thread
            results = await asyncio.gather(
                *(fetch_payload_async(m, store, timeout=0.1) for m in messages),
                return_exceptions=True,
            )
            assert all(isinstance(r, ObjectReadTimeoutError) for r in results), results
            # Slots are taken before a thread starts: this count is exact at once.
            assert claimcheck._read_threads(store).running == READ_THREADS
            assert store.entered <= READ_THREADS
        assert all(thread.daemon for thread in store.threads)
        assert "still running" in str(results[0])
    finally:
        store.release.set()
    # Freed, the slots serve reads again.
    store.hangs = 0
    for thread in store.threads:
        thread.join(5)
    fetched = await fetch_payload_async(messages[0], store, timeout=5)
    assert fetched.payload.startswith(b'{"n":0,')


async def test_a_read_that_times_out_while_waiting_for_a_slot_passes_no_slot_on(
    tmp_path: Path,
) -> None:
    store = HangingStore(tmp_path / "objects", hangs=READ_THREADS)
    messages = [offloaded(store, n) for n in range(READ_THREADS + 5)]
    try:
        results = await asyncio.gather(
            *(fetch_payload_async(m, store, timeout=0.1) for m in messages),
            return_exceptions=True,
        )
        assert all(isinstance(r, ObjectReadTimeoutError) for r in results)
    finally:
        store.release.set()
    for thread in list(store.threads):
        thread.join(5)
    reads = claimcheck._read_threads(store)
    assert reads.running == 0
    # All slots free again: READ_THREADS reads at once all answer.
    fetched = await asyncio.gather(
        *(fetch_payload_async(m, store, timeout=5) for m in messages[:READ_THREADS])
    )
    assert len(fetched) == READ_THREADS


async def test_a_timeout_the_read_itself_raises_is_the_stores_answer(tmp_path: Path) -> None:
    class SocketTimeout(FileObjectStore):
        def get_at_most(self, name: str, max_size: int) -> bytes:
            raise TimeoutError("read timed out (the store's own socket timeout)")

    store = SocketTimeout(tmp_path / "objects")
    message = offloaded(store, 1)
    with pytest.raises(TimeoutError, match="socket timeout") as caught:
        await fetch_payload_async(message, store, timeout=5)
    assert not isinstance(caught.value, ObjectReadTimeoutError)


def test_a_consumer_with_a_hung_read_still_exits(sqlite_url: str, tmp_path: Path) -> None:
    """Its worker gave up on the read: the read's thread must not hold the process either
    (a pool's threads are joined at exit, asyncio.run's default executor's too)."""
    script = textwrap.dedent(
        f"""
        import asyncio, sqlite3, threading, uuid
        from outboxer.brokers.memory import memory_broker
        from outboxer.claimcheck import ClaimCheck, FileObjectStore
        from outboxer.consumer import Consumer
        from outboxer.retry import Backoff
        from outboxer.testing import make_message

        class Dead(FileObjectStore):
            def get(self, name):
                threading.Event().wait()
            def get_at_most(self, name, max_size):
                threading.Event().wait()

        store = Dead({str(tmp_path / "objects")!r})
        broker = "exit-" + uuid.uuid4().hex[:8]
        memory_broker(broker).messages.append(
            ClaimCheck(store, threshold=10).offload(make_message("t", {{"x": "y" * 50}}))
        )
        consumer = Consumer(
            db={sqlite_url!r}, broker="memory://" + broker, group="g",
            handler=lambda d, c: None, exit_when_idle=True, max_attempts=1,
            backoff=Backoff(base=0.01, cap=0.05, jitter=0), object_store=store,
        )
        consumer.object_store_timeout = 0.2
        stats = asyncio.run(consumer.run_async())
        print("dead-lettered", stats.dead_lettered)
        """
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", script],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
        )
    except subprocess.TimeoutExpired as exc:  # run kills it
        pytest.fail(f"the consumer never exited: {exc.stderr!r:.300}")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "dead-lettered 1" in done.stdout
    with sqlite3.connect(sqlite_url.removeprefix("sqlite:///")) as conn:
        [(error,)] = conn.execute("SELECT error FROM dead_letters").fetchall()
    assert error.startswith("ObjectReadTimeoutError")


async def test_a_store_class_that_is_not_hashable_still_fetches_with_a_timeout(
    tmp_path: Path,
) -> None:
    class Unhashable(FileObjectStore):
        __hash__ = None  # type: ignore[assignment]  # as a plain @dataclass has

    store = Unhashable(tmp_path / "objects")
    message = offloaded(store, 7)
    fetched = await fetch_payload_async(message, store, timeout=5)
    assert fetched.payload.startswith(b'{"n":7,')
