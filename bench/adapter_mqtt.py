"""Adapter-only throughput of MqttPublisher: messages/s through ``publish_batch`` (QoS 1, PUBACK each).

    .venv/bin/python bench/adapter_mqtt.py --messages 20000 --keys 1000 --batch 500

The in-flight window is the broker's Receive Maximum (Mosquitto: 20) unless lower
``--max-inflight`` is given.
"""

from __future__ import annotations

import asyncio
import uuid

from adapter_redis import arguments, measure
from outboxer.brokers.mqtt import MqttPublisher


async def main() -> None:
    parser = arguments("MqttPublisher throughput", "mqtt://127.0.0.1:1883")
    parser.add_argument("--max-inflight", type=int, default=1000)
    args = parser.parse_args()
    publisher = MqttPublisher(args.url, max_inflight=args.max_inflight)
    await measure(publisher, args, f"outboxer-bench/{uuid.uuid4().hex[:8]}")


if __name__ == "__main__":
    asyncio.run(main())
