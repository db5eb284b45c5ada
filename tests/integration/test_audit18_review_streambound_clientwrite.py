"""The WAL outbox's watch of a call that decodes WAL (``WalReader._decoding``) facing a
connection that stops taking the server's answer while the reader lock's session still
flows: a middlebox that stopped reading one connection, a NAT that forgot the connection
that sat silent on the wire while the server decoded.

The server has finished the call and is blocked writing its answer (pg_stat_activity:
state 'active', wait_event 'ClientWrite'). The watch read 'active' as "still decoding" and
waited for ever (DECODE_TIMEOUT, a day), where the design says a server done with the call
whose answer does not arrive is an outage. Now the answer being sent gets COMMAND_TIMEOUT
to arrive, as any statement's answer, then the relay reconnects.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
from typing import Any

import psycopg
import pytest

from outboxer.enqueue import Outbox
from outboxer.errors import StoreError
from outboxer.stores import pgmodes
from outboxer.stores.pgwal import PgWal
from outboxer.testing import eventually
from tests.integration.test_audit18_stream_db_hung import target
from tests.pgmodes.conftest import logical_pg, logical_url  # noqa: F401 -- fixtures

#: The statement bound here (and the watch's interval).
BOUND = 1.0
#: Bytes of the message's payload: more than the server's socket buffer can take (4 MiB
#: at most here), so the server blocks writing the peek's answer.
PAYLOAD_BYTES = 12_000_000


@pytest.fixture(autouse=True)
def _short_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pgmodes, "COMMAND_TIMEOUT", BOUND)
    monkeypatch.setattr(pgmodes, "CONNECT_TIMEOUT", BOUND * 4)
    monkeypatch.setattr(pgmodes, "CLOSE_TIMEOUT", BOUND)
    monkeypatch.setattr(pgmodes, "LOCK_CHECK_SECONDS", BOUND)


class StallingProxy:
    """Forwards 127.0.0.1:<port> to PostgreSQL; ``stall(n)`` stops reading the server's
    bytes on the n-th connection (from 0), as a middlebox that stopped reading it: the
    server's writes to it block once the socket buffers are full. The others flow."""

    def __init__(self, host: str, port: int) -> None:
        self.target_host, self.target_port = host, port
        #: The port it listens on (``through`` reads it).
        self.port = 0
        self._server: asyncio.Server | None = None
        self._gates: list[asyncio.Event] = []
        self._writers: list[asyncio.StreamWriter] = []
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> StallingProxy:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def stall(self, index: int) -> None:
        self._gates[index].clear()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        gate = asyncio.Event()
        gate.set()
        self._gates.append(gate)
        upstream = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        # A small receive buffer: a stalled connection stops taking bytes soon.
        upstream.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        upstream.setblocking(False)
        await asyncio.get_running_loop().sock_connect(
            upstream, (self.target_host, self.target_port)
        )
        up_reader, up_writer = await asyncio.open_connection(sock=upstream, limit=4096)
        self._writers += [writer, up_writer]

        async def pump(
            src: asyncio.StreamReader, dst: asyncio.StreamWriter, gate: asyncio.Event | None
        ) -> None:
            with contextlib.suppress(ConnectionError, OSError):
                while True:
                    if gate is not None:
                        await gate.wait()
                    data = await src.read(4096)
                    if not data:
                        break
                    dst.write(data)
                    await dst.drain()
            dst.close()

        for coro in (pump(reader, up_writer, None), pump(up_reader, writer, gate)):
            task = asyncio.create_task(coro)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in self._writers:
            writer.transport.abort()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def activity(url: str, pid: int) -> tuple[Any, ...] | None:
    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute(
            "SELECT state, wait_event FROM pg_stat_activity WHERE pid = %s", (pid,)
        ).fetchone()


async def test_a_peek_whose_answer_never_gets_through_is_an_outage(
    logical_url: str,  # noqa: F811 -- the fixture
) -> None:
    prefix = logical_url.rsplit("/", 1)[1]
    wal = PgWal(logical_url, slot_prefix=prefix)
    async with wal:
        await wal.apply_schema()
        assert await wal.create_slot("default")
    with psycopg.connect(logical_url) as conn:
        Outbox(mode="wal").enqueue(conn, "big", {"filler": "x" * PAYLOAD_BYTES})
    host, port = target(logical_url)
    proxy = await StallingProxy(host, port).start()
    url = re.sub(r"@[^/@]+/", f"@127.0.0.1:{proxy.port}/", logical_url, count=1)
    source = PgWal(url, slot_prefix=prefix).reader("default")
    try:
        await source.connect()  # connection 0: the source's; 1: the reader lock's
        pid = source.wal.conn.get_server_pid()
        proxy.stall(0)
        loop = asyncio.get_running_loop()
        began = loop.time()
        reading = asyncio.ensure_future(source.read(10))

        async def blocked_writing() -> bool:
            # The premise: the server is done decoding and blocked handing the answer over.
            row = await asyncio.to_thread(activity, logical_url, pid)
            return row == ("active", "ClientWrite")

        await eventually(blocked_writing, timeout=BOUND * 0.8, interval=0.02)
        assert not reading.done(), "the answer got through the stalled connection"
        done, _ = await asyncio.wait((reading,), timeout=4.0)
        if not done:
            reading.cancel()
            await asyncio.wait((reading,), timeout=5)
        assert done, "the watch took a server blocked writing the answer for a decode"
        took = loop.time() - began
        with pytest.raises(StoreError, match="answer has not arrived"):
            reading.result()
        assert took < 2 * BOUND + 1.0, f"the outage took {took:.2f}s to be seen"
    finally:
        await proxy.stop()
        await asyncio.wait_for(source.close(), 5)
    # Nothing moved: the message is read again after the reconnect.
    async with PgWal(logical_url, slot_prefix=prefix) as wal:
        again = wal.reader("default")
        await again.connect()
        try:
            entries = await again.read(10)
        finally:
            await again.close()
    assert [e.message.topic for e in entries if e.message is not None] == ["big"]
