"""``Incoming.redelivered`` on MQTT, against the real Mosquitto: the PUBLISH's DUP flag.

A persistent session (Clean Start off, a session expiry, one client id) keeps the QoS 1
messages its client had not acknowledged; when the client comes back the broker sends them
again with DUP set (MQTT 5, 4.4). aiomqtt's ``Message`` drops that flag, so the MQTT
receiver never said *redelivered* and the consumer could not tell a message that killed it
(a suspect, docs/design/consumer.md) from a first delivery: a crash loop on MQTT.
"""

from __future__ import annotations

import uuid

import pytest

from outboxer.brokers import create_publisher
from outboxer.errors import BrokerUnavailableError
from outboxer.message import Message
from outboxer.receivers import create_receiver
from outboxer.receivers.base import Receiver
from outboxer.testing import TcpProxy, make_message
from tests.integration.test_audit14_crash_redelivered_flag import collect
from tests.services import require

#: Sessions left on the broker expire within a minute.
SESSION = "session_expiry=60"


@pytest.fixture(autouse=True)
def _mosquitto() -> None:
    require("mosquitto")


def fresh() -> tuple[str, str]:
    suffix = uuid.uuid4().hex[:8]
    return f"dup/{suffix}", f"g{suffix}"


async def publish(messages: list[Message]) -> None:
    async with create_publisher("mqtt://127.0.0.1:1883") as publisher:
        assert all(o.published for o in await publisher.publish_batch(messages))


def receiver(port: int, group: str, topic: str) -> Receiver:
    # One name, so one client id: the second receiver takes over the first's session.
    return create_receiver(
        f"mqtt://127.0.0.1:{port}?{SESSION}", group=group, topics=[topic], name="one"
    )


async def test_a_message_left_unacknowledged_by_a_closed_consumer_comes_again_redelivered() -> None:
    topic, group = fresh()
    first = receiver(1883, group, topic)
    await first.connect()
    acked, dying = make_message(topic, {"n": 1}), make_message(topic, {"n": 2})
    await publish([acked, dying])
    got = await collect(first, 2, 5.0)
    assert [(i.delivery.id, i.redelivered) for i in got] == [(acked.id, False), (dying.id, False)]
    await first.ack(got[:1])
    await first.close()  # the other one never acked: its consumer died
    # Sent while nobody is connected: kept in the session, never sent, so no DUP.
    waited = make_message(topic, {"n": 3})
    await publish([waited])

    second = receiver(1883, group, topic)
    await second.connect()
    try:
        again = await collect(second, 2, 5.0)
        assert [(i.delivery.id, i.redelivered) for i in again] == [
            (dying.id, True),
            (waited.id, False),
        ]
        await second.ack(again)
        fresh_one = make_message(topic, {"n": 4})
        await publish([fresh_one])
        [new] = await collect(second, 1, 5.0)
        assert (new.delivery.id, new.redelivered) == (fresh_one.id, False)
        await second.ack([new])
    finally:
        await second.close()


async def test_a_message_in_flight_when_the_connection_is_cut_comes_again_redelivered() -> None:
    topic, group = fresh()
    proxy = await TcpProxy("127.0.0.1", 1883).start()
    consumer = receiver(proxy.port, group, topic)
    try:
        await consumer.connect()
        message = make_message(topic, {"n": 1})
        await publish([message])
        [got] = await collect(consumer, 1, 5.0)
        assert got.redelivered is False
        await proxy.cut()
        with pytest.raises(BrokerUnavailableError):
            # The cut shows as a lost connection; its wait ends there, not at the timeout.
            while True:
                assert not await consumer.receive(1, 5.0), "nothing else was published"
        await proxy.restore()
        await consumer.connect()  # the same receiver, its session taken up again
        [again] = await collect(consumer, 1, 5.0)
        assert (again.delivery.id, again.redelivered) == (message.id, True)
        await consumer.ack([again])
    finally:
        await consumer.close()
        await proxy.stop()
