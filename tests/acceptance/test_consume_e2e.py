"""End to end, per broker: enqueue -> `outboxer relay` -> broker -> `outboxer consume` -> rows.

The consumer is SIGKILLed twice mid-run and started again; every message must be applied
exactly once (one row each in the handler's table), each key's messages in order, and the
broker must end with nothing unacknowledged. A final SIGTERM must end the consumer with 0.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest

import outboxer
from tests.consumer_handlers import APPLIED_DDL
from tests.services import require

OUTBOXER = [sys.executable, "-m", "outboxer.cli"]
ROOT = Path(__file__).resolve().parents[2]
MESSAGES, KEYS = 1200, 12


@dataclass
class BrokerSide:
    """What differs per broker: where to publish and consume, and how to see it drained."""

    url: str
    group: str
    topic: str
    pattern: str
    #: Extra arguments for `outboxer consume`.
    consume_args: list[str] = field(default_factory=list)
    #: Whether the broker holds nothing for the group any more (nothing unacked or pending).
    drained: Callable[[], Any] | None = None
    cleanup: Callable[[], Any] | None = None


async def rabbitmq_side() -> BrokerSide:
    import aio_pika
    import aiormq

    require("rabbitmq")
    exchange = f"e2e-{uuid.uuid4().hex[:8]}"
    url = f"amqp://guest:guest@127.0.0.1:5672/?exchange={exchange}"
    group = f"e2e-{exchange}"

    async def queue_count() -> int | None:
        connection = await aio_pika.connect("amqp://guest:guest@127.0.0.1:5672/")
        try:
            channel = await connection.channel()
            queue = await channel.declare_queue(group, passive=True)
            return int(queue.declaration_result.message_count)
        except aiormq.exceptions.ChannelNotFoundEntity:
            return None
        finally:
            await connection.close()

    async def drained() -> bool:
        return await queue_count() == 0

    async def cleanup() -> None:
        connection = await aio_pika.connect("amqp://guest:guest@127.0.0.1:5672/")
        channel = await connection.channel()
        await channel.queue_delete(group)
        await channel.exchange_delete(exchange)
        await connection.close()

    return BrokerSide(url, group, "e2e.order", "e2e.*", [], drained, cleanup)


async def redis_side() -> BrokerSide:
    import redis.asyncio as aioredis

    require("redis")
    url = "redis://127.0.0.1:6379/0"
    stream = f"e2e-{uuid.uuid4().hex[:8]}"
    group = f"g-{stream}"

    async def drained() -> bool:
        client = aioredis.Redis.from_url(url)
        try:
            [info] = await client.xinfo_groups(stream)
            return bool(info["pending"] == 0 and info["lag"] == 0)
        finally:
            await client.aclose()

    async def cleanup() -> None:
        client = aioredis.Redis.from_url(url)
        await client.delete(stream)
        await client.aclose()

    return BrokerSide(url, group, stream, stream, [], drained, cleanup)


async def nats_side() -> BrokerSide:
    import nats

    require("nats")
    stream = f"e2e_{uuid.uuid4().hex[:8]}"
    subject = f"{stream}.order"
    url = f"nats://127.0.0.1:4222?stream={stream}&create_stream=true&subjects={stream}.>"
    group = f"g-{stream}"

    async def drained() -> bool:
        nc = await nats.connect("nats://127.0.0.1:4222")
        try:
            info = await nc.jetstream().consumer_info(stream, group)
            return info.num_ack_pending == 0 and info.num_pending == 0
        finally:
            await nc.close()

    async def cleanup() -> None:
        nc = await nats.connect("nats://127.0.0.1:4222")
        await nc.jetstream().delete_stream(stream)
        await nc.close()

    # A short ack_wait: a restarted consumer waits that long for the killed one's messages.
    return BrokerSide(
        url, group, subject, f"{stream}.*", ["--option", "ack_wait=2"], drained, cleanup
    )


async def kafka_side() -> BrokerSide:
    """On librdkafka's mock cluster, which lives in this test process."""
    from confluent_kafka import Consumer, TopicPartition
    from confluent_kafka.admin import AdminClient

    from tests.integration.test_broker_kafka import MockCluster

    cluster = MockCluster()
    topic = f"e2e-{uuid.uuid4().hex[:8]}"
    group = f"g-{topic}"
    admin = AdminClient({"bootstrap.servers": cluster.bootstrap})
    partitions = admin.list_topics(topic=topic, timeout=10).topics[topic].partitions  # creates it
    # A killed member's partitions move once its session times out, and the mock holds a
    # rebalance open for the session timeout less 1 s. A broker would refuse less than its
    # group.min.session.timeout.ms (6 s); the mock takes it.
    url = f"kafka://{cluster.bootstrap}?session.timeout.ms=2000&heartbeat.interval.ms=400"

    def drained() -> bool:
        consumer = Consumer({"bootstrap.servers": cluster.bootstrap, "group.id": group})
        try:
            wanted = [TopicPartition(topic, p) for p in partitions]
            committed = consumer.committed(wanted, timeout=10)
            ends = [consumer.get_watermark_offsets(tp, timeout=10)[1] for tp in wanted]
            return [tp.offset for tp in committed] == ends
        finally:
            consumer.close()

    def cleanup() -> None:
        cluster.stop()

    return BrokerSide(url, group, topic, topic, [], drained, cleanup)


async def mqtt_side() -> BrokerSide:
    import aiomqtt

    require("mosquitto")
    prefix = f"e2e/{uuid.uuid4().hex[:8]}"
    group = f"g-{prefix.replace('/', '-')}"
    name = "e2e"
    client_id = f"outboxer-{group}-{name}"

    async def drained() -> bool:
        """The consumer's session (the consumer has exited) holds nothing to send again; the
        check ends the session too."""
        async with aiomqtt.Client(
            "127.0.0.1",
            identifier=client_id,
            protocol=aiomqtt.ProtocolVersion.V5,
            clean_start=False,
        ) as client:
            await asyncio.sleep(1.5)  # a session's unacknowledged messages come at once
            arrived = client._queue.qsize()
        async with aiomqtt.Client(
            "127.0.0.1", identifier=client_id, protocol=aiomqtt.ProtocolVersion.V5, clean_start=True
        ):
            pass  # a clean start with no expiry: the session is gone
        return arrived == 0

    return BrokerSide(
        "mqtt://127.0.0.1:1883",
        group,
        f"{prefix}/order",
        f"{prefix}/+",
        ["--name", name, "--option", "session_expiry=120"],
        drained,
        None,
    )


SIDES = {
    "mqtt": mqtt_side,
    "rabbitmq": rabbitmq_side,
    "redis": redis_side,
    "nats": nats_side,
    "kafka": kafka_side,
}


@pytest.fixture(params=sorted(SIDES))
async def side(request: pytest.FixtureRequest) -> AsyncIterator[BrokerSide]:
    made = await SIDES[request.param]()
    yield made
    if made.cleanup is not None:
        done = made.cleanup()
        if asyncio.iscoroutine(done):
            await done


def spawn(args: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [*OUTBOXER, *args],
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )


def applied(db: str) -> list[tuple[str, str, int]]:
    with psycopg.connect(db) as conn:
        rows = conn.execute("SELECT message_id, key, n FROM applied ORDER BY position").fetchall()
    return [(str(message_id), key, n) for message_id, key, n in rows]


async def wait_until(check: Callable[[], Any], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


async def test_sigkilled_twice_every_message_applied_once_in_key_order(
    pg_url: str, side: BrokerSide, tmp_path: Path
) -> None:
    with psycopg.connect(pg_url) as conn:
        conn.execute(APPLIED_DDL)
        outboxer.enqueue_many(
            conn,
            [
                {"topic": side.topic, "payload": {"n": n}, "key": f"k{n % KEYS}"}
                for n in range(MESSAGES)
            ],
        )
    consume = [
        "consume",
        "--db",
        pg_url,
        "--broker",
        side.url,
        "--group",
        side.group,
        "--topic",
        side.pattern,
        "--concurrency",
        "3",
        "--batch",
        "8",
        *side.consume_args,
        "tests.consumer_handlers:record",
    ]
    log = tmp_path / "consumer.log"
    env = {"CONSUMER_TEST_SLEEP": "0.002"}
    consumer = spawn(consume, log, env)
    relay = None
    try:
        # Subscribed (the queue bound, the MQTT subscription made) before anything is sent.
        await wait_until(lambda: "receiving from" in log.read_text(), 30, "the consumer")
        relay = spawn(["relay", "--db", pg_url, "--broker", side.url], tmp_path / "relay.log")
        for fraction in (0.25, 0.6):
            await wait_until(
                lambda f=fraction: len(applied(pg_url)) >= MESSAGES * f,
                60,
                f"{fraction:.0%} applied",
            )
            consumer.send_signal(signal.SIGKILL)
            consumer.wait(10)
            consumer = spawn(consume, log, env)
        await wait_until(
            lambda: len({row[0] for row in applied(pg_url)}) >= MESSAGES, 90, "every message"
        )
        consumer.send_signal(signal.SIGTERM)
        assert consumer.wait(30) == 0, log.read_text()
        if side.drained is not None:  # what committed was acked before the exit
            await wait_until(side.drained, 15, "the broker to hold nothing unacked")
    finally:
        for process in (consumer, relay):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait(10)
    rows = applied(pg_url)
    assert len(rows) == MESSAGES, "a message was applied twice (or lost)"
    assert len({row[0] for row in rows}) == MESSAGES
    by_key: dict[str, list[int]] = {}
    for _, key, n in rows:
        by_key.setdefault(key, []).append(n)
    for key, numbers in by_key.items():
        assert numbers == sorted(numbers), f"key {key} applied out of order: {numbers}"
    with psycopg.connect(pg_url) as conn:
        (inbox,) = conn.execute(
            "SELECT count(*) FROM outboxer.inbox WHERE consumer = %s", (side.group,)
        ).fetchone() or (0,)
    assert inbox == MESSAGES
