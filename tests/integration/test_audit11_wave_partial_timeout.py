"""A wave that is only partly confirmed within ``publish_timeout`` keeps what is known.

The base class's timeout used to fail the whole wave: the messages the broker had already
confirmed were marked failed (an attempt counted) and published again. Now each adapter
stops waiting a little before ``publish_timeout`` and reports each message on its own:
confirmed ones are published, the unanswered ones fail retryably, and a key's later
message is still never published after an unconfirmed one.

The slow peer is a gate in front of the real broker (RabbitMQ, Redis, NATS JetStream,
Mosquitto on 127.0.0.1) that cuts one direction of the connection into protocol packets
and, once armed, lets only the first N confirmations (or publishes) through and holds the
rest until released: the held ones arrive after the wave gave up (a late confirmation).
Webhooks: a private HTTP server that answers one route at once and holds the other.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import aio_pika
import redis.asyncio as aioredis

from outboxer.brokers import create_publisher
from outboxer.brokers.base import Outcome, OutcomeKind, Publisher
from outboxer.brokers.nats import NatsPublisher
from outboxer.brokers.webhook import WebhookPublisher
from outboxer.message import Message
from outboxer.testing import make_message
from tests.integration.test_broker_webhook import HookServer
from tests.services import PORTS, require

PUBLISH_TIMEOUT = 1.5

#: Bytes of the first whole packet in a buffer, or None if it is not all there yet.
Splitter = Callable[[bytes], int | None]


def split_resp(buffer: bytes) -> int | None:
    """A Redis (RESP2) reply: a bulk string, or a one-line reply."""
    end = buffer.find(b"\r\n")
    if end < 0:
        return None
    if buffer[:1] == b"$":
        length = int(buffer[1:end])
        size = end + 2 + (length + 2 if length >= 0 else 0)
        return size if len(buffer) >= size else None
    return end + 2


def split_mqtt(buffer: bytes) -> int | None:
    """An MQTT control packet: a type byte, then the remaining length as a varint."""
    length, shift = 0, 0
    for position in range(1, min(len(buffer), 5)):
        length |= (buffer[position] & 0x7F) << shift
        shift += 7
        if not buffer[position] & 0x80:
            size = position + 1 + length
            return size if len(buffer) >= size else None
    return None


def split_amqp(buffer: bytes) -> int | None:
    """An AMQP 0-9-1 frame: type, channel, size, payload, frame end."""
    if len(buffer) < 7:
        return None
    size = 7 + int.from_bytes(buffer[3:7], "big") + 1
    return size if len(buffer) >= size else None


def split_nats(buffer: bytes) -> int | None:
    """A NATS server operation: one line, plus the payload of MSG and HMSG."""
    end = buffer.find(b"\r\n")
    if end < 0:
        return None
    line = buffer[:end]
    if line.startswith((b"MSG ", b"HMSG ")):
        size = end + 2 + int(line.split()[-1]) + 2
        return size if len(buffer) >= size else None
    return end + 2


class Gate:
    """Forwards ``127.0.0.1:port`` to a broker. One direction (``downstream``: the broker's
    answers; else the client's requests) is cut into packets; after ``hold_after(n)``, n
    more packets that ``counts`` passes go through, then everything is held, in order,
    until ``release()``."""

    def __init__(
        self,
        target_port: int,
        split: Splitter,
        counts: Callable[[bytes], bool],
        *,
        downstream: bool,
    ) -> None:
        self.target_port = target_port
        self.split, self.counts, self.downstream = split, counts, downstream
        self.port = 0
        self.held = 0  # packets that waited for release()
        self._allowance: int | None = None
        self._released = asyncio.Event()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> Gate:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def hold_after(self, packets: int) -> None:
        self._allowance = packets

    def release(self) -> None:
        self._released.set()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in self._writers:
            writer.transport.abort()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._writers += [writer, up_writer]
        pumps = ((up_reader, writer, self.downstream), (reader, up_writer, not self.downstream))
        for source, sink, gated in pumps:
            task = asyncio.create_task(self._pump(source, sink, gated))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(
        self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, gated: bool
    ) -> None:
        buffer = b""
        try:
            while data := await source.read(65536):
                if not gated or self._allowance is None or (self._released.is_set() and not buffer):
                    # Not armed, or released: bytes as they come (a new connection's
                    # AMQP protocol header is no frame).
                    sink.write(data)
                    await sink.drain()
                    continue
                buffer += data
                while (size := self.split(buffer)) is not None:
                    packet, buffer = buffer[:size], buffer[size:]
                    if self._allowance <= 0 and not self._released.is_set():
                        self.held += 1
                        await self._released.wait()
                    elif self.counts(packet):
                        self._allowance -= 1
                    sink.write(packet)
                    await sink.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            sink.transport.abort()


@contextlib.asynccontextmanager
async def gate(
    port: int, split: Splitter, counts: Callable[[bytes], bool], *, downstream: bool
) -> AsyncIterator[Gate]:
    proxy = await Gate(port, split, counts, downstream=downstream).start()
    try:
        yield proxy
    finally:
        proxy.release()
        await proxy.stop()


def batch(topic: str) -> list[Message]:
    """Wave 0: keys a, b, c; wave 1: a's second message."""
    return [make_message(topic, {"n": n}, key=key) for n, key in enumerate("abca")]


def check_partial(outcomes: list[Outcome]) -> None:
    """a and b confirmed in time, c not: c alone fails (retryably, attempted), and a's
    second message is not published (order holds: the wave after a timeout is not sent)."""
    a1, b1, c1, a2 = outcomes
    assert (a1.kind, b1.kind) == (OutcomeKind.PUBLISHED, OutcomeKind.PUBLISHED), (a1, b1)
    assert c1.kind is OutcomeKind.FAILED and c1.retryable and c1.attempted, c1
    assert "did not confirm" in (c1.error or ""), c1.error
    assert a2.kind is not OutcomeKind.PUBLISHED, a2


async def publish_partly(publisher: Publisher, proxy: Gate, topic: str) -> list[Message]:
    """Publish a batch with two confirmations let through; then release the held ones (late
    confirmations) and publish what was not published again, on a new connection."""
    messages = batch(topic)
    await publisher.connect()
    proxy.hold_after(2)
    started = asyncio.get_running_loop().time()
    outcomes = await publisher.publish_batch(messages)
    assert asyncio.get_running_loop().time() - started < PUBLISH_TIMEOUT, outcomes
    assert proxy.held, "the gate held nothing: the wave was not slowed"
    check_partial(outcomes)
    proxy.release()
    await publisher.connect()  # the timeout made it reconnect
    again = [m for m, o in zip(messages, outcomes, strict=True) if not o.published]
    retried = await publisher.publish_batch(again)
    assert all(o.published for o in retried), retried
    return messages


async def test_redis_keeps_the_replies_read_before_the_timeout() -> None:
    require("redis")
    stream = f"audit11wave{uuid.uuid4().hex[:8]}"
    async with gate(PORTS["redis"], split_resp, lambda _: True, downstream=True) as proxy:
        publisher = create_publisher(
            f"redis://127.0.0.1:{proxy.port}/0", publish_timeout=PUBLISH_TIMEOUT
        )
        try:
            messages = await publish_partly(publisher, proxy, stream)
        finally:
            await publisher.close()
    client = aioredis.Redis(port=PORTS["redis"])
    try:
        entries = await client.xrange(stream)
        await client.delete(stream)
    finally:
        await client.aclose()
    ids = [fields[b"id"].decode() for _, fields in entries]
    assert set(ids) == {str(m.id) for m in messages}, ids


async def test_mqtt_keeps_the_pubacks_in_before_the_timeout() -> None:
    require("mosquitto")
    pubacks = lambda packet: packet[0] >> 4 == 4  # noqa: E731
    async with gate(PORTS["mosquitto"], split_mqtt, pubacks, downstream=True) as proxy:
        publisher = create_publisher(
            f"mqtt://127.0.0.1:{proxy.port}", publish_timeout=PUBLISH_TIMEOUT
        )
        try:
            await publish_partly(publisher, proxy, f"audit11/wave/{uuid.uuid4().hex[:8]}")
        finally:
            await publisher.close()


async def test_nats_keeps_the_pubacks_in_before_the_timeout() -> None:
    require("nats")
    tag = uuid.uuid4().hex[:8]
    stream, subject = f"AUDIT11_WAVE_{tag}", f"audit11wave{tag}"
    import nats

    nc = await nats.connect(f"nats://127.0.0.1:{PORTS['nats']}")
    js = nc.jetstream()
    await js.add_stream(name=stream, subjects=[f"{subject}.>"])
    messages: list[Message] = []
    try:
        is_msg = lambda packet: packet.startswith((b"MSG ", b"HMSG "))  # noqa: E731
        async with gate(PORTS["nats"], split_nats, is_msg, downstream=True) as proxy:
            publisher = create_publisher(
                f"nats://127.0.0.1:{proxy.port}", publish_timeout=PUBLISH_TIMEOUT
            )
            assert isinstance(publisher, NatsPublisher)
            try:
                messages = await publish_partly(publisher, proxy, f"{subject}.t")
                assert publisher._replies == {}, "no reply is awaited after the waves"
            finally:
                await publisher.close()
        info = await js.stream_info(stream)
        # c's first publish was stored too (its PubAck came late), then deduplicated on
        # its Nats-Msg-Id when published again.
        assert info.state.messages == len(messages), info.state
    finally:
        await js.delete_stream(stream)
        await nc.close()


@contextlib.asynccontextmanager
async def gated_rabbitmq_publisher(
    publish_timeout: float,
) -> AsyncIterator[tuple[Publisher, Any]]:
    """A publisher routing topic ``wave`` to a fresh queue on the real RabbitMQ through a
    gate on the client's side that holds content body frames once told (``hold_after``)."""
    require("rabbitmq")
    queue_name = f"audit11.wave.{uuid.uuid4().hex[:8]}"
    connection = await aio_pika.connect(f"amqp://guest:guest@127.0.0.1:{PORTS['rabbitmq']}/")
    try:
        channel = await connection.channel()
        queue = await channel.declare_queue(queue_name)
        bodies = lambda frame: frame[0] == 3  # noqa: E731 - a content body frame
        async with gate(PORTS["rabbitmq"], split_amqp, bodies, downstream=False) as proxy:
            publisher = create_publisher(
                f"amqp://guest:guest@127.0.0.1:{proxy.port}/",
                routes={"wave": f"/{queue_name}"},
                publish_timeout=publish_timeout,
            )
            try:
                yield publisher, proxy
            finally:
                await publisher.close()
        await queue.delete(if_unused=False, if_empty=False)
    finally:
        await connection.close()


async def test_rabbitmq_keeps_the_confirms_in_before_the_timeout() -> None:
    # The client's side is gated: two publishes reach RabbitMQ, the third is held.
    async with gated_rabbitmq_publisher(PUBLISH_TIMEOUT) as (publisher, proxy):
        await publish_partly(publisher, proxy, "wave")


class Holder:
    """An HTTP server that reads each request and answers 200 only once released."""

    def __init__(self) -> None:
        self.released = asyncio.Event()
        self.arrived = asyncio.Event()
        self.port = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> Holder:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.create_task(self._answer(reader, writer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(
                int(line.split(b":", 1)[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
            await reader.readexactly(length)
            self.arrived.set()
            await self.released.wait()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def test_webhook_keeps_the_answers_in_before_the_timeout() -> None:
    fast, slow = await HookServer().start(), await Holder().start()
    try:
        publisher = WebhookPublisher(
            fast.url + "/hooks",
            routes={"slow": f"http://127.0.0.1:{slow.port}/hooks"},
            timeout=30,  # the receiver's own timeout is not what ends the wave
            publish_timeout=PUBLISH_TIMEOUT,
        )
        async with publisher:
            held, answered = await publisher.publish_batch(
                [make_message("slow", key="a"), make_message("fast", key="b")]
            )
            assert answered.kind is OutcomeKind.PUBLISHED, answered
            assert held.kind is OutcomeKind.FAILED and held.retryable, held
            assert "did not confirm" in (held.error or ""), held.error
            slow.released.set()  # a late answer, on a request given up
            await publisher.connect()
            [again] = await publisher.publish_batch([make_message("fast")])
            assert again.published, again
    finally:
        await slow.stop()
        await fast.stop()
    assert len(fast.requests) == 2
