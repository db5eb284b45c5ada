"""Adapter-only throughput of NatsPublisher: messages/s through ``publish_batch`` (PubAck each).

    .venv/bin/python bench/adapter_nats.py --messages 20000 --keys 1000 --batch 500

Publishes into a throw-away stream (file storage, created and deleted here).
"""

from __future__ import annotations

import asyncio
import uuid

import nats

from adapter_redis import arguments, measure
from outboxer.brokers.nats import NatsPublisher


async def main() -> None:
    args = arguments("NatsPublisher throughput", "nats://127.0.0.1:4222").parse_args()
    tag = uuid.uuid4().hex[:8]
    stream, prefix = f"BENCH_{tag}", f"bench{tag}."
    publisher = NatsPublisher(args.url, subject_prefix=prefix, stream=stream, create_stream=True)

    async def cleanup() -> None:
        nc = await nats.connect(args.url)
        await nc.jetstream().delete_stream(stream)
        await nc.close()

    await measure(publisher, args, "events", cleanup)


if __name__ == "__main__":
    asyncio.run(main())
