"""Receiver.lag() on the memory and file receivers (what waits for the group, down as it is
received), and on MQTT, which cannot tell (None, also when connected)."""

from __future__ import annotations

import uuid
from pathlib import Path

from outboxer.brokers import create_publisher
from outboxer.receivers import create_receiver
from outboxer.testing import make_message
from tests.receiving import collect
from tests.services import require


async def publish(url: str, topic: str, count: int) -> None:
    async with create_publisher(url) as publisher:
        outcomes = await publisher.publish_batch(
            [make_message(topic, {"n": n}) for n in range(count)]
        )
    assert all(outcome.published for outcome in outcomes)


async def test_memory_lag_counts_the_groups_messages_not_handed_out() -> None:
    url = f"memory://lag-{uuid.uuid4().hex[:8]}"
    receiver = create_receiver(url, group="g", topics=["t.lag"])
    assert await receiver.lag() is None  # not connected
    await receiver.connect()
    try:
        await publish(url, "t.lag", 5)
        await publish(url, "t.other", 2)  # another topic's: not this group's
        assert await receiver.lag() == 5
        held = await collect(receiver, 2)
        assert await receiver.lag() == 3
        await receiver.ack(held[:1])
    finally:
        await receiver.close()  # hands the unacknowledged one back
    again = create_receiver(url, group="g", topics=["t.lag"])
    await again.connect()
    try:
        assert await again.lag() == 4
        await again.ack(await collect(again, 4))
        assert await again.lag() == 0
    finally:
        await again.close()


async def test_file_lag_counts_the_lines_not_handed_out(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    path.touch()
    url = f"file://{path}"
    receiver = create_receiver(url, group="g")
    assert await receiver.lag() is None  # not connected
    await receiver.connect()
    try:
        await publish(url, "t.lag", 4)
        with path.open("a") as file:
            file.write('{"id": "half a line, still being written')
        assert await receiver.lag() == 4
        await receiver.ack(await collect(receiver, 3))
        assert await receiver.lag() == 1
    finally:
        await receiver.close()
    restarted = create_receiver(url, group="g")
    await restarted.connect()  # from the offset acknowledged: line 4
    try:
        assert await restarted.lag() == 1
    finally:
        await restarted.close()


async def test_mqtt_cannot_tell_its_lag() -> None:
    require("mosquitto")
    receiver = create_receiver(
        "mqtt://127.0.0.1:1883?session_expiry=5",
        group=f"lag-{uuid.uuid4().hex[:8]}",
        topics=["t/lag"],
        name="lag",
    )
    await receiver.connect()
    try:
        assert await receiver.lag() is None
    finally:
        await receiver.close()
