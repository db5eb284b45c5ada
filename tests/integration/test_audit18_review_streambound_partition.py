"""The stream relay's reader lock after a network partition: the relay gives its sessions up
(the statement bound, then a close cut after CLOSE_TIMEOUT), but the server never hears of
it. Its lock session sat idle (idle_session_timeout off, by design), sends nothing, and so
lives on at the server until TCP keepalive finds the peer gone: about two hours and eleven
minutes with Linux's defaults, for ever with keepalives off. It still holds the reader's
advisory lock: once the partition healed, every reconnect of the relay was refused
"already being read by another relay" by its own abandoned session.

The proxy here models the partition: nothing passes either way, and once it heals the
client's side of the old connections is gone while the server's side stays open, silent.
Now the lock ends the session it gave up (the same process and backend start, so never
another relay's) before it takes the lock again.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from typing import Any

import psycopg
import pytest

from outboxer.enqueue import Outbox
from outboxer.errors import StoreError
from outboxer.stores import pgmodes
from outboxer.stores.pglog import LogReader, PgLog
from outboxer.stores.pgstream import DeadLetter
from outboxer.streamrelay import Entry
from tests.integration.test_audit18_stream_db_hung import target

BOUND = 0.5


@pytest.fixture(autouse=True)
def _short_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pgmodes, "COMMAND_TIMEOUT", BOUND)
    monkeypatch.setattr(pgmodes, "CONNECT_TIMEOUT", BOUND * 4)
    monkeypatch.setattr(pgmodes, "CLOSE_TIMEOUT", BOUND)
    monkeypatch.setattr(pgmodes, "LOCK_CHECK_SECONDS", BOUND)


class PartitionProxy:
    """Forwards 127.0.0.1:<port> to PostgreSQL. ``partition()``: nothing more passes on the
    open connections, either way. ``heal()``: new connections pass; of the old ones, the
    client's side is dropped (the client gave them up) and the server's stays open and
    silent, as after a partition in which the client's goodbye was lost."""

    def __init__(self, host: str, port: int) -> None:
        self.target_host, self.target_port = host, port
        self.port = 0
        self._server: asyncio.Server | None = None
        self._open: list[tuple[asyncio.Event, asyncio.StreamWriter, asyncio.StreamWriter]] = []
        self._tasks: set[asyncio.Task[None]] = set()
        #: Client bytes that start the partition (swallowed with them); None: none.
        self.partition_at: bytes | None = None

    async def start(self) -> PartitionProxy:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def url(self, url: str) -> str:
        return re.sub(r"@[^/@]+/", f"@127.0.0.1:{self.port}/", url, count=1)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(self.target_host, self.target_port)
        flowing = asyncio.Event()
        flowing.set()
        self._open.append((flowing, writer, up_writer))

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError, OSError):
                while True:
                    await flowing.wait()
                    data = await src.read(65536)
                    if self.partition_at is not None and self.partition_at in data:
                        self.partition()
                    if not data or not flowing.is_set():
                        break  # an end, or bytes that the partition swallows
                    dst.write(data)
                    await dst.drain()
            if flowing.is_set():
                dst.close()

        for coro in (pump(reader, up_writer), pump(up_reader, writer)):
            task = asyncio.create_task(coro)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def partition(self) -> None:
        self.partition_at = None
        for flowing, _, _ in self._open:
            flowing.clear()

    def heal(self) -> None:
        for _, client, _ in self._open:
            client.transport.abort()  # the server's side is left as it is: open, silent

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for _, client, upstream in self._open:
            client.transport.abort()
            upstream.transport.abort()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def states(url: str, pids: list[int]) -> list[Any]:
    with psycopg.connect(url, autocommit=True) as conn:
        return [
            row[0]
            for row in conn.execute(
                "SELECT state FROM pg_stat_activity WHERE pid = ANY(%s)", (pids,)
            ).fetchall()
        ]


def sessions(url: str, pids: list[int]) -> list[Any]:
    with psycopg.connect(url, autocommit=True) as conn:
        return [
            row[0]
            for row in conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE pid = ANY(%s)", (pids,)
            ).fetchall()
        ]


async def read_entries(source: LogReader) -> list[Entry]:
    """The next read that finds any entry: a row is readable once no transaction of the
    (shared) server older than its writer's runs."""
    for _ in range(100):
        entries = await source.read(10)
        if entries:
            return entries
        await asyncio.sleep(0.05)
    return []


async def read_topics(source: LogReader) -> list[str]:
    return [e.message.topic for e in await read_entries(source) if e.message is not None]


async def test_the_relay_takes_its_reader_lock_again_after_a_partition(pg_url: str) -> None:
    log = PgLog(pg_url)
    async with log:
        await log.apply_schema()
    with psycopg.connect(pg_url) as conn:
        Outbox(mode="log").enqueue(conn, "before", {"n": 1})
    proxy = await PartitionProxy(*target(pg_url)).start()
    source = PgLog(proxy.url(pg_url)).reader("default")
    try:
        await source.connect()
        lock_pid = source._lock._conn.get_server_pid()
        assert await read_topics(source) == ["before"]

        proxy.partition()
        with pytest.raises(TimeoutError):  # the statement bound: an outage
            await source.read(10)
        await asyncio.wait_for(source.close(), 4 * BOUND + 1)  # cut: the server hears nothing
        proxy.heal()
        # The premise: the abandoned lock session lives on at the server, lock held.
        assert await asyncio.to_thread(sessions, pg_url, [lock_pid]) == [lock_pid]

        try:
            await asyncio.wait_for(source.connect(), 5)
        except StoreError as exc:
            pytest.fail(f"the relay's own abandoned session keeps it out: {exc}")
        assert await read_topics(source) == ["before"]  # read again: never confirmed
        assert await asyncio.to_thread(sessions, pg_url, [lock_pid]) == []

        # Only the lock's own earlier session is ended: another relay of the reader is
        # refused, twice, and the session holding the lock now is untouched.
        holder = source._lock._conn.get_server_pid()
        other = PgLog(pg_url).reader("default")
        for _ in range(2):
            with pytest.raises(StoreError, match="already being read by another relay"):
                await other.connect()
        assert await asyncio.to_thread(sessions, pg_url, [holder]) == [holder]
        await source._lock.check()
    finally:
        await asyncio.wait_for(source.close(), 5)
        await proxy.stop()


async def test_a_transaction_a_partition_left_open_does_not_hold_the_relay_after_it(
    pg_url: str,
) -> None:
    """The data session given up in a partition may be inside a transaction (a commit with
    dead letters: the letters written, the COMMIT lost): at the server it sits 'idle in
    transaction', its row locks held (the reader's offset row, the letters' keys), until
    TCP keepalive ends it. Every commit of the reconnected relay waited for those locks,
    was cut at COMMAND_TIMEOUT, and the relay reconnected, for as long."""
    log = PgLog(pg_url)
    async with log:
        await log.apply_schema()
    with psycopg.connect(pg_url) as conn:
        Outbox(mode="log").enqueue(conn, "poison", {"n": 1})
    proxy = await PartitionProxy(*target(pg_url)).start()
    source = PgLog(proxy.url(pg_url)).reader("default")
    try:
        await source.connect()
        data_pid = source.log.conn.get_server_pid()
        entries = await read_entries(source)
        letter = DeadLetter(entries[0].message, "given up", 1)
        proxy.partition_at = b"COMMIT;"  # the letter and the offset are written, not committed
        with pytest.raises(TimeoutError):
            await source.commit(entries[-1].checkpoint, [letter])
        await asyncio.wait_for(source.close(), 4 * BOUND + 1)
        proxy.heal()
        # The premise: the abandoned transaction lives on at the server, its locks held.
        assert await asyncio.to_thread(states, pg_url, [data_pid]) == ["idle in transaction"]

        await asyncio.wait_for(source.connect(), 5)
        entries = await read_entries(source)  # not committed: read again
        try:
            await source.commit(entries[-1].checkpoint, [letter])
        except TimeoutError:
            pytest.fail("the commit waited for the locks of the relay's abandoned transaction")
        assert await asyncio.to_thread(states, pg_url, [data_pid]) == []
        async with PgLog(pg_url) as fresh:
            assert await fresh.offset("default") == entries[-1].checkpoint
    finally:
        await asyncio.wait_for(source.close(), 5)
        await proxy.stop()
