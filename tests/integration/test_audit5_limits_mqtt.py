"""Broker-side limits of MQTT: Mosquitto holds at most ``max_queued_messages`` (1000 by
default) QoS 1 messages for a subscriber beyond those in flight, and not only while it is
away: a connected consumer whose Receive Maximum window is full (a slow or retrying
handler, see "Head-of-line blocking") has its queue capped too. The publisher gets a
successful PUBACK for every message, so outboxer counts them all published, and what is
over the cap never reaches the consumer. The docs must say so, with the setting."""

from __future__ import annotations

import uuid
from pathlib import Path

from outboxer.brokers import create_publisher
from outboxer.receivers import create_receiver
from outboxer.receivers.base import Incoming
from outboxer.testing import make_message
from tests.services import require

BROKER = "mqtt://127.0.0.1:1883?session_expiry=60"
DOCS = Path(__file__).resolve().parents[2] / "docs" / "brokers" / "mqtt.md"
#: Mosquitto's default max_queued_messages (the shared broker runs with it).
QUEUED = 1000


async def test_a_stalled_connected_consumer_loses_what_is_over_mosquittos_queue() -> None:
    require("mosquitto")
    topic = f"audit5/{uuid.uuid4().hex[:10]}"
    receiver = create_receiver(
        BROKER, group=f"g{uuid.uuid4().hex[:8]}", topics=[topic], name="a", prefetch=1
    )
    await receiver.connect()
    try:
        # The consumer is connected and subscribed, but takes nothing while the relay
        # publishes: its one-message window stays full, as behind a retrying handler.
        over = 10
        messages = [make_message(topic, {"n": n}) for n in range(1 + QUEUED + over)]
        async with create_publisher(BROKER) as publisher:
            outcomes = await publisher.publish_batch(messages)
        assert all(o.published for o in outcomes)
        received: list[Incoming] = []
        while batch := await receiver.receive(100, 0.5):
            received += batch
            await receiver.ack(batch)
    finally:
        await receiver.close()
    # One in flight plus the queue's 1000: the last ten were acknowledged and dropped.
    assert [i.delivery.id for i in received] == [m.id for m in messages[: 1 + QUEUED]]
    docs = " ".join(DOCS.read_text("utf-8").split())
    consuming = docs[docs.index("## Consuming") :]
    for said in (
        "`max_queued_messages`",
        "also while it is connected",
        "dropped",
        "max_queued_messages 0",
    ):
        assert said in consuming, said


async def test_a_group_member_that_is_away_keeps_getting_its_share() -> None:
    """A shared subscription hands messages round robin to the group's members, the ones
    that are away included (their session holds the subscription): a stopped process of a
    group receives its share into its session, which it gets only once it comes back under
    the same name, and which is lost if it never does (session expiry, queue limit). The
    docs must say so."""
    require("mosquitto")
    topic = f"audit5/{uuid.uuid4().hex[:10]}"
    group = f"g{uuid.uuid4().hex[:8]}"
    present = create_receiver(BROKER, group=group, topics=[topic], name="present")
    away = create_receiver(BROKER, group=group, topics=[topic], name="away")
    await present.connect()
    await away.connect()
    await away.close()  # a stopped process: its session stays, with the subscription
    try:
        messages = [make_message(topic, {"n": n}) for n in range(10)]
        async with create_publisher(BROKER) as publisher:
            assert all(o.published for o in await publisher.publish_batch(messages))
        seen: list[Incoming] = []
        while batch := await present.receive(100, 0.3):
            seen += batch
            await present.ack(batch)
        await away.connect()
        kept: list[Incoming] = []
        while batch := await away.receive(100, 0.3):
            kept += batch
            await away.ack(batch)
    finally:
        await present.close()
        await away.close()
    assert len(seen) == len(kept) == 5  # half of them waited for the absent member
    assert {i.delivery.id for i in seen + kept} == {m.id for m in messages}
    docs = " ".join(DOCS.read_text("utf-8").split())
    consuming = docs[docs.index("## Consuming") :]
    for said in ("members that are away", "never comes back", "Scaling a group down"):
        assert said in consuming, said
