"""A receiver that sends its status line and then its headers a byte at a time (never
finishing them) beats httpx's timeout, which bounds each read, not the request. It used to
hold the request until the relay's publish_timeout, which then failed the whole wave: the
message another receiver had already acknowledged failed too (its attempt counted, sent
again). Now only that message fails, retryably, within the webhook's ``timeout``. Real
local HTTP servers (a private one trickling, the tests' HookServer answering)."""

from __future__ import annotations

import asyncio
import contextlib
import time

from outboxer.brokers.base import OutcomeKind
from outboxer.brokers.webhook import WebhookPublisher
from outboxer.testing import make_message
from tests.integration.test_broker_webhook import HookServer

TIMEOUT = 0.5
PUBLISH_TIMEOUT = 5.0


class Trickler:
    """Reads a request's head, answers ``HTTP/1.1 200 OK`` and then one header byte every
    0.1 s, for as long as the client stays."""

    def __init__(self) -> None:
        self.server: asyncio.Server | None = None
        self.port = 0
        self._handlers: set[asyncio.Task[None]] = set()

    async def start(self) -> Trickler:
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.create_task(self._trickle(reader, writer))
        self._handlers.add(task)
        task.add_done_callback(self._handlers.discard)

    async def _trickle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\n")
            while True:  # the hostile receiver's pace, not the test's synchronisation
                writer.write(b"X")
                await writer.drain()
                await asyncio.sleep(0.1)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        for task in list(self._handlers):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.server.wait_closed()


async def test_a_receiver_trickling_its_headers_fails_its_message_only_within_the_timeout() -> None:
    fast, slow = await HookServer().start(), await Trickler().start()
    try:
        publisher = WebhookPublisher(
            fast.url + "/hooks",
            routes={"slow": f"http://127.0.0.1:{slow.port}/hooks"},
            timeout=TIMEOUT,
            publish_timeout=PUBLISH_TIMEOUT,
        )
        async with publisher:
            started = time.monotonic()
            trickled, answered = await publisher.publish_batch(
                [make_message("slow"), make_message("fast")]
            )
            elapsed = time.monotonic() - started
    finally:
        await slow.stop()
        await fast.stop()
    assert answered.kind is OutcomeKind.PUBLISHED, answered.error
    assert trickled.kind is OutcomeKind.FAILED and trickled.retryable
    assert trickled.error is not None and "no status and headers within" in trickled.error
    assert elapsed < PUBLISH_TIMEOUT - 1, elapsed
