"""Adapter-only throughput of RedisPublisher: messages/s through ``publish_batch``.

    .venv/bin/python bench/adapter_redis.py --messages 20000 --keys 1000 --batch 500

Also home of ``measure``, which the other ``bench/adapter_*.py`` scripts import.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable

from outboxer.brokers.base import Publisher
from outboxer.message import Message, uuid7


def arguments(description: str, url: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--url", default=url)
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--keys", type=int, default=1_000)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--size", type=int, default=300, help="payload bytes")
    return parser


async def measure(
    publisher: Publisher,
    args: argparse.Namespace,
    topic: str,
    cleanup: Callable[[], Awaitable[None]] | None = None,
) -> float:
    """Publish ``args.messages`` messages over ``args.keys`` keys; print and return messages/s."""
    body = b'{"data":"' + b"x" * max(args.size - 11, 0) + b'"}'
    messages = [
        Message(
            id=uuid7(),
            topic=topic,
            payload=body,
            key=f"key-{n % args.keys}",
            headers={"trace": uuid.uuid4().hex},
        )
        for n in range(args.messages)
    ]
    async with publisher:
        await publisher.publish_batch(messages[:1])  # warm up: connection and destination exist
        started = time.perf_counter()
        failed = 0
        for offset in range(0, len(messages), args.batch):
            outcomes = await publisher.publish_batch(messages[offset : offset + args.batch])
            failed += sum(not outcome.published for outcome in outcomes)
        elapsed = time.perf_counter() - started
    if cleanup is not None:
        await cleanup()
    rate = len(messages) / elapsed
    print(
        f"{type(publisher).__name__}: {len(messages)} messages of {len(body)} bytes over "
        f"{args.keys} keys in batches of {args.batch}: {elapsed:.2f}s, {rate:,.0f} msg/s"
        + (f", {failed} FAILED" if failed else "")
    )
    return rate


async def main() -> None:
    import redis.asyncio as aioredis

    from outboxer.brokers.redis import RedisPublisher

    args = arguments("RedisPublisher throughput", "redis://127.0.0.1:6379/0").parse_args()
    topic = f"bench.{uuid.uuid4().hex[:8]}"

    async def cleanup() -> None:
        client = aioredis.Redis.from_url(args.url)
        await client.delete(topic)
        await client.aclose()

    await measure(RedisPublisher(args.url), args, topic, cleanup)


if __name__ == "__main__":
    asyncio.run(main())
