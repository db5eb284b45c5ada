"""A broker connection that drops mid-batch: the messages never sent to it go back to the
queue with no attempt counted (they were once marked FAILED "not connected", attempts + 1,
so a flapping broker abandoned messages it never got)."""

from __future__ import annotations

import asyncio
import time
import uuid

from outboxer.brokers import create_publisher
from outboxer.brokers.base import OutcomeKind
from outboxer.brokers.memory import memory_broker
from outboxer.message import Message
from outboxer.testing import make_message
from tests.relaying import enqueue, relay, rows


async def test_a_batch_published_while_disconnected_is_not_attempted() -> None:
    """Another loop's wave lost the shared connection: this batch is not sent at all."""
    name = f"drop-{uuid.uuid4().hex[:8]}"
    broker = memory_broker(name)
    publisher = create_publisher(f"memory://{name}")
    await publisher.connect()
    broker.fail = lambda message: ConnectionResetError("gone")
    [lost] = await publisher.publish_batch([make_message("t")])
    assert lost.kind is OutcomeKind.FAILED and lost.attempted, "it was sent: attempted"
    assert not publisher.connected
    broker.fail = None
    outcomes = await publisher.publish_batch([make_message("t", key="k") for _ in range(3)])
    assert [(o.kind, o.attempted, o.retryable) for o in outcomes] == [
        (OutcomeKind.FAILED, False, True)
    ] * 3
    assert "not connected" in (outcomes[0].error or "")
    assert broker.messages == []


async def test_messages_after_a_connection_drop_are_released_without_an_attempt(
    pg_url: str,
) -> None:
    """One batch of three: wave 0 holds ``a`` (key k1) and ``boom`` (key k2), whose publish
    finds the connection gone; wave 1 holds ``b`` (k1's second), never sent. The broker
    comes back 0.3 s later: ``b`` is published with 0 attempts, ``boom`` with its one."""
    name = f"drop-{uuid.uuid4().hex[:8]}"
    broker = memory_broker(name)
    a, boom, b = enqueue(pg_url, ("t", "k1"), ("t", "k2"), ("t", "k1"))
    dropped: list[bool] = []

    def drop(message: Message) -> BaseException | None:
        if message.id != boom.id or dropped:
            return None
        dropped.append(True)
        broker.available = False  # the connection is gone until the broker comes back

        def back() -> None:
            broker.available = True

        asyncio.get_running_loop().call_later(0.3, back)
        return ConnectionResetError("connection reset by the broker")

    broker.fail = drop
    worker = relay(pg_url, f"memory://{name}", batch_size=10, backoff_base=0.1, backoff_max=0.2)
    task = asyncio.create_task(worker.run())
    deadline = time.monotonic() + 15
    try:
        while {r["status"] for r in await rows(pg_url)} != {"PUBLISHED"}:
            assert not task.done(), task
            assert time.monotonic() < deadline, await rows(pg_url)
            await asyncio.sleep(0.05)
    finally:
        worker.stop()
        await asyncio.wait_for(task, 10)
    attempts = {str(r["id"]): int(str(r["attempts"])) for r in await rows(pg_url)}
    assert attempts == {str(a.id): 0, str(boom.id): 1, str(b.id): 0}, attempts
    assert worker.stats.released >= 1 and worker.stats.failed == 1
    published = [m.id for m in broker.messages]
    assert sorted(map(str, published)) == sorted(str(m.id) for m in (a, boom, b))
    assert published.index(a.id) < published.index(b.id), "k1 in order"
