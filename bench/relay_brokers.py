"""Relay throughput per broker, relay included: PostgreSQL -> outboxer.Relay -> each broker.

    .venv/bin/python bench/relay_brokers.py [--messages 20000] [--keys 1000] [--batch 500] [--only redis,nats]

For each broker: a fresh database is filled with ``--messages`` messages of about
300 bytes over ``--keys`` keys, then one relay (default settings but the batch
size) drains it; the rate is messages / seconds from start to empty. Beside it,
the adapter alone (``publish_batch`` without a database) on the same messages,
so the relay's share is visible. Brokers that are not reachable are skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import psycopg

import outboxer
from adapter_redis import measure
from adapter_webhook import _receiver

ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"


def fill(url: str, messages: int, keys: int, size: int) -> None:
    body = {"data": "x" * max(size - 11, 0)}
    with psycopg.connect(url) as conn:
        for offset in range(0, messages, 5000):
            outboxer.enqueue_many(
                conn,
                [
                    {"topic": "bench.event", "payload": body, "key": f"key-{n % keys}"}
                    for n in range(offset, min(offset + 5000, messages))
                ],
            )


@asynccontextmanager
async def database(messages: int, keys: int, size: int) -> AsyncIterator[str]:
    name = f"outboxer_bench_relay_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(ADMIN, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    url = ADMIN.rsplit("/", 1)[0] + "/" + name
    try:
        async with outboxer.create_store(url) as store:
            await store.apply_schema()
        fill(url, messages, keys, size)
        yield url
    finally:
        with psycopg.connect(ADMIN, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@asynccontextmanager
async def rabbitmq() -> AsyncIterator[str]:
    import aio_pika

    exchange = f"bench-relay-{uuid.uuid4().hex[:8]}"
    connection = await aio_pika.connect("amqp://guest:guest@127.0.0.1/")
    channel = await connection.channel()
    declared = await channel.declare_exchange(exchange, aio_pika.ExchangeType.TOPIC, durable=True)
    queue = await channel.declare_queue(exchange, durable=True)
    await queue.bind(declared, "#")
    try:
        yield f"amqp://guest:guest@127.0.0.1/?exchange={exchange}"
    finally:
        await queue.delete(if_unused=False, if_empty=False)
        await declared.delete()
        await connection.close()


@asynccontextmanager
async def redis() -> AsyncIterator[str]:
    import redis.asyncio as aioredis

    prefix = f"bench-{uuid.uuid4().hex[:8]}:"
    try:
        yield f"redis://127.0.0.1:6379/0?stream_prefix={prefix}"
    finally:
        client = aioredis.Redis.from_url("redis://127.0.0.1:6379/0")
        async for key in client.scan_iter(f"{prefix}*"):
            await client.delete(key)
        await client.aclose()


@asynccontextmanager
async def nats() -> AsyncIterator[str]:
    import nats as nats_client

    tag = uuid.uuid4().hex[:8]
    try:
        yield (
            f"nats://127.0.0.1:4222?subject_prefix=bench{tag}.&stream=BENCH{tag}&create_stream=true"
        )
    finally:
        client = await nats_client.connect("nats://127.0.0.1:4222")
        try:
            await client.jetstream().delete_stream(f"BENCH{tag}")
        finally:
            await client.close()


@asynccontextmanager
async def mqtt() -> AsyncIterator[str]:
    yield f"mqtt://127.0.0.1:1883?topic_prefix=bench/{uuid.uuid4().hex[:8]}/"


@asynccontextmanager
async def kafka() -> AsyncIterator[str]:
    yield "kafka://mock?test.mock.num.brokers=1"


@asynccontextmanager
async def webhook() -> AsyncIterator[str]:
    sock = socket.create_server(("127.0.0.1", 0))
    child = multiprocessing.Process(target=_receiver, args=(sock,), daemon=True)
    child.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/hook?secret=bench"
    finally:
        child.terminate()
        child.join()


@asynccontextmanager
async def memory() -> AsyncIterator[str]:
    yield f"memory://bench-{uuid.uuid4().hex[:8]}"


BROKERS: dict[str, Callable[[], Any]] = {
    "memory": memory,
    "rabbitmq": rabbitmq,
    "kafka": kafka,
    "redis": redis,
    "nats": nats,
    "mqtt": mqtt,
    "webhook": webhook,
}


async def relay_rate(db: str, broker: str, batch: int, messages: int) -> float:
    settings = outboxer.load_settings({"db": db, "broker": broker, "batch_size": batch}, environ={})
    relay = outboxer.Relay.from_settings(settings)
    started = time.perf_counter()
    stats = await relay.drain()
    elapsed = time.perf_counter() - started
    if stats.published != messages:
        raise RuntimeError(f"published {stats.published} of {messages} (failed {stats.failed})")
    return messages / elapsed


async def run(name: str, args: argparse.Namespace) -> tuple[float, float] | None:
    try:
        async with BROKERS[name]() as broker, database(args.messages, args.keys, args.size) as db:
            relay = await relay_rate(db, broker, args.batch, args.messages)
            adapter_args = argparse.Namespace(
                messages=args.messages, keys=args.keys, batch=args.batch, size=args.size
            )
            adapter = await measure(outboxer.create_publisher(broker), adapter_args, "bench.event")
            return relay, adapter
    except Exception as exc:  # a broker that is down is reported, the others still run
        print(f"{name}: skipped ({type(exc).__name__}: {exc})")
        return None


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--keys", type=int, default=1_000)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--size", type=int, default=300)
    parser.add_argument("--only", default=",".join(BROKERS))
    args = parser.parse_args()
    results: dict[str, tuple[float, float]] = {}
    for name in args.only.split(","):
        outcome = await run(name, args)
        if outcome is not None:
            results[name] = outcome
    print(f"\n{'broker':<10} {'relay msg/s':>12} {'adapter msg/s':>14} {'relay/adapter':>14}")
    for name, (relay, adapter) in results.items():
        print(f"{name:<10} {relay:>12,.0f} {adapter:>14,.0f} {relay / adapter:>14.2f}")


if __name__ == "__main__":
    asyncio.run(main())
