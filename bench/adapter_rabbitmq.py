"""Adapter-only throughput of RabbitMQPublisher: messages/s through ``publish_batch``.

    .venv/bin/python bench/adapter_rabbitmq.py --messages 20000 --keys 1000 --batch 500

Every message is persistent, ``mandatory`` and confirmed; a durable queue is bound
to the topic for the run (so nothing is returned as unroutable) and deleted after.
"""

from __future__ import annotations

import asyncio
import uuid

import aio_pika

from adapter_redis import arguments, measure  # the shared bench harness
from outboxer.brokers.rabbitmq import RabbitMQPublisher


async def main() -> None:
    parser = arguments("RabbitMQPublisher throughput", "amqp://guest:guest@127.0.0.1:5672/")
    parser.add_argument("--exchange", default="outboxer-bench")
    parser.add_argument(
        "--transient",
        action="store_true",
        help="delivery_mode 1 and a non-durable queue (no disk writes)",
    )
    args = parser.parse_args()
    topic = f"bench.{uuid.uuid4().hex[:8]}"
    connection = await aio_pika.connect(args.url)
    channel = await connection.channel()
    exchange = await channel.declare_exchange(args.exchange, "topic", durable=True)
    queue = await channel.declare_queue(f"outboxer-bench-{topic}", durable=not args.transient)
    await queue.bind(exchange, topic)

    async def cleanup() -> None:
        await queue.delete(if_unused=False, if_empty=False)
        await connection.close()

    publisher = RabbitMQPublisher(args.url, exchange=args.exchange, persistent=not args.transient)
    try:
        await measure(publisher, args, topic, cleanup)
    finally:
        if not connection.is_closed:
            await cleanup()


if __name__ == "__main__":
    asyncio.run(main())
