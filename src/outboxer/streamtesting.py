"""The contract every offset-read outbox mode passes against a real PostgreSQL.

The counterpart of ``testing.py``'s store contract for outboxes without per-message
status (log mode, the WAL outbox). A test module subclasses :class:`StreamContract` and
provides ``harness`` (a fixture returning a :class:`StreamHarness`); pytest runs every
contract test against that mode. This module imports pytest: import it only from tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
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
from outboxer.retry import Backoff
from outboxer.stores.base import MAX_ERROR_LENGTH
from outboxer.stores.pgstream import DeadLetter, StoredLetter, StreamFailure
from outboxer.streamrelay import StreamRelay, StreamSource, replay_dead_letters, run_stream_relay

PG_BIN = Path(os.environ.get("OUTBOXER_PG_BIN", "/usr/lib/postgresql/15/bin"))
#: Seconds a test waits for committed messages to be read. A log reader reads a row only
#: once no running transaction of the whole cluster can precede it: on a shared server,
#: another session's long transaction holds every reader back for that long.
VISIBLE = 30.0


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
    pg_ctl = [str(PG_BIN / "pg_ctl"), "-D", str(data)]
    # From here on a failure (initdb refused, the port taken) stops and removes what was
    # made: a data directory, maybe a server left running by a start that timed out.
    try:
        sockets.mkdir()
        if os.geteuid() == 0:
            shutil.chown(base, "postgres")
            shutil.chown(sockets, "postgres")
        initdb = [str(PG_BIN / "initdb"), "-D", str(data), "-U", "postgres", "-A", "trust"]
        subprocess.run(_as_postgres(initdb), check=True, capture_output=True)
        port = _free_port()
        options = (
            f"-p {port} -k {sockets} -c listen_addresses=127.0.0.1 -c wal_level=logical "
            f"-c max_replication_slots=20 -c max_wal_senders=10 "
            f"-c fsync={'on' if fsync else 'off'}"
        )
        start = [*pg_ctl, "-o", options, "-l", str(base / "log"), "-w", "start"]
        try:
            subprocess.run(_as_postgres(start), check=True, capture_output=True)
        except subprocess.CalledProcessError as exc:
            # The server's log says why, and is removed below with the rest.
            log = base / "log"
            exc.add_note(log.read_text(errors="replace")[-2000:] if log.exists() else "no log")
            raise
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
        """Arguments of ``outboxer stream-relay`` (``python -m outboxer.streamrelay``) that
        relay ``destination``."""


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
    try:  # closed even when the relay stopped with an error (refused options, a lost slot)
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
    finally:
        await source.close()


@contextlib.asynccontextmanager
async def running_stream_relay(
    harness: StreamHarness,
    destination: str,
    *,
    fail: Callable[[Message], BaseException | None] | None = None,
    batch_size: int = 50,
    **options: Any,
) -> AsyncIterator[tuple[MemoryBroker, StreamRelay]]:
    """A ``StreamRelay`` for ``destination`` (``options`` are its keyword arguments) into a
    fresh memory broker, until the block ends; yields the broker and the relay."""
    name = f"stream-{uuid.uuid4().hex[:8]}"
    broker = memory_broker(name)
    broker.fail = fail
    source = harness.source(destination)
    await source.connect()
    try:  # closed even when the relay refused its options or stopped with an error
        relay = StreamRelay(
            source,
            MemoryPublisher(f"memory://{name}"),
            batch_size=batch_size,
            poll_interval=0.01,
            outage_backoff_max=0.05,
            **options,
        )
        stop = asyncio.Event()
        task = asyncio.create_task(relay.run(stop))
        try:
            yield broker, relay
        finally:
            stop.set()
            await task
    finally:
        await source.close()


async def stream_book(
    harness: StreamHarness, destination: str
) -> tuple[list[StoredLetter], dict[int, StreamFailure]]:
    """The stream's dead letters (oldest first) and failing messages, as stored."""
    source = harness.source(destination)
    await source.attach()
    try:
        letters = await source.book.letters(source.conn, 1000)
        failures = await source.book.failures(source.conn)
    finally:
        await source.close()
    return letters, failures


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


def _number(message: Message) -> int:
    return int(json.loads(message.payload)["n"])


def _in_key_order(messages: Sequence[Message]) -> bool:
    """Whether each key's messages first arrived in ascending ``n`` (repeats allowed)."""
    keys = {_number(m): m.key for m in messages}
    by_key: dict[str | None, list[int]] = {}
    for n in dict.fromkeys(numbers(messages)):
        by_key.setdefault(keys[n], []).append(n)
    return all(sequence == sorted(sequence) for sequence in by_key.values())


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

    # ----- retries, dead letters ---------------------------------------------------------

    async def test_poison_message_backs_off_then_becomes_a_dead_letter(
        self, harness: StreamHarness
    ) -> None:
        """A message the broker keeps refusing is tried ``max_attempts`` times, each wait
        the backoff of its attempts so far, then dead-lettered (its error stored safely,
        however hostile); the stream goes past it and its key's later messages go on."""
        await self.enqueue_committed(harness, [(f"k{n % 3}", n) for n in range(10)])
        tried: list[float] = []
        hostile = "refused\x00" + "x" * 100_000

        def fail(message: Message) -> BaseException | None:
            if _number(message) == 4:
                tried.append(time.monotonic())
                return PublishError(hostile)
            return None

        backoff = Backoff(0.1, 2.0, 1.0, 0.25)
        async with running_stream_relay(
            harness, "default", fail=fail, batch_size=4, max_attempts=3, backoff=backoff
        ) as (broker, relay):
            assert await wait_until(
                lambda: relay.stats.dead_lettered == 1 and len(set(numbers(broker.messages))) == 9,
                VISIBLE,
            )
        assert len(tried) == 3
        for attempts, (before, after) in enumerate(itertools.pairwise(tried), 1):
            assert after - before >= backoff.bounds(attempts)[0]
        assert set(numbers(broker.messages)) == set(range(10)) - {4}
        assert _in_key_order(broker.messages)
        assert relay.stats.failed == 3 and relay.failing == 0
        letters, failures = await stream_book(harness, "default")
        assert failures == {}
        [letter] = letters
        assert _number(letter.message) == 4 and letter.message.key == "k1"
        assert letter.attempts == 3 and not letter.held
        assert letter.error.startswith("PublishError: refused\ufffdxxx")
        assert len(letter.error) <= MAX_ERROR_LENGTH and "\x00" not in letter.error
        assert await drain(harness, "default", 1, timeout=0.5) == []  # the stream went past it

    async def test_refused_for_good_is_a_dead_letter_at_once(self, harness: StreamHarness) -> None:
        await self.enqueue_committed(harness, [("k", 1), ("k", 2)])

        def fail(message: Message) -> BaseException | None:
            return PublishError("too large", retryable=False) if _number(message) == 1 else None

        async with running_stream_relay(harness, "default", fail=fail, max_attempts=5) as (
            broker,
            relay,
        ):
            assert await wait_until(lambda: 2 in numbers(broker.messages), VISIBLE)
        letters, _ = await stream_book(harness, "default")
        assert [(_number(letter.message), letter.attempts) for letter in letters] == [(1, 1)]
        assert relay.stats.failed == 1

    async def test_restart_keeps_the_attempt_count(self, harness: StreamHarness) -> None:
        await self.enqueue_committed(harness, [("k", 1), ("k", 2)])
        tried: list[int] = []

        def fail(message: Message) -> BaseException | None:
            if _number(message) == 1:
                tried.append(1)
                return PublishError("still down")
            return None

        # 50 ms after the first failure, then 10 s: the first relay stops after two attempts.
        slow = Backoff(0.05, 200.0, 10.0, 0.0)
        async with running_stream_relay(
            harness, "default", fail=fail, max_attempts=3, backoff=slow
        ) as (broker, _):
            assert await wait_until(lambda: len(tried) == 2, VISIBLE)
        _, failures = await stream_book(harness, "default")
        assert [failure.attempts for failure in failures.values()] == [2]
        async with running_stream_relay(
            harness, "default", fail=fail, max_attempts=3, backoff=slow
        ) as (broker, relay):
            assert await wait_until(lambda: numbers(broker.messages) == [2], VISIBLE)
        assert len(tried) == 3  # one attempt left after the restart, not three
        letters, failures = await stream_book(harness, "default")
        assert [(_number(letter.message), letter.attempts) for letter in letters] == [(1, 3)]
        assert failures == {} and relay.stats.dead_lettered == 1

    async def test_message_given_up_by_a_relay_that_died_is_not_tried_again(
        self, harness: StreamHarness
    ) -> None:
        """A relay died after counting the last attempt (and maybe after writing the dead
        letter) but before its checkpoint moved past the message: the next relay
        dead-letters it, once, without publishing it."""
        await self.enqueue_committed(harness, [(None, 1), (None, 2)])
        source = harness.source("default")
        await source.connect()
        try:
            # A log reader sees a row once no running transaction of the cluster can still
            # precede it: another session's open transaction hides it for a while.
            found: list[Message] = []
            deadline = time.monotonic() + VISIBLE
            while not found and time.monotonic() < deadline:
                entries = await source.read(10)
                found = [e.message for e in entries if e.message and _number(e.message) == 1]
                await asyncio.sleep(0 if found else 0.02)
            [first] = found
            for _ in range(3):
                await source.record_failure(first, "the dead relay's error")
            await source.book.write_letters(source.conn, [DeadLetter(first, "written", 3)])
        finally:
            await source.close()
        async with running_stream_relay(harness, "default", max_attempts=3) as (broker, relay):
            assert await wait_until(lambda: numbers(broker.messages) == [2], VISIBLE)
            assert await wait_until(
                lambda: relay.stats.commits >= 1 and relay.failing == 0, VISIBLE
            )
        letters, failures = await stream_book(harness, "default")
        assert [(_number(letter.message), letter.error) for letter in letters] == [(1, "written")]
        assert failures == {}

    async def test_abandoned_blocks_key_holds_the_key_until_replayed(
        self, harness: StreamHarness
    ) -> None:
        await self.enqueue_committed(harness, [(f"k{n % 3}", n) for n in range(9)])
        poisoned = {"on": True}

        def fail(message: Message) -> BaseException | None:
            if _number(message) == 4 and poisoned["on"]:
                return PublishError("k1's broker queue is full")
            return None

        quick = Backoff(0.05, 2.0, 0.2, 0.0)
        async with running_stream_relay(
            harness, "default", fail=fail, max_attempts=2, backoff=quick, abandoned_blocks_key=True
        ) as (broker, relay):
            assert await wait_until(
                lambda: (
                    relay.stats.dead_lettered == 2
                    and set(numbers(broker.messages)) == set(range(9)) - {4, 7}
                ),
                VISIBLE,
            )
            letters, _ = await stream_book(harness, "default")
            assert [(_number(x.message), x.held, x.attempts) for x in letters] == [
                (4, False, 2),
                (7, True, 0),
            ]
            poisoned["on"] = False
            replayer = harness.source("default")
            await replayer.attach()  # beside the running relay
            try:
                counts = await replay_dead_letters(
                    replayer, MemoryPublisher(f"memory://{broker.name}"), abandoned_blocks_key=True
                )
            finally:
                await replayer.close()
            assert counts.as_dict() == {"replayed": 2, "failed": 0, "skipped": 0}
            assert numbers(broker.messages)[-2:] == [4, 7]
            await self.enqueue_committed(harness, [("k1", 100)])  # the key is free again
            assert await wait_until(lambda: numbers(broker.messages)[-1:] == [100], VISIBLE)
        assert relay.stats.held == 1
        assert await stream_book(harness, "default") == ([], {})

    async def test_status_and_metrics_show_how_far_behind(self, harness: StreamHarness) -> None:
        from outboxer.stream_api import stream_metrics
        from outboxer.stream_cli import stream_status

        await self.enqueue_committed(harness, [(None, 0)])
        assert numbers(await drain(harness, "default", 1)) == [0]  # a log reader registers
        await self.enqueue_committed(harness, [("k", n) for n in range(1, 6)])
        settings, own = _status_settings(harness, "default")
        [stream] = (await stream_status(settings, own))["streams"]
        assert stream["destination"] == "default"
        assert (stream["entries_behind"], stream["entries_behind_capped"]) == (5, False)
        assert stream["oldest_unpublished_age_seconds"] >= 0
        assert (stream["dead_letters"], stream["failing"]) == (0, 0)
        async with running_stream_relay(harness, "default", probe_interval=0.05) as (broker, relay):
            metrics = stream_metrics(relay)  # before the relay publishes: the latencies too
            assert await wait_until(lambda: len(broker.messages) == 5, VISIBLE)
            assert await wait_until(
                lambda: relay.stats.backlog is not None and relay.stats.backlog.entries == 0,
                VISIBLE,
            )
            text = metrics.render()[0].decode()
        labels = f'destination="default",mode="{relay.mode}"'
        for series in (
            f"outboxer_stream_messages_published_total{{{labels}}} 5.0",
            f"outboxer_stream_dead_letters_total{{{labels}}} 0.0",
            f"outboxer_stream_entries_behind{{{labels}}} 0.0",
            f"outboxer_stream_lag_seconds{{{labels}}} 0.0",
            f"outboxer_stream_failing_messages{{{labels}}} 0.0",
            'outboxer_publish_latency_seconds_count{database="default",destination="default"} 5.0',
        ):
            assert series in text, series
        assert f"outboxer_stream_checkpoint_age_seconds{{{labels}}}" in text
        assert ("outboxer_stream_wal_retained_bytes" in text) == (relay.mode == "wal")
        assert "outboxer_store_up" not in text  # no outbox table here
        [stream] = (await stream_status(settings, own))["streams"]
        assert stream["entries_behind"] == 0 and stream["oldest_unpublished_age_seconds"] == 0
        if relay.mode == "wal":
            assert stream["wal_retained_bytes"] > 0 and stream["slot"].endswith("_default")


def _status_settings(harness: StreamHarness, destination: str) -> tuple[Any, Any]:
    """The settings ``outboxer stream-relay status`` would load from the harness's flags."""
    from outboxer.config import load_stream_settings

    args = harness.relay_args(destination)
    given = {
        flag.lstrip("-").replace("-", "_").replace("database", "db"): value
        for flag, value in zip(args[::2], args[1::2], strict=True)
    }
    shared: dict[str, object] = {
        name: given.pop(name) for name in ("db", "schema", "table") if name in given
    }
    return load_stream_settings(shared, given, environ={})


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
