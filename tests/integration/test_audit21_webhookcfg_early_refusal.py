"""A webhook receiver refusing a body over its size limit before reading it.

Many servers answer 413 as soon as the ``Content-Length`` announces too much, and close the
connection. The body's unread bytes make the receiver's kernel reset the connection, and the
reset discards the 413 on the relay's side: for a body a few MB over the limit the relay saw
only "ReadError", at every attempt, with nothing to say the body was too large. The error
now says the receiver closed the connection while the N-byte body was being sent, with no
answer, and what that usually means; it stays retryable (a receiver going down mid-body
looks the same).

outboxer's own ``WebhookReceiver`` (``max_body``) did the same, so the relay spent every
attempt on a message it never takes. It now reads such a body to its end, throwing it away,
before the 413: the relay gets the 413, a permanent failure at the first attempt."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from outboxer.brokers.base import OutcomeKind
from outboxer.brokers.webhook import WebhookPublisher
from outboxer.receivers.webhook import WebhookReceiver
from outboxer.testing import make_message
from tests.integration.test_consumer_webhook import Served

#: Far more than loopback socket buffers hold, so the receiver leaves bytes unread.
SIZE = 8_000_000


def ignore(message: Any, conn: Any) -> None:
    """A handler with no table of its own."""


async def test_a_413_before_the_body_is_read_is_reported_as_such_not_a_bare_read_error() -> None:
    async def refuse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(
                b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: 9\r\n"
                b"Connection: close\r\n\r\ntoo large"
            )
            await writer.drain()
        finally:
            writer.close()  # the body unread: the kernel resets the connection

    server = await asyncio.start_server(refuse, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    message = dataclasses.replace(make_message("t"), payload=b"x" * SIZE)
    try:
        async with WebhookPublisher(f"http://127.0.0.1:{port}/hooks", timeout=3) as publisher:
            [outcome] = await publisher.publish_batch([message])
    finally:
        server.close()
    assert outcome.kind is OutcomeKind.FAILED and outcome.retryable, outcome
    error = outcome.error or ""
    assert "closed the connection while the 8,000,000-byte body was being sent" in error, error
    assert "size limit" in error and "413" in error, error


async def test_the_webhook_receivers_own_max_body_refusal_reaches_the_relay_as_a_413(
    sqlite_url: str,
) -> None:
    receiver = WebhookReceiver(
        db=sqlite_url, group="hooks", handler=ignore, secret=None, max_body=1000
    )
    async with (
        Served(receiver) as served,
        WebhookPublisher(f"http://127.0.0.1:{served.port}/hooks", timeout=3) as publisher,
    ):
        big = dataclasses.replace(make_message("t"), payload=b"x" * SIZE)
        [outcome] = await publisher.publish_batch([big])  # one attempt
        error = outcome.error or ""
        assert outcome.kind is OutcomeKind.FAILED, outcome
        assert "HTTP 413" in error and "body over 1000 bytes" in error, error
        assert not outcome.retryable, outcome  # not sent again: never taken
        assert receiver.stats.received == 0
        # Small bodies still go through on the same publisher.
        [small] = await publisher.publish_batch([make_message("t")])
        assert small.published, small


async def test_a_chunked_body_going_over_max_body_gets_its_413_not_a_reset(
    sqlite_url: str,
) -> None:
    """No Content-Length to refuse it by: the body goes over max_body while it is read."""
    receiver = WebhookReceiver(
        db=sqlite_url, group="hooks", handler=ignore, secret=None, max_body=1000
    )
    async with Served(receiver) as served:
        reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
        try:
            writer.write(
                b"POST /hooks HTTP/1.1\r\nHost: receiver\r\nOutboxer-Id: 1\r\n"
                b"Outboxer-Topic: t\r\nTransfer-Encoding: chunked\r\n\r\n"
            )
            chunk = b"x" * 65536
            for _ in range(SIZE // len(chunk)):
                writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                await writer.drain()
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            raw = await asyncio.wait_for(reader.read(), 5)
        finally:
            writer.close()
    assert raw.startswith(b"HTTP/1.1 413 "), raw
    assert b"body over 1000 bytes" in raw, raw
