"""RabbitMQReceiver audit against the real RabbitMQ: a prefetch AMQP cannot carry, a queue
deleted under the consumer, and messages from a foreign producer whose properties are not
UTF-8 (pamqp raised on them inside aiormq's reader: the connection dropped, the message
came back first after every reconnect, and the consumer never got past it)."""

from __future__ import annotations

import asyncio
import struct
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aio_pika
import aiormq
import psycopg
import pytest
from aiormq import spec

from outboxer.brokers import create_publisher
from outboxer.brokers.rabbitmq import _Properties
from outboxer.consumer import Consumer, Delivery
from outboxer.errors import BrokerUnavailableError, ConfigError
from outboxer.receivers import create_receiver
from outboxer.receivers.base import Receiver
from outboxer.retry import Backoff
from outboxer.testing import make_message
from tests.chaos.proxy import FaultProxy
from tests.consumer_handlers import APPLIED_DDL, record
from tests.services import require

AMQP = "amqp://guest:guest@127.0.0.1:5672/"


class Names:
    def __init__(self) -> None:
        self.exchange = f"audit-r-{uuid.uuid4().hex[:8]}"
        self.group = f"g-{self.exchange}"
        self.url = f"{AMQP}?exchange={self.exchange}"


@pytest.fixture
async def names() -> AsyncIterator[Names]:
    require("rabbitmq")
    made = Names()
    yield made
    connection = await aio_pika.connect(AMQP)
    async with connection:
        channel = await connection.channel()
        await channel.queue_delete(made.group)
        await channel.exchange_delete(made.exchange)


def test_prefetch_over_amqp_limit_is_a_config_error() -> None:
    # basic.qos' prefetch-count is 16 bits: 65536 failed on every connect, which read as an
    # unreachable broker (BrokerUnavailableError), so the consumer retried for ever.
    with pytest.raises(ConfigError, match="65535"):
        create_receiver(AMQP, group="g", prefetch=65536)
    assert create_receiver(AMQP, group="g", prefetch=65535).prefetch == 65535


async def test_prefetch_at_amqp_limit_connects(names: Names) -> None:
    receiver = create_receiver(names.url, group=names.group, prefetch=65535)
    await receiver.connect()
    await receiver.close()


async def test_deleted_queue_is_a_lost_connection_and_the_reconnect_consumes_again(
    names: Names,
) -> None:
    receiver = create_receiver(names.url, group=names.group)
    await receiver.connect()
    connection = await aio_pika.connect(AMQP)
    try:
        channel = await connection.channel()
        await channel.queue_delete(names.group)  # RabbitMQ cancels the consumer
        with pytest.raises(BrokerUnavailableError, match="lost"):
            await receiver.receive(10, timeout=10.0)
        assert not receiver.connected
        await receiver.connect()  # declares the queue again
        publisher = create_publisher(names.url)
        async with publisher:
            message = make_message("t.x", {"n": 1})
            [outcome] = await publisher.publish_batch([message])
            assert outcome.published, outcome
        got = await receiver.receive(10, timeout=10.0)
        assert [i.delivery.id for i in got] == [message.id]
        await receiver.ack(got)
    finally:
        await receiver.close()
        await connection.close()


def field_table(entries: list[tuple[bytes, bytes]]) -> bytes:
    """An AMQP field table from raw (name, typed value) pairs: names need not be UTF-8."""
    body = b"".join(bytes((len(name),)) + name + value for name, value in entries)
    return struct.pack(">I", len(body)) + body


def long_string(data: bytes) -> bytes:
    return b"S" + struct.pack(">I", len(data)) + data


def short_string(data: bytes) -> bytes:
    return bytes((len(data),)) + data


def raw_properties(
    *, message_id: bytes | None = None, content_type: bytes | None = None, headers: bytes = b""
) -> _Properties:
    """Basic properties written byte for byte (content type, headers, message id)."""
    flags, parts = 0, []
    if content_type is not None:
        flags |= 0x8000
        parts.append(short_string(content_type))
    if headers:
        flags |= 0x2000
        parts.append(headers)
    if message_id is not None:
        flags |= 0x0080
        parts.append(short_string(message_id))
    properties = _Properties()
    properties.wire = struct.pack(">H", flags) + b"".join(parts)
    return properties


async def publish_raw(exchange: str, messages: list[tuple[bytes, _Properties]]) -> None:
    connection = await aiormq.connect(AMQP)
    try:
        channel = await connection.channel()
        for body, properties in messages:
            confirm = await channel.basic_publish(
                body, exchange=exchange, routing_key="t.x", properties=properties
            )
            assert isinstance(confirm, spec.Basic.Ack)
    finally:
        await connection.close()


def hostile_messages(good_id: uuid.UUID) -> list[tuple[bytes, _Properties]]:
    nested = field_table([(b"in\xffner", long_string(b"v"))])
    return [
        # A message id that is not UTF-8.
        (b'{"n": 1}', raw_properties(message_id=b"\xff\xfe", content_type=b"application/json")),
        # A content type that is not UTF-8.
        (b'{"n": 2}', raw_properties(message_id=str(uuid.uuid4()).encode(), content_type=b"\xc3")),
        # A header name that is not UTF-8, and one inside a nested table.
        (
            b'{"n": 3}',
            raw_properties(
                message_id=str(uuid.uuid4()).encode(),
                content_type=b"application/json",
                headers=field_table(
                    [(b"bad\x80name", long_string(b"x")), (b"nest", b"F" + nested)]
                ),
            ),
        ),
        # Then an ordinary message: it must get through.
        (
            b'{"n": 4}',
            raw_properties(message_id=str(good_id).encode(), content_type=b"application/json"),
        ),
    ]


async def test_properties_not_utf8_arrive_as_messages_not_as_a_lost_connection(
    names: Names,
) -> None:
    receiver = create_receiver(names.url, group=names.group)
    await receiver.connect()
    try:
        good = uuid.uuid4()
        await publish_raw(names.exchange, hostile_messages(good))
        got: list[Any] = []
        while len(got) < 4:
            batch = await receiver.receive(10, timeout=10.0)  # raised on the old code
            assert batch, f"only {len(got)} of 4 messages arrived"
            got += batch
        await receiver.ack(got)
        assert receiver.stats.connects == 1
        first, second, third, fourth = got
        assert first.malformed is not None and "not a UUID" in first.malformed
        assert second.malformed is None
        assert second.delivery.content_type == "\ufffd"
        assert third.malformed is None
        assert third.delivery.headers["bad\ufffdname"] == "x"
        assert "in\ufffdner" in third.delivery.headers["nest"]
        assert fourth.malformed is None and fourth.delivery.id == good
        assert fourth.delivery.payload == {"n": 4}
    finally:
        await receiver.close()


async def test_runner_dead_letters_properties_not_utf8_and_applies_the_rest(
    names: Names, pg_url: str
) -> None:
    with psycopg.connect(pg_url) as conn:
        conn.execute(APPLIED_DDL)
    applied: list[Delivery] = []

    def handler(message: Delivery, conn: Any) -> None:
        applied.append(message)
        if isinstance(message.payload, dict):  # the one with a content type not UTF-8: bytes
            record(message, conn)

    consumer = Consumer(
        db=pg_url,
        broker=names.url,
        group=names.group,
        handler=handler,
        backoff=Backoff(base=0.05, multiplier=2, cap=0.2, jitter=0),
    )
    task = asyncio.create_task(consumer.run_async())
    try:
        receiver: Receiver = consumer.receiver
        deadline = asyncio.get_running_loop().time() + 20
        while not receiver.connected:
            assert asyncio.get_running_loop().time() < deadline, "never connected"
            await asyncio.sleep(0.05)
        good = uuid.uuid4()
        await publish_raw(names.exchange, hostile_messages(good))
        while not any(m.id == good for m in applied):
            assert asyncio.get_running_loop().time() < deadline, (
                f"the ordinary message after the hostile ones was not applied "
                f"(connects: {receiver.stats.connects})"
            )
            await asyncio.sleep(0.05)
    finally:
        consumer.stop()
        stats = await task
    assert stats.dead_lettered == 1  # the one whose id is not UTF-8
    assert sorted(m.payload["n"] for m in applied if isinstance(m.payload, dict)) == [3, 4]
    with psycopg.connect(pg_url) as conn:
        [(letters,)] = conn.execute("SELECT count(*) FROM outboxer.dead_letters").fetchall()
    assert letters == 1
    assert consumer.receiver.stats.connects == 1


async def test_prefetch_bounds_the_unacked_messages_handed_over(names: Names) -> None:
    receiver = create_receiver(names.url, group=names.group, prefetch=3)
    await receiver.connect()
    try:
        async with create_publisher(names.url) as publisher:
            messages = [make_message("t.p", {"n": n}) for n in range(10)]
            assert all(o.published for o in await publisher.publish_batch(messages))
        held = await receiver.receive(10, timeout=10.0)
        while len(held) < 3:
            more = await receiver.receive(10, timeout=5.0)
            assert more, f"only {len(held)} of the prefetch's 3 arrived"
            held += more
        assert len(held) == 3
        assert await receiver.receive(10, timeout=0.5) == []  # nothing past the prefetch
        await receiver.ack(held)
        later = await receiver.receive(10, timeout=10.0)
        assert 1 <= len(later) <= 3
        assert {i.delivery.id for i in held + later} <= {m.id for m in messages}
    finally:
        await receiver.close()


async def test_connection_cut_between_commit_and_ack_redelivers_and_skips(
    names: Names, pg_url: str
) -> None:
    """The transaction committed, then the connection went before the ack: RabbitMQ
    delivers the message again, the inbox knows it, and that copy is acked."""
    with psycopg.connect(pg_url) as conn:
        conn.execute(APPLIED_DDL)
    proxy = FaultProxy(5672).start()
    consumer = Consumer(
        db=pg_url,
        broker=f"amqp://guest:guest@127.0.0.1:{proxy.port}/?exchange={names.exchange}",
        group=names.group,
        handler=record,
        backoff=Backoff(base=0.05, multiplier=2, cap=0.2, jitter=0),
    )
    receiver: Any = consumer.receiver
    ack = receiver._ack
    cut: list[int] = []

    async def cut_then_ack(incomings: Any) -> None:
        if not cut:
            cut.append(proxy.cut())  # both sides see a reset, no close handshake
        await ack(incomings)

    receiver._ack = cut_then_ack
    task = asyncio.create_task(consumer.run_async())
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while not receiver.connected:
            assert loop.time() < deadline, "never connected"
            await asyncio.sleep(0.05)
        async with create_publisher(names.url) as publisher:
            [outcome] = await publisher.publish_batch([make_message("t.c", {"n": 7})])
            assert outcome.published
        while consumer.stats.duplicates < 1:
            assert loop.time() < deadline, (
                f"no redelivery skipped as a duplicate ({consumer.stats})"
            )
            await asyncio.sleep(0.05)
    finally:
        consumer.stop()
        stats = await task
        proxy.stop()
    assert cut == [1]  # one connection was open, and cut
    assert (stats.applied, stats.duplicates) == (1, 1)
    assert receiver.stats.connects == 2
    with psycopg.connect(pg_url) as conn:
        assert conn.execute("SELECT n FROM applied").fetchall() == [(7,)]
    connection = await aio_pika.connect(AMQP)
    async with connection:
        channel = await connection.channel()
        queue = await channel.declare_queue(names.group, passive=True)
        assert queue.declaration_result.message_count == 0  # the copy was acked
