"""NATS receiver audit: what a foreign publisher or an operator can do to a JetStream consumer.

- A message stored with a header line that carries a status (``NATS/1.0 503 …``) is a
  message like any other for JetStream (it comes with its ``$JS.ACK`` reply subject), but
  nats-py's ``fetch`` read its status as the server's: with 503 every pull failed (read as a
  lost connection, the message redelivered after the reconnect failed it again, for ever,
  and nothing after it was ever received), with 100 it was dropped unseen (redelivered every
  ``ack_wait`` without end, never dead-lettered).
- A durable consumer deleted on the server (an operator's ``nats consumer rm``, a stream
  recreated) left the receiver pulling from nothing: JetStream does not answer pulls to a
  consumer that does not exist, so every receive came back empty, for ever.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import nats
import psycopg
import pytest

from outboxer.brokers import create_publisher
from outboxer.consumer import Consumer, Delivery
from outboxer.errors import BrokerUnavailableError
from outboxer.receivers import create_receiver
from outboxer.receivers.base import Incoming, Receiver
from outboxer.testing import make_message
from tests.chaos.proxy import FaultProxy
from tests.consumer_handlers import APPLIED_DDL, record
from tests.services import require

NATS = "nats://127.0.0.1:4222"


@dataclass
class Stream:
    topic: str
    name: str
    url: str


@pytest.fixture
async def stream() -> AsyncIterator[Stream]:
    require("nats")
    topic = f"audit.{uuid.uuid4().hex[:10]}"
    name = topic.replace(".", "_")
    url = f"{NATS}?stream={name}&create_stream=true&subjects={topic}"
    async with create_publisher(url):  # creates the stream: raw messages land in it too
        pass
    yield Stream(topic, name, url)
    nc = await nats.connect(NATS)
    try:
        await nc.jetstream().delete_stream(name)
    finally:
        await nc.close()


def publish_raw(subject: str, header: bytes, payload: bytes) -> None:
    """One message as a foreign client may write it: the header block verbatim."""
    with socket.create_connection(("127.0.0.1", 4222), timeout=10) as sock:
        sock.recv(4096)  # INFO
        sock.sendall(b'CONNECT {"verbose":false,"headers":true}\r\n')
        total = len(header) + len(payload)
        sock.sendall(
            b"HPUB %s %d %d\r\n%s%s\r\nPING\r\n"
            % (subject.encode(), len(header), total, header, payload)
        )
        answer = b""
        while b"PONG" not in answer and b"-ERR" not in answer:
            chunk = sock.recv(4096)
            if not chunk:
                break
            answer += chunk
        assert b"PONG" in answer, answer  # the server took the message


async def publish(url: str, topic: str, numbers: range) -> list[uuid.UUID]:
    messages = [make_message(topic, {"n": n}, key=f"k{n}") for n in numbers]
    async with create_publisher(url) as publisher:
        outcomes = await publisher.publish_batch(messages)
    assert all(o.published for o in outcomes), outcomes
    return [m.id for m in messages]


async def collect(receiver: Receiver, count: int, timeout: float) -> list[Incoming]:
    received: list[Incoming] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while len(received) < count and loop.time() < deadline:
        received += await receiver.receive(count - len(received), 0.5)
    return received


@pytest.mark.parametrize("status", [b" 503 Boom", b" 100 Idle Heartbeat", b" 404 No Messages"])
async def test_a_stored_message_with_a_status_line_is_malformed_not_a_lost_connection(
    stream: Stream, status: bytes
) -> None:
    receiver = create_receiver(stream.url, group="g", topics=[stream.topic], ack_wait=2)
    await receiver.connect()
    try:
        publish_raw(stream.topic, b"NATS/1.0" + status + b"\r\nX-Foreign: 1\r\n\r\n", b"hostile")
        [after] = await publish(stream.url, stream.topic, range(1))
        received = await collect(receiver, 2, 8.0)
        assert [(i.delivery.body, i.malformed is not None) for i in received] == [
            (b"hostile", True),
            (b'{"n":0}', False),
        ]
        assert received[1].delivery.id == after
        await receiver.ack(received)
        assert (receiver.stats.connects, receiver.stats.acked) == (1, 2)
        # Acked: JetStream does not hand the hostile one out again.
        assert await collect(receiver, 1, 3.0) == []
    finally:
        await receiver.close()


def test_runner_dead_letters_a_message_with_a_status_line_and_applies_the_rest(
    pg_url: str, stream: Stream
) -> None:
    publish_raw(stream.topic, b"NATS/1.0 503 Boom\r\n\r\n", b"hostile")
    asyncio.run(publish(stream.url, stream.topic, range(3)))
    with psycopg.connect(pg_url) as conn:
        conn.execute(APPLIED_DDL)
    consumer = Consumer(
        db=pg_url,
        broker=stream.url,
        group="g",
        handler=record,
        topics=[stream.topic],
        exit_when_idle=True,
    )
    asyncio.run(asyncio.wait_for(consumer.run_async(), 30))
    with psycopg.connect(pg_url) as conn:
        applied = conn.execute("SELECT n FROM applied ORDER BY n").fetchall()
        dead = conn.execute("SELECT payload FROM outboxer.dead_letters").fetchall()
    assert [n for (n,) in applied] == [0, 1, 2]
    assert [bytes(payload) for (payload,) in dead] == [b"hostile"]
    assert (consumer.stats.malformed, consumer.stats.broker_errors) == (1, 0)


async def test_a_consumer_deleted_on_the_server_is_created_again(stream: Stream) -> None:
    receiver = create_receiver(stream.url, group="g", topics=[stream.topic], ack_wait=2)
    await receiver.connect()
    nc = await nats.connect(NATS)
    try:
        [first] = await publish(stream.url, stream.topic, range(1))
        got = await collect(receiver, 1, 5.0)
        assert [i.delivery.id for i in got] == [first]
        await receiver.ack(got)
        assert await nc.jetstream().delete_consumer(stream.name, "g")
        [second] = await publish(stream.url, stream.topic, range(1, 2))
        # The receive that finds the consumer gone says so (BrokerUnavailableError); the
        # runner connects again, which creates it anew: from the stream's start, so the
        # first comes again too (the inbox skips it).
        ids: list[uuid.UUID] = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 20
        while second not in ids and loop.time() < deadline:
            if not receiver.connected:
                await receiver.connect()
            try:
                incomings = await receiver.receive(10, 0.5)
            except BrokerUnavailableError:  # the loss the runner reconnects after
                continue
            ids += [i.delivery.id for i in incomings]
            await receiver.ack(incomings)
        assert ids == [first, second]
        assert receiver.stats.connects == 2
    finally:
        await nc.close()
        await receiver.close()


def test_a_handler_slower_than_ack_wait_is_applied_once_across_two_consumers(
    pg_url: str, stream: Stream
) -> None:
    """In-progress acks keep JetStream from handing a message whose handler outlasts
    ``ack_wait`` to the group's other consumer; if it does anyway, the inbox keeps it once."""
    ids = asyncio.run(publish(stream.url, stream.topic, range(4)))
    with psycopg.connect(pg_url) as conn:
        conn.execute(APPLIED_DDL)

    def slow(message: Delivery, conn: Any) -> None:
        if message.payload["n"] == 0:
            time.sleep(4.0)  # the handler's own work: more than twice ack_wait
        record(message, conn)

    def consumer(name: str) -> Consumer:
        return Consumer(
            db=pg_url,
            broker=stream.url,
            group="g",
            handler=slow,
            topics=[stream.topic],
            name=name,
            broker_options={"ack_wait": 1.5},
        )

    async def run() -> tuple[Consumer, Consumer]:
        first, second = consumer("one"), consumer("two")
        tasks = [asyncio.create_task(c.run_async()) for c in (first, second)]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while loop.time() < deadline:
            if first.receiver.stats.acked + second.receiver.stats.acked >= 4:
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(2.0)  # past another ack_wait: a redelivery would show now
        first.stop()
        second.stop()
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
        return first, second

    first, second = asyncio.run(run())
    with psycopg.connect(pg_url) as conn:
        applied = [m for (m,) in conn.execute("SELECT message_id FROM applied")]
    assert sorted(applied) == sorted(ids)
    assert first.stats.duplicates + second.stats.duplicates == 0


def test_a_cut_between_commit_and_ack_redelivers_and_the_inbox_skips_it(
    pg_url: str, stream: Stream
) -> None:
    proxy = FaultProxy(4222).start()
    try:
        ids = asyncio.run(publish(stream.url, stream.topic, range(3)))
        with psycopg.connect(pg_url) as conn:
            conn.execute(APPLIED_DDL)
        cut = threading.Event()

        def cut_once(message: Delivery, conn: Any) -> None:
            record(message, conn)
            if message.payload["n"] == 1 and not cut.is_set():
                cut.set()
                assert proxy.cut() >= 1  # committed next, its ack goes nowhere

        consumer = Consumer(
            db=pg_url,
            broker=stream.url.replace(":4222", f":{proxy.port}"),
            group="g",
            handler=cut_once,
            topics=[stream.topic],
            broker_options={"ack_wait": 1.5},
            exit_when_idle=True,
        )
        asyncio.run(asyncio.wait_for(consumer.run_async(), 30))
    finally:
        proxy.stop()
    assert cut.is_set()
    with psycopg.connect(pg_url) as conn:
        applied = [m for (m,) in conn.execute("SELECT message_id FROM applied")]
    assert sorted(applied) == sorted(ids)  # each exactly once
    assert consumer.stats.duplicates >= 1 and consumer.receiver.stats.connects >= 2
