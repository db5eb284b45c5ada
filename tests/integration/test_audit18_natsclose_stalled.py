"""NATS publisher and receiver against a server that stops reading: a proxy in front of the
real NATS (127.0.0.1:4222) that, on command, keeps every connection open and reads
nothing more from either side, so what the client writes piles up in its socket.

nats-py's close writes what is still buffered and waits for the socket to take it and to
close: the publisher's and the receiver's close waited for ever (the relay's reconnect, a
consumer's, their shutdown). Before the close, the publisher's wave itself hung: a
publish that finds more than 2 MB unsent waits for nats-py's "forced flush" without a
bound, and swallows the cancellation of the wave's own timeout. Now the forced flush gives
up after half the publish timeout (the wave fails as a lost connection), and a close not
done within CLOSE_TIMEOUT cuts the socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable

import nats
import nats.js.errors
import pytest

from outboxer.brokers import nats as nats_broker
from outboxer.brokers.base import OutcomeKind
from outboxer.brokers.nats import NatsPublisher
from outboxer.receivers import create_receiver
from outboxer.testing import make_message
from tests.services import require

NATS = ("127.0.0.1", 4222)
#: CLOSE_TIMEOUT here.
CLOSE_BOUND = 0.5
PUBLISH_TIMEOUT = 2.0


class StallProxy:
    """Forwards to NATS; ``stall()`` stops reading both sides of every open connection (the
    client's writes back up into its socket), new connections are forwarded as usual."""

    def __init__(self) -> None:
        self.port = 0
        self._server: asyncio.Server | None = None
        self._pairs: list[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = []
        self._stalled: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> StallProxy:
        listener = socket.socket()
        # Inherited by the accepted sockets: little room on the proxy's side, so a stalled
        # connection backs up into the client's socket after a few kilobytes.
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        self._server = await asyncio.start_server(self._accept, sock=listener)
        self.port = listener.getsockname()[1]
        return self

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*NATS)
        self._pairs.append((writer, up_writer))
        for source, sink, own in ((reader, up_writer, writer), (up_reader, writer, up_writer)):
            task = asyncio.create_task(self._pump(source, sink, own))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(
        self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, own: asyncio.StreamWriter
    ) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while own not in self._stalled and (data := await source.read(65536)):
                if own in self._stalled:
                    return  # read before the stall: held, as the rest
                sink.write(data)
                await sink.drain()
        if own not in self._stalled:
            sink.close()

    def stall(self) -> None:
        for client, upstream in self._pairs:
            for writer in (client, upstream):
                self._stalled.add(writer)
                writer.transport.pause_reading()  # type: ignore[attr-defined]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for client, upstream in self._pairs:
            client.transport.abort()
            upstream.transport.abort()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


@pytest.fixture(autouse=True)
def _short_close(monkeypatch: pytest.MonkeyPatch) -> None:
    require("nats")
    # raising=False: the code before the fix has no such bound, and hangs instead.
    monkeypatch.setattr(nats_broker, "CLOSE_TIMEOUT", CLOSE_BOUND, raising=False)


@pytest.fixture
async def proxy() -> AsyncIterator[StallProxy]:
    started = await StallProxy().start()
    yield started
    await started.stop()


@pytest.fixture
async def stream() -> AsyncIterator[str]:
    """A stream of its own; its subject prefix."""
    tag = uuid.uuid4().hex[:10]
    name, prefix = f"AUDIT18_CLOSE_{tag}", f"a18close{tag}."
    nc = await nats.connect(f"nats://{NATS[0]}:{NATS[1]}")
    try:
        await nc.jetstream().add_stream(name=name, subjects=[f"{prefix}>"])
        yield prefix
    finally:
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await nc.jetstream().delete_stream(name)
        await nc.close()


async def timed(awaitable: Awaitable[object], limit: float) -> float:
    """Seconds ``awaitable`` took; fails the test past ``limit`` (the old code: for ever)."""
    started = time.monotonic()
    task = asyncio.ensure_future(awaitable)
    done, _ = await asyncio.wait((task,), timeout=limit)
    assert done, f"still waiting after {limit}s"
    task.result()
    return time.monotonic() - started


async def test_publisher_wave_and_close_end_when_the_server_stops_reading(
    proxy: StallProxy, stream: str
) -> None:
    url = f"nats://127.0.0.1:{proxy.port}?subject_prefix={stream}"
    publisher = NatsPublisher(url, publish_timeout=PUBLISH_TIMEOUT)
    await publisher.connect()
    try:
        [outcome] = await publisher.publish_batch([make_message("ok", {"n": 0})])
        assert outcome.published, outcome
        proxy.stall()
        # 12 MB: more than the socket takes (the kernel's send buffer is 4 MB at most),
        # and more than nats-py's 2 MB pending buffer after that.
        wave = [make_message(f"big{n}", {"x": "a" * 1_000_000 + str(n)}) for n in range(12)]
        started = time.monotonic()
        task = asyncio.ensure_future(publisher.publish_batch(wave))
        done, _ = await asyncio.wait((task,), timeout=PUBLISH_TIMEOUT + 3)
        assert done, "the wave still waits for a server that stopped reading"
        took = time.monotonic() - started
        outcomes = task.result()
        assert took <= PUBLISH_TIMEOUT + 0.5, f"the wave took {took:.2f}s"
        assert all(o.kind is OutcomeKind.FAILED and o.retryable for o in outcomes), outcomes
        assert not publisher.connected
        closed_in = await timed(publisher.close(), CLOSE_BOUND + 3)
        assert closed_in < CLOSE_BOUND + 1.0, f"the close took {closed_in:.2f}s"
        # A new connection (the proxy forwards new ones) publishes again.
        await publisher.connect()
        [outcome] = await publisher.publish_batch([make_message("again", {"n": 1})])
        assert outcome.published, outcome
    finally:
        await asyncio.wait_for(publisher.close(), CLOSE_BOUND + 3)


async def test_receiver_close_ends_when_the_server_stops_reading(
    proxy: StallProxy, stream: str
) -> None:
    url = f"nats://127.0.0.1:{proxy.port}?subject_prefix={stream}"
    quiet = create_receiver(url, group=f"g{uuid.uuid4().hex[:6]}", topics=["t"])
    busy = create_receiver(url, group=f"g{uuid.uuid4().hex[:6]}", topics=["t"])
    await quiet.connect()
    await busy.connect()
    try:
        proxy.stall()
        # Nothing unsent: closing never waited, even before the bound (the evidence that
        # a close was bounded in the common case).
        assert await timed(quiet.close(), CLOSE_BOUND + 3) < 0.3
        # More unsent than the socket takes, as a consumer acking thousands of messages
        # into a server that stopped reading: valid protocol (PINGs), written where
        # nats-py's own writes go. Its close waited for them to be sent, for ever.
        client = busy._nc  # type: ignore[attr-defined]
        client._transport.write(b"PING\r\n" * 3_000_000)  # 18 MB
        closed_in = await timed(busy.close(), CLOSE_BOUND + 3)
        assert CLOSE_BOUND - 0.1 < closed_in < CLOSE_BOUND + 1.0, closed_in
        assert client.is_closed
    finally:
        await asyncio.wait_for(quiet.close(), CLOSE_BOUND + 3)
        await asyncio.wait_for(busy.close(), CLOSE_BOUND + 3)
