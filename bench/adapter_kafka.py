"""Adapter-only throughput of KafkaPublisher: messages/s through ``publish_batch``.

    .venv/bin/python bench/adapter_kafka.py --messages 20000 --keys 1000 --batch 500

Without ``--url`` it runs against librdkafka's built-in mock cluster (in this
process, no replication, no disk), so the figure is the client side's cost:
give ``--url kafka://host:9092`` to measure a real cluster.
"""

from __future__ import annotations

import asyncio
import json
import uuid

from adapter_redis import arguments, measure  # the shared bench harness
from outboxer.brokers.kafka import KafkaPublisher


async def main() -> None:
    parser = arguments("KafkaPublisher throughput", "kafka://mock?test.mock.num.brokers=1")
    parser.add_argument(
        "--config", default="{}", help='librdkafka properties as JSON, e.g. {"linger.ms": 20}'
    )
    args = parser.parse_args()
    await measure(
        KafkaPublisher(args.url, config=json.loads(args.config)),
        args,
        f"bench-{uuid.uuid4().hex[:8]}",
    )


if __name__ == "__main__":
    asyncio.run(main())
