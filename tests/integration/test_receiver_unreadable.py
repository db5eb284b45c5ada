"""A message a receiver cannot take apart (a Redis stream entry with a field name that is not
UTF-8, a line of the file broker that is not an outboxer record) comes out as a malformed
delivery, which the runner dead-letters, and everything after it is delivered. Raised out of
``_receive`` instead, it read as a lost connection; the reconnect handed over the same
message first again, and the receiver never delivered anything more."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis.asyncio as aioredis

from outboxer.brokers import create_publisher
from outboxer.consumer import Consumer
from outboxer.receivers import create_receiver
from outboxer.receivers import redis as redis_receiver
from outboxer.receivers.base import Incoming, Receiver
from outboxer.receivers.base import decode as real_decode
from outboxer.testing import make_message
from tests.consumer_handlers import APPLIED_DDL, record
from tests.services import require

REDIS = "redis://127.0.0.1:6379/0"


async def publish(url: str, topic: str, numbers: range) -> list[uuid.UUID]:
    messages = [make_message(topic, {"n": n}, key=f"k{n}") for n in numbers]
    async with create_publisher(url) as publisher:
        outcomes = await publisher.publish_batch(messages)
    assert all(o.published for o in outcomes), outcomes
    return [m.id for m in messages]


async def collect(receiver: Receiver, count: int, timeout: float = 10.0) -> list[Incoming]:
    """Receive until ``count`` arrived; BrokerUnavailableError if the receive fails."""
    received: list[Incoming] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while len(received) < count and loop.time() < deadline:
        received += await receiver.receive(count - len(received), 0.2)
    return received


def consume(db: str, broker: str, topic: str, group: str) -> Consumer:
    """Run a consumer until the broker has nothing more; the consumer, for its stats."""
    with psycopg.connect(db) as conn:
        conn.execute(APPLIED_DDL)
    consumer = Consumer(
        db=db,
        broker=broker,
        group=group,
        handler=record,
        topics=[topic],
        name="unreadable",
        exit_when_idle=True,
    )
    asyncio.run(asyncio.wait_for(consumer.run_async(), 20))
    return consumer


def rows(db: str, sql: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(db) as conn:
        return conn.execute(sql).fetchall()


# ----- Redis ----------------------------------------------------------------------------------


async def xadd(redis_stream: str, fields: dict[bytes, bytes]) -> None:
    client = aioredis.Redis.from_url(REDIS)
    try:
        await client.xadd(redis_stream, fields)  # type: ignore[arg-type]
    finally:
        await client.aclose()


async def test_redis_entry_with_a_field_name_not_utf8_is_malformed_not_a_lost_connection(
    redis_stream: str,
) -> None:
    receiver = create_receiver(REDIS, group="g", topics=[redis_stream], name="unreadable")
    await receiver.connect()
    try:
        await xadd(redis_stream, {b"\xff": b"x"})
        [after] = await publish(REDIS, redis_stream, range(1))
        first = await collect(receiver, 2)
        assert [i.malformed is not None for i in first] == [True, False]
        assert first[1].delivery.id == after
        # Not acked: a receiver started again reads its pending entries from the first one.
        await receiver.close()
        await receiver.connect()
        again = await collect(receiver, 2)
        assert [i.malformed is not None for i in again] == [True, False]
        await receiver.ack(again)
        assert receiver.stats.acked == 2 and receiver.stats.connects == 2
    finally:
        await receiver.close()


async def test_redis_entry_that_fails_to_decode_is_malformed_the_rest_delivered(
    redis_stream: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever goes wrong reading one entry is that entry's problem, not the receive's."""

    def decode(headers: Any, body: bytes, **fields: Any) -> Incoming:
        if body == b'{"n":0}':
            raise RuntimeError("cannot take this one apart")
        return real_decode(headers, body, **fields)

    monkeypatch.setattr(redis_receiver, "decode", decode)
    receiver = create_receiver(REDIS, group="g", topics=[redis_stream], name="unreadable")
    await receiver.connect()
    try:
        ids = await publish(REDIS, redis_stream, range(3))
        received = await collect(receiver, 3)
        bad, *good = received
        assert bad.malformed is not None and "cannot take this one apart" in bad.malformed
        assert bad.delivery.body == b'{"n":0}' and bad.delivery.topic == redis_stream
        assert [i.delivery.id for i in good] == ids[1:]
        await receiver.ack(received)
        assert receiver.stats.acked == 3
    finally:
        await receiver.close()


def test_redis_runner_dead_letters_the_unreadable_entry_and_applies_the_rest(
    pg_url: str,
) -> None:
    require("redis")
    topic = f"unreadable-{uuid.uuid4().hex[:10]}"
    try:
        asyncio.run(xadd(topic, {b"\xff": b"x", b"payload": b"raw"}))
        asyncio.run(publish(REDIS, topic, range(3)))
        consumer = consume(pg_url, REDIS, topic, "g")
    finally:

        async def cleanup() -> None:
            client = aioredis.Redis.from_url(REDIS)
            await client.delete(topic)
            await client.aclose()

        asyncio.run(cleanup())
    assert sorted(r[0] for r in rows(pg_url, "SELECT n FROM applied")) == [0, 1, 2]
    [(error, payload)] = rows(pg_url, "SELECT error, payload FROM outboxer.dead_letters")
    assert "no message id" in error and bytes(payload) == b"raw"
    assert (consumer.stats.malformed, consumer.stats.broker_errors) == (1, 0)


# ----- the file broker --------------------------------------------------------------------------


def write_lines(path: Path, lines: list[str]) -> None:
    with path.open("a", encoding="utf-8") as file:
        file.writelines(f"{line}\n" for line in lines)


def record_line(n: int, **changes: Any) -> str:
    record = {
        "id": str(uuid.uuid4()),
        "topic": "t",
        "key": f"k{n}",
        "content_type": "application/json",
        "payload": {"n": n},
        "headers": {},
    }
    return json.dumps({**record, **changes})


async def test_file_lines_that_are_not_records_are_malformed_the_rest_delivered(
    tmp_path: Path,
) -> None:
    path = tmp_path / "events.jsonl"
    write_lines(
        path,
        [
            record_line(0),
            '{"id": "cut short',
            record_line(1, headers=None),
            "[1, 2]",
            record_line(3, headers={"attempt": 2}),
            record_line(4, headers=["a"]),
            record_line(2),
        ],
    )
    receiver = create_receiver(f"file://{path}", group="g")
    await receiver.connect()
    try:
        received = await collect(receiver, 7, 3.0)
        malformed = [i.malformed is not None for i in received]
        assert malformed == [False, True, True, True, True, True, False]
        assert "headers must be a JSON object of strings" in str(received[4].malformed)
        assert received[1].delivery.body == b'{"id": "cut short\n'
        assert [i.delivery.payload for i in (received[0], received[6])] == [{"n": 0}, {"n": 2}]
        await receiver.ack(received)
    finally:
        await receiver.close()
    assert (tmp_path / "events.jsonl.g.offset").read_text() == "7"


def test_file_runner_dead_letters_the_unreadable_lines_and_applies_the_rest(
    pg_url: str, tmp_path: Path
) -> None:
    path = tmp_path / "events.jsonl"
    write_lines(path, [record_line(0), "not json", record_line(1, headers=None), record_line(2)])
    consumer = consume(pg_url, f"file://{path}", "t", "g")
    assert sorted(r[0] for r in rows(pg_url, "SELECT n FROM applied")) == [0, 2]
    errors = [r[0] for r in rows(pg_url, "SELECT error FROM outboxer.dead_letters ORDER BY seq")]
    assert len(errors) == 2 and all("cannot be read" in error for error in errors)
    assert (consumer.stats.malformed, consumer.stats.broker_errors) == (2, 0)
    assert (tmp_path / "events.jsonl.g.offset").read_text() == "4"
