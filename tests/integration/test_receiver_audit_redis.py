"""Redis receiver audit: connection cuts between commit and ack, a dead consumer's entries,
entries trimmed or deleted while pending, a stream deleted under a running consumer, and
entries a foreign writer added with hostile bytes."""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import redis.asyncio as aioredis

from outboxer.brokers import create_publisher
from outboxer.consumer import Consumer, Delivery
from outboxer.errors import BrokerUnavailableError
from outboxer.receivers import create_receiver
from outboxer.receivers.base import Incoming, Receiver
from outboxer.testing import make_message
from tests.chaos.proxy import FaultProxy
from tests.consumer_handlers import APPLIED_DDL, record
from tests.services import require

REDIS = "redis://127.0.0.1:6379/0"


@pytest.fixture
def proxy() -> Iterator[FaultProxy]:
    require("redis")
    proxy = FaultProxy(6379).start()
    yield proxy
    proxy.stop()


async def publish(topic: str, numbers: range) -> list[uuid.UUID]:
    messages = [make_message(topic, {"n": n}, key=f"k{n}") for n in numbers]
    async with create_publisher(REDIS) as publisher:
        outcomes = await publisher.publish_batch(messages)
    assert all(o.published for o in outcomes), outcomes
    return [m.id for m in messages]


async def collect(receiver: Receiver, count: int, timeout: float = 10.0) -> list[Incoming]:
    received: list[Incoming] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while len(received) < count and loop.time() < deadline:
        received += await receiver.receive(count - len(received), 0.2)
    return received


async def pending(redis_stream: str, group: str = "g") -> int:
    client = aioredis.Redis.from_url(REDIS)
    try:
        return int((await client.xpending(redis_stream, group))["pending"])
    finally:
        await client.aclose()


def rows(db: str, sql: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(db) as conn:
        return conn.execute(sql).fetchall()


def test_a_cut_between_commit_and_ack_redelivers_and_the_inbox_skips_it(
    pg_url: str, redis_stream: str, proxy: FaultProxy
) -> None:
    """The handler cuts the broker connection: its transaction commits, and an XACK sent on
    the cut connection fails: that entry comes again on the next connection and is acked
    without a second application. (The pool may send the XACK on a connection it opened
    after the cut, where it succeeds: then nothing comes again. Either way, each once.)"""
    ids = asyncio.run(publish(redis_stream, range(3)))
    with psycopg.connect(pg_url) as conn:
        conn.execute(APPLIED_DDL)
    cut = threading.Event()

    def cut_once(message: Delivery, conn: Any) -> None:
        record(message, conn)
        if message.payload["n"] == 1 and not cut.is_set():
            cut.set()
            assert proxy.cut() >= 1

    consumer = Consumer(
        db=pg_url,
        broker=f"redis://127.0.0.1:{proxy.port}/0",
        group="g",
        handler=cut_once,
        topics=[redis_stream],
        name="audit",
        exit_when_idle=True,
    )
    asyncio.run(asyncio.wait_for(consumer.run_async(), 30))
    assert cut.is_set()
    applied = rows(pg_url, "SELECT message_id FROM applied ORDER BY position")
    assert sorted(m for (m,) in applied) == sorted(ids)  # each exactly once
    # Every ack lost with the connection (failed, or dropped as the connection it belonged
    # to was gone) came again, and only those: skipped as duplicates.
    lost = consumer.receiver.stats.failed_acks + consumer.receiver.stats.stale_acks
    assert consumer.stats.duplicates == lost
    assert consumer.stats.broker_errors >= 1  # the cut was seen
    assert asyncio.run(pending(redis_stream)) == 0


async def test_entries_trimmed_while_pending_are_acked_not_delivered(redis_stream: str) -> None:
    receiver = create_receiver(REDIS, group="g", topics=[redis_stream], name="audit")
    await receiver.connect()
    client = aioredis.Redis.from_url(REDIS)
    try:
        await publish(redis_stream, range(3))
        held = await collect(receiver, 3)
        assert len(held) == 3
        # Trimmed (MAXLEN) and deleted (XDEL) while pending: the PEL still names them.
        await client.xtrim(redis_stream, maxlen=1, approximate=False)
        await receiver.close()
        await receiver.connect()
        [survivor] = await collect(receiver, 1)
        assert survivor.delivery.id == held[2].delivery.id
        assert await pending(redis_stream) == 1  # the gone ones acked, the survivor still held
        await client.xdel(redis_stream, survivor.token[1])
        await receiver.close()
        await receiver.connect()
        assert await collect(receiver, 1, 1.0) == []
        assert await pending(redis_stream) == 0
    finally:
        await client.aclose()
        await receiver.close()


async def test_a_dead_consumers_deleted_entries_do_not_stop_the_claim(redis_stream: str) -> None:
    dead = create_receiver(REDIS, group="g", topics=[redis_stream], name="dead")
    await dead.connect()
    client = aioredis.Redis.from_url(REDIS)
    try:
        await publish(redis_stream, range(3))
        held = await collect(dead, 3)
        await dead.close()
        await client.xdel(redis_stream, held[0].token[1])
        alive = create_receiver(
            f"{REDIS}?claim_idle=0.3", group="g", topics=[redis_stream], name="a"
        )
        await alive.connect()
        try:
            taken = await collect(alive, 2, 5.0)
            assert [i.delivery.id for i in taken] == [i.delivery.id for i in held[1:]]
            await alive.ack(taken)
            assert await pending(redis_stream) == 0
        finally:
            await alive.close()
    finally:
        await client.aclose()


async def test_a_stream_deleted_under_a_running_receiver_is_read_again(redis_stream: str) -> None:
    receiver = create_receiver(REDIS, group="g", topics=[redis_stream], name="audit")
    await receiver.connect()
    client = aioredis.Redis.from_url(REDIS)
    try:
        await publish(redis_stream, range(1))
        await receiver.ack(await collect(receiver, 1))
        await client.delete(redis_stream)  # the group goes with it
        [later] = await publish(redis_stream, range(1, 2))
        got: list[Incoming] = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while not got and loop.time() < deadline:
            if not receiver.connected:
                await receiver.connect()
            try:
                got = await receiver.receive(10, 0.2)
            except BrokerUnavailableError:  # NOGROUP: the runner connects again
                continue
        assert [i.delivery.id for i in got] == [later]
    finally:
        await client.aclose()
        await receiver.close()


@pytest.mark.parametrize(
    "fields",
    [
        {b"topic": b"t\x00nul"},
        {b"key": b"k\x00nul"},
        {b"headers": json.dumps({"h": "v\x00"}).encode()},
        {b"headers": json.dumps({"h\x00": "v"}).encode()},
        {b"topic": b"\xff\xfe"},
        {b"created_at": b"\x00"},
        {b"content_type": b"text/plain\x00"},
    ],
    ids=[
        "topic-nul",
        "key-nul",
        "header-value-nul",
        "header-name-nul",
        "topic-bad-utf8",
        "created-nul",
        "ctype-nul",
    ],
)
@pytest.mark.parametrize("fails", [False, True], ids=["applied", "dead-lettered"])
def test_runner_applies_or_dead_letters_an_entry_with_hostile_bytes(
    pg_url: str, redis_stream: str, fields: dict[bytes, bytes], fails: bool
) -> None:
    """An entry with a valid id whose other fields hold a NUL or invalid UTF-8 (PostgreSQL
    text refuses NUL): applied, or dead-lettered when its handler fails, and the consumer
    goes on; nothing stays pending."""

    async def add() -> uuid.UUID:
        message_id = uuid.uuid4()
        client = aioredis.Redis.from_url(REDIS)
        try:
            entry = {
                b"id": str(message_id).encode(),
                b"content_type": b"application/json",
                b"payload": b'{"n": 100}',
                **fields,
            }
            if entry[b"content_type"].startswith(b"text/"):
                entry[b"payload"] = b"plain"
            await client.xadd(redis_stream, entry)  # type: ignore[arg-type]
        finally:
            await client.aclose()
        return message_id

    hostile = asyncio.run(add())
    [after] = asyncio.run(publish(redis_stream, range(1)))
    with psycopg.connect(pg_url) as conn:
        conn.execute(APPLIED_DDL)

    def handler(message: Delivery, conn: Any) -> None:
        n = message.payload["n"] if isinstance(message.payload, dict) else 100
        if n == 100 and fails:
            raise RuntimeError("refused")
        conn.execute(  # not the key: the handler's own columns are not under test
            "INSERT INTO applied (message_id, n, attempt) VALUES (%s, %s, 1)", (message.id, n)
        )

    consumer = Consumer(
        db=pg_url,
        broker=REDIS,
        group="g",
        handler=handler,
        topics=[redis_stream],
        name="audit",
        max_attempts=1,
        exit_when_idle=True,
    )
    asyncio.run(asyncio.wait_for(consumer.run_async(), 30))
    applied = [m for (m,) in rows(pg_url, "SELECT message_id FROM applied")]
    dead = [m for (m,) in rows(pg_url, "SELECT message_id FROM outboxer.dead_letters")]
    assert after in applied
    assert (hostile in dead) == fails and (hostile in applied) == (not fails)
    assert consumer.stats.received == 2 and consumer.stats.broker_errors == 0
    assert asyncio.run(pending(redis_stream)) == 0


@pytest.mark.parametrize(
    ("query", "wait"), [("?socket_timeout=0.3", 1.0), ("", 5.5)], ids=["url", "default"]
)
async def test_a_wait_longer_than_the_socket_timeout_is_not_a_lost_connection(
    redis_stream: str, query: str, wait: float
) -> None:
    """XREADGROUP BLOCK waits on the socket: past its read timeout (the URL's
    ``socket_timeout``, which the relay shares, or redis-py's default 5 s) every empty
    receive failed as a lost connection, and the runner reconnected, over and over."""
    receiver = create_receiver(REDIS + query, group="g", topics=[redis_stream], name="audit")
    await receiver.connect()
    try:
        assert await receiver.receive(10, wait) == []
        [later] = await publish(redis_stream, range(1))
        got = await receiver.receive(10, wait)
        assert [i.delivery.id for i in got] == [later]
        assert receiver.stats.connects == 1
    finally:
        await receiver.close()


def test_runner_with_a_short_socket_timeout_goes_idle_without_reconnecting(
    pg_url: str, redis_stream: str
) -> None:
    """The relay's URL with ``socket_timeout=0.3`` given to the consumer: it used to
    reconnect after every empty wait (a warning each time) and so never went idle."""
    ids = asyncio.run(publish(redis_stream, range(2)))
    with psycopg.connect(pg_url) as conn:
        conn.execute(APPLIED_DDL)
    consumer = Consumer(
        db=pg_url,
        broker=f"{REDIS}?socket_timeout=0.3",
        group="g",
        handler=record,
        topics=[redis_stream],
        name="audit",
        exit_when_idle=True,
    )
    asyncio.run(asyncio.wait_for(consumer.run_async(), 15))
    assert sorted(m for (m,) in rows(pg_url, "SELECT message_id FROM applied")) == sorted(ids)
    assert (consumer.stats.broker_errors, consumer.receiver.stats.connects) == (0, 1)


async def test_json_nested_too_deep_is_malformed_not_a_lost_connection(redis_stream: str) -> None:
    """json.loads raises RecursionError (no ValueError) on JSON nested too deep: out of the
    receive, it read as a lost connection, and after the reconnect the same entry came first
    again, for ever. Every receiver decodes through decode_payload."""
    receiver = create_receiver(REDIS, group="g", topics=[redis_stream], name="audit")
    await receiver.connect()
    client = aioredis.Redis.from_url(REDIS)
    try:
        deep = {
            b"id": str(uuid.uuid4()).encode(),
            b"content_type": b"application/json",
            b"payload": b"[" * 100_000 + b"]" * 100_000,
        }
        await client.xadd(redis_stream, deep)  # type: ignore[arg-type]
        [after] = await publish(redis_stream, range(1))
        received = await collect(receiver, 2)
        assert [i.malformed is not None for i in received] == [True, False]
        assert "RecursionError" in str(received[0].malformed) or "nested too deep" in str(
            received[0].malformed
        )
        assert received[1].delivery.id == after
        await receiver.ack(received)
    finally:
        await client.aclose()
        await receiver.close()
