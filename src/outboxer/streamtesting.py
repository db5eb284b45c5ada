"""The contract every offset-read outbox mode passes against a real PostgreSQL.

The counterpart of ``testing.py``'s store contract for outboxes without per-message
status (log mode, the WAL outbox). A test module subclasses :class:`StreamContract` and
provides ``harness`` (a fixture returning a :class:`StreamHarness`); pytest runs every
contract test against that mode. This module imports pytest: import it only from tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from outboxer.brokers.memory import MemoryBroker, MemoryPublisher, memory_broker
from outboxer.enqueue import Outbox
from outboxer.errors import PublishError
from outboxer.message import Message
from outboxer.streamrelay import StreamSource, run_stream_relay

PG_BIN = Path(os.environ.get("OUTBOXER_PG_BIN", "/usr/lib/postgresql/15/bin"))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _as_postgres(command: list[str]) -> list[str]:
    """initdb and pg_ctl refuse to run as root: run them as the postgres user then."""
    return ["runuser", "-u", "postgres", "--", *command] if os.geteuid() == 0 else command


@contextlib.contextmanager
def private_postgres(*, fsync: bool = False) -> Iterator[str]:
    """A private PostgreSQL with wal_level=logical on a free port, for as long as the block
    runs; yields its admin URL. The shared server must not be restarted to change its
    wal_level while others use it. Raises FileNotFoundError without PostgreSQL's binaries
    in PG_BIN (OUTBOXER_PG_BIN)."""
    if not (PG_BIN / "initdb").exists():
        raise FileNotFoundError(f"no PostgreSQL binaries in {PG_BIN} (set OUTBOXER_PG_BIN)")
    base = Path(tempfile.mkdtemp(prefix="outboxer-logical-pg-"))
    data, sockets = base / "data", base / "sockets"
    sockets.mkdir()
    if os.geteuid() == 0:
        shutil.chown(base, "postgres")
        shutil.chown(sockets, "postgres")
    initdb = [str(PG_BIN / "initdb"), "-D", str(data), "-U", "postgres", "-A", "trust"]
    subprocess.run(_as_postgres(initdb), check=True, capture_output=True)
    options = (
        f"-p {_free_port()} -k {sockets} -c listen_addresses=127.0.0.1 -c wal_level=logical "
        f"-c max_replication_slots=20 -c max_wal_senders=10 -c fsync={'on' if fsync else 'off'}"
    )
    pg_ctl = [str(PG_BIN / "pg_ctl"), "-D", str(data)]
    start = [*pg_ctl, "-o", options, "-l", str(base / "log"), "-w", "start"]
    subprocess.run(_as_postgres(start), check=True, capture_output=True)
    port = options.split()[1]
    try:
        yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
    finally:
        stop = [*pg_ctl, "-m", "fast", "-w", "stop"]
        subprocess.run(_as_postgres(stop), check=False, capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


class StreamHarness(ABC):
    """One outbox in one mode on a fresh database."""

    #: Whether a writer of a key waits for the key's uncommitted writer (log mode does:
    #: it orders by writer; the WAL outbox needs no wait: decoding is in commit order).
    key_writers_wait = False

    def __init__(self, url: str, outbox: Outbox) -> None:
        self.url = url
        self.outbox = outbox

    @abstractmethod
    def source(self, destination: str) -> StreamSource:
        """A new source for ``destination`` (resuming from its stored checkpoint)."""

    @abstractmethod
    def relay_args(self, destination: str) -> list[str]:
        """Arguments of ``python -m outboxer.streamrelay`` that relay ``destination``."""


async def _connect(url: str) -> Any:
    import psycopg

    return await psycopg.AsyncConnection.connect(url)


@contextlib.asynccontextmanager
async def running_relay(
    harness: StreamHarness,
    destination: str,
    *,
    batch_size: int,
    fail: Callable[[Message], BaseException | None] | None = None,
) -> AsyncIterator[MemoryBroker]:
    """A stream relay for ``destination`` publishing into a fresh memory broker, running
    until the block ends (then stopped, its checkpoint stored)."""
    name = f"stream-{uuid.uuid4().hex[:8]}"
    broker = memory_broker(name)
    broker.fail = fail
    source = harness.source(destination)
    await source.connect()
    stop = asyncio.Event()
    relay = asyncio.create_task(
        run_stream_relay(
            source,
            MemoryPublisher(f"memory://{name}"),
            stop=stop,
            batch_size=batch_size,
            poll_interval=0.01,
            max_backoff=0.05,
        )
    )
    try:
        yield broker
    finally:
        stop.set()
        await relay
        await source.close()


async def drain(
    harness: StreamHarness, destination: str, expected: int, *, timeout: float = 20.0
) -> list[Message]:
    """Run a relay for ``destination`` into a fresh memory broker until ``expected``
    messages arrived; return them (the relay has stopped and stored its checkpoint)."""
    async with running_relay(harness, destination, batch_size=50) as broker:
        await wait_until(lambda: len(broker.messages) >= expected, timeout)
        # Give the relay one more round: anything beyond ``expected`` shows up too.
        await asyncio.sleep(0.1)
    return list(broker.messages)


async def wait_until(done: Callable[[], bool], timeout: float, interval: float = 0.02) -> bool:
    """Poll ``done`` (a real server's state) until it holds or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while True:
        if done():
            return True
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(interval)


def numbers(messages: Sequence[Message]) -> list[int]:
    return [int(json.loads(m.payload)["n"]) for m in messages]


class StreamContract:
    """Tests every offset-read mode passes; ``harness`` is the subclass's fixture."""

    async def enqueue_committed(
        self, harness: StreamHarness, items: Sequence[tuple[str | None, int]]
    ) -> None:
        conn = await _connect(harness.url)
        async with conn:
            for key, n in items:
                await harness.outbox.enqueue_async(conn, "orders", {"n": n}, key=key)
            await conn.commit()

    async def test_publishes_each_committed_message_once_in_order(
        self, harness: StreamHarness
    ) -> None:
        await self.enqueue_committed(harness, [(f"k{n % 3}", n) for n in range(40)])
        got = await drain(harness, "default", 40)
        assert numbers(got) == list(range(40))
        assert {m.key for m in got} == {"k0", "k1", "k2"}
        assert all(m.topic == "orders" for m in got)
        # The checkpoint was stored: a new relay has nothing left to publish.
        assert await drain(harness, "default", 1, timeout=0.5) == []

    async def test_rolled_back_message_is_never_published(self, harness: StreamHarness) -> None:
        conn = await _connect(harness.url)
        async with conn:
            await harness.outbox.enqueue_async(conn, "orders", {"n": -1})
            await conn.rollback()
        await self.enqueue_committed(harness, [(None, 1)])
        assert numbers(await drain(harness, "default", 1)) == [1]

    async def test_late_commit_is_not_skipped(self, harness: StreamHarness) -> None:
        """A transaction that began (and wrote) first but commits last is still published,
        even after a relay published and checkpointed rows committed before it."""
        slow = await _connect(harness.url)
        async with slow:
            await slow.execute("SELECT pg_current_xact_id()")  # the older xid, taken first
            await harness.outbox.enqueue_async(slow, "orders", {"n": 100})
            await self.enqueue_committed(harness, [(None, n) for n in range(5)])
            early = await drain(harness, "default", 5, timeout=1.5)
            await slow.commit()
        later = await drain(harness, "default", 6 - len(early))
        assert sorted(numbers(early) + numbers(later)) == [0, 1, 2, 3, 4, 100]
        assert len(early) + len(later) == 6  # nothing published twice, nothing skipped

    async def test_racing_writers_of_one_key_keep_commit_order(
        self, harness: StreamHarness
    ) -> None:
        """The writer with the older transaction id writes a key second, after the younger
        writer's uncommitted row of the same key: the key's messages come in commit order."""
        older = await _connect(harness.url)
        younger = await _connect(harness.url)
        async with older, younger:
            await older.execute("SELECT pg_current_xact_id()")
            await younger.execute("SELECT pg_current_xact_id()")
            await harness.outbox.enqueue_async(younger, "orders", {"n": 1}, key="k")
            second = asyncio.create_task(
                harness.outbox.enqueue_async(older, "orders", {"n": 2}, key="k")
            )
            if harness.key_writers_wait:
                await _wait_until_blocked(harness.url, older)
            await younger.commit()
            await second
            await older.commit()
        assert numbers(await drain(harness, "default", 2)) == [1, 2]

    async def test_many_racing_writers_lose_nothing_and_keep_key_order(
        self, harness: StreamHarness
    ) -> None:
        writers = 8
        per_writer = 25

        async def write(w: int) -> None:
            conn = await _connect(harness.url)
            async with conn:
                for i in range(per_writer):
                    # One key per transaction: a transaction taking several keys over
                    # separate calls, in its own order, can deadlock with another.
                    await harness.outbox.enqueue_async(
                        conn, "orders", {"n": w * 1000 + i}, key=f"k{(w + i // 5) % 4}"
                    )
                    if i % 5 == 4:
                        await conn.commit()
                await conn.commit()

        async with running_relay(harness, "default", batch_size=7) as broker:
            await asyncio.gather(*(write(w) for w in range(writers)))
            await wait_until(lambda: len(broker.messages) >= writers * per_writer, 20)
        got = numbers(broker.messages)
        assert sorted(got) == sorted(
            w * 1000 + i for w in range(writers) for i in range(per_writer)
        )
        # Order is kept per key (messages of different keys are published side by side):
        # each writer's messages of one key arrive in the order it committed them.
        by_key: dict[tuple[int, str | None], list[int]] = {}
        for message, n in zip(broker.messages, got, strict=True):
            by_key.setdefault((n // 1000, message.key), []).append(n)
        assert len(by_key) >= writers
        for sequence in by_key.values():
            assert sequence == sorted(sequence)

    async def test_failed_publish_stops_the_stream_there_and_resumes(
        self, harness: StreamHarness
    ) -> None:
        await self.enqueue_committed(harness, [("k", n) for n in range(10)])
        failures = {"left": 2}

        def fail(message: Message) -> BaseException | None:
            if json.loads(message.payload)["n"] == 4 and failures["left"] > 0:
                failures["left"] -= 1
                return PublishError("refused once more")
            return None

        async with running_relay(harness, "default", batch_size=3, fail=fail) as broker:
            await wait_until(lambda: len(broker.messages) >= 10, 10)
        published = numbers(broker.messages)
        # 5..9 never went ahead of 4. What was confirmed before the failure may come again
        # (the WAL outbox checkpoints whole transactions), never out of order.
        assert list(dict.fromkeys(published)) == list(range(10))
        assert published[-6:] == [4, 5, 6, 7, 8, 9]
        assert failures["left"] == 0

    async def test_relay_survives_losing_its_database_connections(
        self, harness: StreamHarness
    ) -> None:
        await self.enqueue_committed(harness, [("k", n) for n in range(3)])
        async with running_relay(harness, "default", batch_size=10) as broker:
            assert await wait_until(lambda: len(broker.messages) >= 3, 20)
            killer = await _connect(harness.url)
            async with killer:
                await killer.set_autocommit(True)
                cursor = await killer.execute(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid()"
                )
                terminated = await cursor.fetchone()
            assert terminated is not None and terminated[0] >= 1
            await self.enqueue_committed(harness, [("k", n) for n in range(3, 6)])
            await wait_until(lambda: len(set(numbers(broker.messages))) >= 6, 20)
        published = numbers(broker.messages)
        assert list(dict.fromkeys(published)) == list(range(6))

    async def test_destinations_read_independently(self, harness: StreamHarness) -> None:
        await self.enqueue_committed(harness, [(None, n) for n in range(6)])
        first = await drain(harness, "alpha", 6)
        await self.enqueue_committed(harness, [(None, 6)])
        second = await drain(harness, "beta", 7)
        assert numbers(first) == list(range(6))
        assert numbers(second) == list(range(7))
        assert {m.destination for m in second} == {"beta"}
        assert numbers(await drain(harness, "alpha", 1)) == [6]

    async def test_relay_killed_with_sigkill_resumes_without_loss(
        self, harness: StreamHarness, tmp_path: Path
    ) -> None:
        total = 400
        for start in range(0, total, 10):  # transactions of 10: the WAL outbox checkpoints each
            await self.enqueue_committed(
                harness, [(f"k{n % 5}", n) for n in range(start, start + 10)]
            )
        out = tmp_path / "published.jsonl"
        command = [
            sys.executable,
            "-m",
            "outboxer.streamrelay",
            *harness.relay_args("default"),
            "--broker",
            f"file://{out}",
            "--batch-size",
            "20",
        ]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        first = await asyncio.create_subprocess_exec(*command, env=env)
        try:
            await wait_until(lambda: _lines(out) >= total // 4, 30, 0.005)
            first.send_signal(signal.SIGKILL)
        finally:
            await asyncio.wait_for(first.wait(), 10)
        killed_at = _lines(out)
        assert 0 < killed_at < total, "the relay must be killed mid-stream"
        second = await asyncio.create_subprocess_exec(*command, env=env)
        try:
            await wait_until(lambda: len(set(_numbers_in(out))) >= total, 30, 0.05)
        finally:
            second.send_signal(signal.SIGTERM)
            await asyncio.wait_for(second.wait(), 10)
        published = _numbers_in(out)
        assert set(published) == set(range(total))
        # Redelivered at most the batch in flight when killed; each key in order on every pass.
        assert len(published) - total <= 40
        firsts = list(dict.fromkeys(published))
        for key in range(5):
            mine = [n for n in firsts if n % 5 == key]
            assert mine == sorted(mine)


async def _wait_until_blocked(url: str, conn: Any) -> None:
    pid = conn.info.backend_pid
    watcher = await _connect(url)
    async with watcher:
        await watcher.set_autocommit(True)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            cursor = await watcher.execute(
                "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)
            )
            row = await cursor.fetchone()
            if row is not None and row[0] == "Lock":
                return
            await asyncio.sleep(0.01)
    raise AssertionError("the second writer of the key never waited for the first")


def _lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def _numbers_in(path: Path) -> list[int]:
    if not path.exists():
        return []
    text = path.read_text("utf-8")
    complete = text[: text.rfind("\n") + 1]
    return [int(json.loads(line)["payload"]["n"]) for line in complete.splitlines() if line]
