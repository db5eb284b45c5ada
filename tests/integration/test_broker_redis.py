"""RedisPublisher against the real Redis on 127.0.0.1:6379: the contract plus Redis specifics."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
from redis import exceptions as rexc

from outboxer.brokers import create_publisher
from outboxer.brokers.base import OutcomeKind, Publisher
from outboxer.brokers.redis import RedisPublisher, reply_is_retryable
from outboxer.errors import ConfigError
from outboxer.message import Message
from outboxer.testing import Consumer, PublisherContract, Received, make_message
from tests.services import START, require

URL = "redis://127.0.0.1:6379/0"
PREFIX = f"outboxer-test:{uuid.uuid4().hex[:8]}:"


@pytest.fixture(autouse=True)
async def _redis() -> AsyncIterator[None]:
    require("redis")
    yield
    client = aioredis.Redis.from_url(URL)
    try:
        keys = [key async for key in client.scan_iter(match=f"{PREFIX}*")]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()


class StreamConsumer(Consumer):
    """XREADs one stream after the entry that was last when it started (``start()``)."""

    def __init__(self, stream: str) -> None:
        self.stream = stream
        self.client = aioredis.Redis.from_url(URL)
        self.last_id: bytes | str = "0-0"

    async def start(self) -> StreamConsumer:
        last = await self.client.xrevrange(self.stream, count=1)
        if last:
            self.last_id = last[0][0]
        return self

    async def entries(self, count: int, wait: float) -> list[dict[bytes, bytes]]:
        found: list[dict[bytes, bytes]] = []
        deadline = time.monotonic() + wait
        while len(found) < count and time.monotonic() < deadline:
            reply = await self.client.xread(
                {self.stream: self.last_id}, count=count - len(found), block=200
            )
            for _stream, items in reply:
                for entry_id, fields in items:
                    self.last_id = entry_id
                    found.append(fields)
        return found

    async def receive(self, count: int, timeout: float = 10.0) -> list[Received]:
        return [
            Received(
                id=fields[b"id"].decode(),
                topic=fields[b"topic"].decode(),
                key=fields[b"key"].decode() if b"key" in fields else None,
                headers=json.loads(fields[b"headers"]),
                payload=fields[b"payload"],
            )
            for fields in await self.entries(count, timeout)
        ]

    async def close(self) -> None:
        await self.client.aclose()


def shutdown_redis() -> None:
    client = redis.Redis.from_url(URL)
    try:
        client.shutdown(nosave=True)
    except rexc.ConnectionError:
        pass  # the server closes the connection as it goes down
    finally:
        client.close()


class TestRedisPublisherContract(PublisherContract):
    def make_publisher(self) -> Publisher:
        return RedisPublisher(f"{URL}?stream_prefix={PREFIX}")

    def make_unreachable_publisher(self) -> Publisher:
        return RedisPublisher("redis://127.0.0.1:1/0")

    async def start_consumer(self, topic: str) -> Consumer:
        return await StreamConsumer(PREFIX + topic).start()

    def rejected_message(self, topic: str) -> Message:
        # The stream's name holds a string: every XADD to it gets WRONGTYPE, for good.
        wrong = f"{topic}.wrongtype"
        client = redis.Redis.from_url(URL)
        try:
            client.set(PREFIX + wrong, "not a stream")
        finally:
            client.close()
        return make_message(wrong, {"rejected": True})

    async def restart_server(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(None, shutdown_redis)
        finally:
            process = await asyncio.create_subprocess_shell(START["redis"])
            await process.wait()
        deadline = time.monotonic() + 30
        while True:
            client = aioredis.Redis.from_url(URL)
            try:
                await client.ping()
                return
            except rexc.RedisError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)
            finally:
                await client.aclose()


# ----- Redis specifics -------------------------------------------------------------------------


async def test_entry_field_layout() -> None:
    topic = f"layout.{uuid.uuid4().hex[:8]}"
    created = datetime(2024, 5, 1, 12, 30, tzinfo=UTC)
    keyed = make_message(topic, {"a": 1}, key="order-7", headers={"trace": "t-1", "ü": "✓"})
    keyed = Message(
        id=keyed.id,
        topic=topic,
        payload=keyed.payload,
        key="order-7",
        headers=keyed.headers,
        content_type=keyed.content_type,
        created_at=created,
    )
    keyless = make_message(topic, b"\x00raw")
    async with RedisPublisher(URL, stream_prefix=PREFIX) as publisher:
        outcomes = await publisher.publish_batch([keyed, keyless])
    assert all(o.published for o in outcomes), outcomes
    consumer = StreamConsumer(PREFIX + topic)
    first, second = await consumer.entries(2, 5)
    await consumer.close()
    assert first == {
        b"id": str(keyed.id).encode(),
        b"topic": topic.encode(),
        b"key": b"order-7",
        b"content_type": b"application/json",
        b"payload": b'{"a":1}',
        b"headers": json.dumps(
            {"trace": "t-1", "ü": "✓"}, ensure_ascii=False, separators=(",", ":")
        ).encode(),
        b"created_at": b"2024-05-01T12:30:00+00:00",
    }
    assert b"key" not in second and b"created_at" not in second
    assert second[b"payload"] == b"\x00raw"
    assert second[b"content_type"] == b"application/octet-stream"
    assert second[b"headers"] == b"{}"


async def test_routes_and_prefix_name_the_stream() -> None:
    topic = f"routed.{uuid.uuid4().hex[:8]}"
    target = f"orders.{uuid.uuid4().hex[:8]}"
    publisher = create_publisher(f"{URL}?stream_prefix={PREFIX}", routes={topic: target})
    assert isinstance(publisher, RedisPublisher)
    message = make_message(topic, {"n": 1})
    async with publisher:
        assert (await publisher.publish_batch([message]))[0].published
    consumer = StreamConsumer(PREFIX + target)
    [fields] = await consumer.entries(1, 5)
    await consumer.close()
    assert fields[b"id"] == str(message.id).encode()
    assert fields[b"topic"] == topic.encode()


async def test_maxlen_trims_the_stream_approximately() -> None:
    topic = f"trim.{uuid.uuid4().hex[:8]}"
    async with RedisPublisher(f"{URL}?stream_prefix={PREFIX}&maxlen=10") as publisher:
        assert publisher.maxlen == 10
        for _ in range(3):
            outcomes = await publisher.publish_batch(
                [make_message(topic, {"n": n}) for n in range(150)]
            )
            assert all(o.published for o in outcomes)
    client = aioredis.Redis.from_url(URL)
    length = await client.xlen(PREFIX + topic)
    await client.aclose()
    # "~" trims whole radix-tree nodes (100 entries each by default): far fewer than 450 remain.
    assert 10 <= length < 450


async def test_one_refused_command_fails_only_its_message_in_the_pipeline() -> None:
    topic = f"mixed.{uuid.uuid4().hex[:8]}"
    wrong = f"{topic}.wrongtype"
    client = aioredis.Redis.from_url(URL)
    await client.set(PREFIX + wrong, "x")
    await client.aclose()
    batch = [make_message(topic, {"n": n}, key=f"k{n}") for n in range(40)]
    batch[17] = make_message(wrong, {"n": 17}, key="k17")
    batch.append(make_message(wrong, {"n": 40}, key="k17"))  # same key, after the failure
    async with RedisPublisher(URL, stream_prefix=PREFIX) as publisher:
        outcomes = await publisher.publish_batch(batch)
    assert outcomes[17].kind is OutcomeKind.FAILED and not outcomes[17].retryable
    assert "WRONGTYPE" in (outcomes[17].error or "")
    assert outcomes[40].kind is OutcomeKind.SKIPPED
    assert all(o.published for i, o in enumerate(outcomes) if i not in (17, 40))
    consumer = StreamConsumer(PREFIX + topic)
    assert len(await consumer.entries(39, 5)) == 39
    await consumer.close()


async def test_wave_is_one_pipeline_round_trip(monkeypatch: pytest.MonkeyPatch) -> None:
    from redis.asyncio.connection import AbstractConnection

    written: list[int] = []
    original = AbstractConnection.send_packed_command

    async def counting(self: AbstractConnection, command: Any, check_health: bool = True) -> None:
        data = command if isinstance(command, bytes) else b"".join(command)  # the handshake's
        if b"XADD" in data:
            written.append(data.count(b"$4\r\nXADD\r\n"))
        await original(self, command, check_health)

    monkeypatch.setattr(AbstractConnection, "send_packed_command", counting)
    topic = f"pipe.{uuid.uuid4().hex[:8]}"
    batch = [make_message(topic, {"n": n}, key=f"k{n % 50}") for n in range(200)]
    async with RedisPublisher(URL, stream_prefix=PREFIX) as publisher:
        outcomes = await publisher.publish_batch(batch)
        assert len(publisher._idle) == 1, "the waves took turns on one connection"
    assert all(o.published for o in outcomes)
    assert written == [50, 50, 50, 50]  # four waves of 50 keys, one write each


async def test_a_cancelled_wave_leaves_no_unread_reply_for_the_next_one() -> None:
    """A wave cancelled after its write (a publish timeout, a lost lease) leaves replies on
    its connection; the next wave must not read them as its own."""
    topic = f"cancel.{uuid.uuid4().hex[:8]}"
    async with RedisPublisher(URL, stream_prefix=PREFIX) as publisher:
        assert (await publisher.publish_batch([make_message(topic)]))[0].published
        connection = publisher._idle[0]
        original = connection.read_response
        reading = asyncio.Event()

        async def stalled(*args: object, **kwargs: object) -> object:
            reading.set()
            await asyncio.sleep(3600)
            return await original(*args, **kwargs)

        connection.read_response = stalled  # type: ignore[method-assign]
        wave = asyncio.create_task(publisher.publish_batch([make_message(topic, {"n": 1})]))
        await asyncio.wait_for(reading.wait(), 5)
        wave.cancel()
        with pytest.raises(asyncio.CancelledError):
            await wave
        assert publisher._idle == [], "the connection with a reply left on it is dropped"
        refused = make_message(f"{topic}.wrongtype", {"n": 2})
        client = aioredis.Redis.from_url(URL)
        await client.set(PREFIX + refused.topic, "x")
        await client.aclose()
        outcomes = await publisher.publish_batch([refused, make_message(topic, {"n": 3})])
    assert outcomes[0].kind is OutcomeKind.FAILED and "WRONGTYPE" in (outcomes[0].error or "")
    assert outcomes[1].published
    consumer = StreamConsumer(PREFIX + topic)
    entries = await consumer.entries(3, 5)
    await consumer.close()
    assert len(entries) == 3, "the cancelled wave's XADD went out too (at-least-once)"


def test_reply_classification() -> None:
    assert not reply_is_retryable(rexc.ResponseError("WRONGTYPE Operation against a key"))
    assert not reply_is_retryable(rexc.NoPermissionError("this user has no permissions"))
    assert not reply_is_retryable(rexc.ResponseError("ERR Protocol error: invalid bulk length"))
    assert reply_is_retryable(
        rexc.OutOfMemoryError("command not allowed when used memory > 'maxmemory'")
    )
    assert reply_is_retryable(rexc.ReadOnlyError("You can't write against a read only replica."))
    assert reply_is_retryable(
        rexc.ResponseError("MISCONF Redis is configured to save RDB snapshots")
    )


def test_options_from_url_and_keywords() -> None:
    publisher = RedisPublisher(f"{URL}?stream_prefix=app:&maxlen=5000&socket_timeout=3")
    assert (publisher.stream_prefix, publisher.maxlen) == ("app:", 5000)
    assert publisher.stream_for(make_message("orders")) == "app:orders"
    assert (
        "stream_prefix" not in publisher._driver_url and "socket_timeout=3" in publisher._driver_url
    )
    keyword = RedisPublisher(f"{URL}?stream_prefix=app:&maxlen=5000", stream_prefix="", maxlen=7)
    assert (keyword.stream_prefix, keyword.maxlen) == ("", 7)
    assert RedisPublisher(URL).maxlen is None
    with pytest.raises(ConfigError, match="maxlen"):
        RedisPublisher(f"{URL}?maxlen=lots")
    with pytest.raises(ConfigError, match="maxlen"):
        RedisPublisher(URL, maxlen=0)


async def test_driver_options_in_the_url_reach_redis_py() -> None:
    topic = f"opts.{uuid.uuid4().hex[:8]}"
    async with RedisPublisher(f"{URL}?stream_prefix={PREFIX}&socket_timeout=3") as publisher:
        assert (await publisher.publish_batch([make_message(topic)]))[0].published


def test_encoded_stream_heads_stay_bounded_with_endless_topics() -> None:
    from outboxer.brokers import redis as redis_broker

    publisher = RedisPublisher(URL, maxlen=10)
    for n in range(redis_broker._HEADS_KEPT * 3):
        count, head = publisher._head(f"s{n}")
        assert count == 6 and head.endswith(b"$1\r\n*\r\n")
    assert len(publisher._heads) <= redis_broker._HEADS_KEPT
