"""Redis receiver with ``exit_when_idle``: not idle while other consumers of the group hold
pending entries.

An empty read said "idle" at once: a consumer run with ``--exit-when-idle`` exited with a
dead consumer's pending entries still in the group's pending list, before they were idle
``claim_idle`` seconds and could be taken over: unapplied until some later run. A live
consumer's entries are not taken early either: the idle consumer waits for them to be
acknowledged (or, if their holder dies, idle long enough to be claimed)."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import redis.asyncio as aioredis

from outboxer.brokers import create_publisher
from outboxer.consumer import Consumer, Delivery
from outboxer.receivers import create_receiver
from outboxer.receivers.base import Incoming
from outboxer.testing import make_message
from tests.services import require

REDIS = "redis://127.0.0.1:6379/0"


def consumer(db: str, group: str, stream: str, applied: list[int]) -> Consumer:
    def record(message: Delivery, conn: Any) -> None:
        applied.append(message.payload["n"])

    return Consumer(
        db=db,
        broker=f"{REDIS}?claim_idle=0.6",
        group=group,
        handler=record,
        topics=[stream],
        name="drainer",
        exit_when_idle=True,
    )


async def publish(stream: str, numbers: range) -> None:
    async with create_publisher(REDIS) as publisher:
        messages = [make_message(stream, {"n": n}, key=f"k{n}") for n in numbers]
        assert all(o.published for o in await publisher.publish_batch(messages))


def test_exit_when_idle_waits_to_take_over_a_dead_consumers_entries(sqlite_url: str) -> None:
    require("redis")
    stream, group = f"test-{uuid.uuid4().hex[:12]}", f"g-{uuid.uuid4().hex[:8]}"

    async def scenario() -> list[int]:
        client = aioredis.Redis.from_url(REDIS)
        try:
            await client.xgroup_create(stream, group, id="0", mkstream=True)
            await publish(stream, range(3))
            # Read by a consumer that died before acknowledging them.
            assert len((await client.xreadgroup(group, "dead", {stream: ">"}))[0][1]) == 3
            await publish(stream, range(3, 5))
            applied: list[int] = []
            await asyncio.wait_for(consumer(sqlite_url, group, stream, applied).run_async(), 8)
            assert int((await client.xpending(stream, group))["pending"]) == 0
            return sorted(applied)
        finally:
            await client.delete(stream)
            await client.aclose()

    assert asyncio.run(scenario()) == [0, 1, 2, 3, 4]


def test_exit_when_idle_leaves_a_live_consumers_entries_and_waits_for_them(
    sqlite_url: str,
) -> None:
    require("redis")
    stream, group = f"test-{uuid.uuid4().hex[:12]}", f"g-{uuid.uuid4().hex[:8]}"

    async def scenario() -> tuple[list[int], float, float]:
        client = aioredis.Redis.from_url(REDIS)
        live = create_receiver(f"{REDIS}?claim_idle=0.6", group=group, topics=[stream], name="live")
        try:
            await publish(stream, range(2))
            await live.connect()
            held: list[Incoming] = []
            deadline = time.monotonic() + 5
            while len(held) < 2 and time.monotonic() < deadline:
                held += await live.receive(2 - len(held), 0.1)
            assert len(held) == 2
            await publish(stream, range(2, 4))

            async def hold_then_ack() -> float:
                # Held three times claim_idle, kept fresh as the runner does, then done.
                until = time.monotonic() + 1.8
                while time.monotonic() < until:
                    await live.extend(held)
                    await asyncio.sleep(0.1)
                acking = time.monotonic()
                await live.ack(held)
                return acking

            applied: list[int] = []
            holder = asyncio.ensure_future(hold_then_ack())
            await asyncio.wait_for(consumer(sqlite_url, group, stream, applied).run_async(), 8)
            exited = time.monotonic()
            acked = await holder
            assert int((await client.xpending(stream, group))["pending"]) == 0
            return sorted(applied), exited, acked
        finally:
            await live.close()
            await client.delete(stream)
            await client.aclose()

    applied, exited, acked = asyncio.run(scenario())
    assert applied == [2, 3]  # the live consumer's entries were not taken from it
    assert exited >= acked  # and the drainer waited for them to be acknowledged
