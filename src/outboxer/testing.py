"""Contract suites and test helpers that every adapter passes against its real server.

A broker adapter's test module subclasses :class:`PublisherContract` and fills
in a few methods (how to build a publisher on fresh names, how to consume what
arrived, which message the server rejects, how to restart the server); pytest
then runs every contract test against that adapter.

This module imports pytest, so import it only from tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import pytest

from outboxer.brokers.base import OutcomeKind, Publisher
from outboxer.message import Message, encode_payload, uuid7


@dataclass(frozen=True)
class Received:
    """A message as a consumer saw it, in broker-neutral form."""

    id: str
    topic: str
    key: str | None
    headers: dict[str, str]
    payload: bytes


class Consumer(ABC):
    """Reads what a publisher sent to one topic, subscribed before anything is published."""

    @abstractmethod
    async def receive(self, count: int, timeout: float = 10.0) -> list[Received]:
        """Return once ``count`` messages arrived (fewer if the timeout passes)."""

    async def close(self) -> None:
        return None


def make_message(topic: str, payload: object = None, *, key: str | None = None,
                 headers: dict[str, str] | None = None) -> Message:
    body, content_type = encode_payload(payload if payload is not None else {"n": 1})
    return Message(id=uuid7(), topic=topic, payload=body, key=key, headers=headers or {},
                   content_type=content_type)


class PublisherContract(ABC):
    """The promises every Publisher keeps; subclass it once per adapter with a real server."""

    #: Seconds to wait for a consumer to see messages.
    receive_timeout = 15.0

    @abstractmethod
    def make_publisher(self) -> Publisher:
        """A publisher for the real server (not yet connected)."""

    @abstractmethod
    def make_unreachable_publisher(self) -> Publisher:
        """A publisher pointed at an address where nothing listens."""

    @abstractmethod
    async def start_consumer(self, topic: str) -> Consumer:
        """Subscribe to ``topic`` as the broker names it (before publishing)."""

    @abstractmethod
    def rejected_message(self, topic: str) -> Message:
        """A message the server refuses for good (too large, forbidden, …)."""

    async def restart_server(self) -> None:
        """Stop and start the real server (or drop every connection to it)."""
        pytest.skip(f"{type(self).__name__} cannot restart its server")

    def fresh_topic(self) -> str:
        return f"contract.{uuid.uuid4().hex[:12]}"

    # ----- the contract -------------------------------------------------------------------

    async def test_confirmed_batch_arrives_unchanged(self) -> None:
        topic = self.fresh_topic()
        consumer = await self.start_consumer(topic)
        sent = [
            make_message(topic, {"order": 1, "text": "zürich ✓"}, key="k-1", headers={"trace": "abc"}),
            make_message(topic, "plain text", key=None, headers={"a": "1", "b": "2"}),
            make_message(topic, b"\x00\x01binary\xff", key="k-2"),
        ]
        async with self.make_publisher() as publisher:
            outcomes = await publisher.publish_batch(sent)
        assert [o.kind for o in outcomes] == [OutcomeKind.PUBLISHED] * 3, outcomes
        received = {r.id: r for r in await consumer.receive(3, self.receive_timeout)}
        await consumer.close()
        assert set(received) == {str(m.id) for m in sent}
        for message in sent:
            got = received[str(message.id)]
            assert got.payload == message.payload
            assert got.key == message.key
            for name, value in message.headers.items():
                assert got.headers.get(name) == value

    async def test_per_key_order_within_and_across_batches(self) -> None:
        topic = self.fresh_topic()
        consumer = await self.start_consumer(topic)
        keys = [f"key-{n}" for n in range(5)]
        batches = [
            [make_message(topic, {"key": key, "n": batch * 20 + n}, key=key)
             for n in range(20) for key in keys]
            for batch in range(3)
        ]
        async with self.make_publisher() as publisher:
            for batch in batches:
                outcomes = await publisher.publish_batch(batch)
                assert all(o.published for o in outcomes), outcomes
        total = sum(len(b) for b in batches)
        received = await consumer.receive(total, self.receive_timeout)
        await consumer.close()
        assert len(received) == total
        seen: dict[str, list[int]] = {}
        import json

        for item in received:
            body = json.loads(item.payload)
            seen.setdefault(body["key"], []).append(body["n"])
        for key in keys:
            assert seen[key] == sorted(seen[key]), f"order broken for {key}: {seen[key]}"

    async def test_unreachable_server_fails_each_message_retryably(self) -> None:
        topic = self.fresh_topic()
        publisher = self.make_unreachable_publisher()
        publisher.publish_timeout = min(publisher.publish_timeout, 5.0)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(publisher.connect(), 10)
        messages = [make_message(topic, {"n": n}, key=None) for n in range(3)]
        outcomes = await publisher.publish_batch(messages)
        await publisher.close()
        assert len(outcomes) == 3
        for outcome in outcomes:
            assert outcome.kind is OutcomeKind.FAILED
            assert outcome.retryable

    async def test_rejected_message_is_a_permanent_failure(self) -> None:
        topic = self.fresh_topic()
        consumer = await self.start_consumer(topic)
        good = make_message(topic, {"ok": True})
        bad = self.rejected_message(topic)
        async with self.make_publisher() as publisher:
            outcomes = await publisher.publish_batch([bad, good])
        await consumer.close()
        assert outcomes[0].kind is OutcomeKind.FAILED, outcomes
        assert outcomes[0].retryable is False, outcomes[0]
        assert outcomes[1].published, outcomes[1]

    async def test_reconnects_after_server_restart(self) -> None:
        topic = self.fresh_topic()
        publisher = self.make_publisher()
        await publisher.connect()
        first = await publisher.publish_batch([make_message(topic, {"n": 0})])
        assert first[0].published, first
        await self.restart_server()
        consumer = await self.start_consumer(topic)
        message = make_message(topic, {"n": 1})
        deadline = time.monotonic() + 60
        outcome = None
        while time.monotonic() < deadline:
            if not publisher.connected:
                try:
                    await publisher.connect()
                except Exception:  # noqa: BLE001 -- the server is still restarting
                    await asyncio.sleep(0.5)
                    continue
            [outcome] = await publisher.publish_batch([message])
            if outcome.published:
                break
            await asyncio.sleep(0.5)
        await publisher.close()
        assert outcome is not None and outcome.published, outcome
        received = await consumer.receive(1, self.receive_timeout)
        await consumer.close()
        assert [r.id for r in received] == [str(message.id)]


# ----- a TCP proxy to cut a real server off without stopping it ----------------------------


@dataclass
class TcpProxy:
    """Forwards 127.0.0.1:<port> to a real server; ``cut()`` drops every connection.

    While cut, new connections are refused (the listening socket is closed), as
    when the server is down; ``restore()`` listens again on the same port.
    """

    target_host: str
    target_port: int
    port: int = 0
    _server: asyncio.Server | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    _writers: set[asyncio.StreamWriter] = field(default_factory=set)

    async def start(self) -> TcpProxy:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError:
            writer.close()
            return
        self._writers.update((writer, up_writer))

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.close()

        for coro in (pump(reader, up_writer), pump(up_reader, writer)):
            task = asyncio.create_task(coro)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def cut(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for writer in list(self._writers):
            with contextlib.suppress(Exception):
                writer.transport.abort()
        self._writers.clear()

    async def restore(self) -> None:
        if self._server is None:
            await self.start()

    async def stop(self) -> None:
        await self.cut()
        for task in list(self._tasks):
            task.cancel()


async def eventually(check: Callable[[], Awaitable[bool]], timeout: float = 15.0,
                     interval: float = 0.05) -> None:
    """Wait until ``check()`` is true, else fail the test."""
    deadline = time.monotonic() + timeout
    while True:
        if await check():
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(interval)


def ids(messages: Sequence[Message]) -> list[str]:
    return [str(m.id) for m in messages]
