"""Slow request bodies at the webhook receiver, behind a real uvicorn on a free port.

A body is read before a session is taken, so clients stalling or trickling their bodies
hold no database session: the relay's requests go on (checked here). But nothing bounded
the read: such a client held its connection and its memory for ever, a body announced far
over ``max_body`` was read up to that limit before the 413, uvicorn's graceful shutdown
(which waits for requests in progress before the lifespan's, for ever by default) never
ended, and ``close()`` left the bodies being read waiting for their clients. Now the whole
body has ``body_timeout`` (408, connection closed), an announced ``Content-Length`` over
``max_body`` is a 413 at once, and ``close()`` answers the bodies being read with 503 at
once while the transactions in flight get their ``shutdown_timeout``."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import psycopg
import pytest

from outboxer.brokers.base import OutcomeKind
from outboxer.brokers.webhook import WebhookPublisher
from outboxer.consumer import Delivery
from outboxer.errors import ConfigError
from outboxer.receivers.webhook import WebhookReceiver
from outboxer.testing import make_message
from tests.integration.test_audit11_webhook2_close import DDL, Blocking, applied
from tests.integration.test_consumer_webhook import SECRET, Served

#: What a webhook's body is announced as; stalled clients send a part of it.
LENGTH = 100


def ignore(message: Delivery, conn: Any) -> None:
    """A handler with no table of its own."""


class Client:
    """A raw HTTP/1.1 client posting to the served receiver, at its own pace."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(
        self, body: bytes, length: int = LENGTH, message_id: str | None = None
    ) -> Client:
        """Sends the head announcing ``length`` bytes, and ``body`` (possibly less)."""
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        head = (
            "POST /hooks HTTP/1.1\r\n"
            "Host: receiver\r\n"
            f"Outboxer-Id: {message_id or uuid.uuid4()}\r\n"
            "Outboxer-Topic: hook.t\r\n"
            "Content-Type: application/json\r\n"
            f"Content-Length: {length}\r\n"
            "Connection: close\r\n\r\n"
        )
        self.writer.write(head.encode() + body)
        await self.writer.drain()
        return self

    async def send(self, data: bytes) -> None:
        assert self.writer is not None
        self.writer.write(data)
        await self.writer.drain()

    async def answer(self, timeout: float) -> tuple[int, bytes]:
        """The status and the raw answer, read until the server closes the connection."""
        assert self.reader is not None
        raw = await asyncio.wait_for(self.reader.read(), timeout)
        assert raw.startswith(b"HTTP/1.1 "), raw
        return int(raw.split(b" ", 2)[1]), raw

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


@contextlib.asynccontextmanager
async def serving(receiver: WebhookReceiver) -> AsyncIterator[tuple[Served, list[Client]]]:
    """The receiver under uvicorn, and the clients to hang up before uvicorn stops (which
    waits for their requests)."""
    clients: list[Client] = []
    try:
        async with Served(receiver) as served:
            try:
                yield served, clients
            finally:
                for client in clients:
                    client.close()
    finally:
        await receiver.close()


async def until(condition: Callable[[], bool], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def requests_in_app(served: Served) -> int:
    """Requests uvicorn handed to the app (their heads complete) and not yet answered."""
    return len(served.server.server_state.tasks)


async def test_stalled_bodies_hold_no_session_and_the_relay_goes_on(
    sqlite_url: str,
) -> None:
    receiver = WebhookReceiver(
        db=sqlite_url, group="hooks", handler=ignore, secret=SECRET, concurrency=2
    )
    async with serving(receiver) as (served, clients):
        # Three times as many stalled bodies as sessions.
        for _ in range(6):
            clients.append(await Client(served.port).post(b'{"n": '))
        await until(lambda: requests_in_app(served) == 6)
        publisher = WebhookPublisher(served.url(), timeout=5, publish_timeout=10)
        async with publisher:
            started = time.monotonic()
            outcomes = await publisher.publish_batch(
                [make_message("hook.t", key=f"k{n}") for n in range(4)]
            )
            elapsed = time.monotonic() - started
        for outcome in outcomes:
            assert outcome.kind is OutcomeKind.PUBLISHED, outcome.error
        assert elapsed < 3, elapsed
        assert receiver.stats.applied == 4
        for client in clients:
            client.close()
        await until(lambda: requests_in_app(served) == 0)


async def test_a_stalled_or_trickled_body_gets_408_within_body_timeout(
    sqlite_url: str,
) -> None:
    receiver = WebhookReceiver(
        db=sqlite_url, group="hooks", handler=ignore, secret=None, body_timeout=0.5
    )
    async with serving(receiver) as (served, clients):
        started = time.monotonic()
        stalled = await Client(served.port).post(b'{"n": ')
        trickled = await Client(served.port).post(b"{")
        clients += [stalled, trickled]

        async def trickle() -> None:  # one byte every 0.1 s: each read is quick, the body not
            for _ in range(LENGTH - 2):
                await trickled.send(b" ")
                await asyncio.sleep(0.1)

        trickling = asyncio.create_task(trickle())
        try:
            (status, raw), (trickled_status, _) = await asyncio.gather(
                stalled.answer(5), trickled.answer(5)
            )
        finally:
            trickling.cancel()
        elapsed = time.monotonic() - started
        # read() returned: the server closed both connections after the answers.
        assert (status, trickled_status) == (408, 408), raw
        assert b"body_timeout" in raw and b"connection: close" in raw.lower()
        assert 0.4 < elapsed < 3, elapsed
        assert receiver.stats.received == 0
        # A whole body is applied as before.
        whole = await Client(served.port).post(b"{}", length=2)
        clients.append(whole)
        status, raw = await whole.answer(10)
        assert status == 200, raw


async def test_a_body_announced_over_max_body_is_refused_before_it_is_read(
    sqlite_url: str,
) -> None:
    receiver = WebhookReceiver(
        db=sqlite_url, group="hooks", handler=ignore, secret=None, max_body=1000
    )
    async with serving(receiver) as (served, clients):
        client = await Client(served.port).post(b"{", length=10_000_000)  # then nothing
        clients.append(client)
        status, raw = await client.answer(3)
        assert status == 413, raw
        assert b"connection: close" in raw.lower()


async def test_uvicorn_shutdown_is_not_held_by_a_stalled_body(
    sqlite_url: str,
) -> None:
    """uvicorn waits for the requests in progress before the lifespan shutdown (for ever
    unless timeout_graceful_shutdown is set): a stalled body used to keep it from ending."""
    receiver = WebhookReceiver(
        db=sqlite_url, group="hooks", handler=ignore, secret=None, body_timeout=1
    )
    served = await Served(receiver).__aenter__()
    client = Client(served.port)
    try:
        await client.post(b'{"n": ')
        await until(lambda: requests_in_app(served) == 1)
        started = time.monotonic()
        served.server.should_exit = True
        done, _ = await asyncio.wait({served.task}, timeout=5)
        elapsed = time.monotonic() - started
        assert done, "uvicorn's shutdown waited for the stalled body past body_timeout"
        status, raw = await client.answer(1)
        assert status == 408, raw
        assert elapsed < 3, elapsed
    finally:
        client.close()
        served.server.should_exit = True
        await served.task
        await receiver.close()


async def test_close_cuts_bodies_being_read_at_once_and_lets_transactions_end(
    pg_url: str,
) -> None:
    with psycopg.connect(pg_url) as conn:
        conn.execute(DDL)
    handler = Blocking()
    receiver = WebhookReceiver(
        db=pg_url, group="hooks", handler=handler, secret=None, body_timeout=60, concurrency=2
    )
    message = str(uuid.uuid4())
    async with serving(receiver) as (served, clients):
        try:
            running = await Client(served.port).post(b"{}", length=2, message_id=message)
            stalled = await Client(served.port).post(b'{"n": ')
            clients += [running, stalled]
            assert await asyncio.to_thread(handler.started.wait, 10)
            await until(lambda: requests_in_app(served) == 2)
            started = time.monotonic()
            closing = asyncio.create_task(receiver.close())
            status, raw = await stalled.answer(5)
            cut = time.monotonic() - started
            assert status == 503, raw
            assert b"retry-after: 5" in raw.lower() and b"connection: close" in raw.lower()
            assert cut < 1, cut
            # The transaction in flight is not cut: close() waits for it.
            assert not closing.done()
            handler.release.set()
            status, raw = await running.answer(10)
            assert status == 200, raw
            await asyncio.wait_for(closing, 10)
        finally:
            handler.release.set()
    assert applied(pg_url) == [message]


@pytest.mark.parametrize("value", [0, -1.0, float("nan")])
def test_body_timeout_must_be_positive(sqlite_url: str, value: float) -> None:
    with pytest.raises(ConfigError, match="body_timeout"):
        WebhookReceiver(
            db=sqlite_url, group="hooks", handler=ignore, secret=None, body_timeout=value
        )
