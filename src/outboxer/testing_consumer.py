"""The contract every consumer adapter (Receiver) keeps, run against its real server.

A receiver's test module subclasses :class:`ReceiverContract` and fills in how to make the
matching publisher and a receiver on fresh names; pytest then runs every contract test
against that adapter. It lives beside ``outboxer.testing`` (the publishers' and stores'
contracts) and, like it, imports pytest: import it from tests only.
"""

from __future__ import annotations

import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Sequence

from outboxer.brokers.base import OutcomeKind, Publisher
from outboxer.errors import BrokerUnavailableError
from outboxer.message import Message
from outboxer.receivers.base import Incoming, Receiver
from outboxer.testing import make_message


class ReceiverContract(ABC):
    """The promises every Receiver keeps; subclass it once per adapter with a real server."""

    #: Seconds to wait for messages to arrive.
    receive_timeout = 15.0
    #: Seconds the broker takes to deliver again what a closed receiver held unacknowledged.
    redelivery_timeout = 15.0

    @abstractmethod
    def make_publisher(self, topic: str) -> Publisher:
        """The matching publisher (not connected), publishing where ``make_receiver`` reads."""

    @abstractmethod
    def make_receiver(self, group: str, topic: str) -> Receiver:
        """A receiver (not connected) for ``group``, consuming ``topic``."""

    @abstractmethod
    def make_unreachable_receiver(self) -> Receiver:
        """A receiver pointed at an address where nothing listens."""

    def fresh_topic(self) -> str:
        return f"contract.{uuid.uuid4().hex[:10]}"

    def fresh_group(self) -> str:
        return f"contract-{uuid.uuid4().hex[:10]}"

    async def cleanup(self, group: str, topic: str) -> None:
        """Delete what the test made on the server (queues, streams, consumers)."""
        return None

    # ----- helpers --------------------------------------------------------------------------

    async def publish(self, topic: str, messages: Sequence[Message]) -> None:
        async with self.make_publisher(topic) as publisher:
            outcomes = await publisher.publish_batch(messages)
        assert [o.kind for o in outcomes] == [OutcomeKind.PUBLISHED] * len(messages), outcomes

    async def collect(self, receiver: Receiver, count: int, timeout: float) -> list[Incoming]:
        """Receive until ``count`` messages arrived or ``timeout`` passed."""
        received: list[Incoming] = []
        deadline = time.monotonic() + timeout
        while len(received) < count and time.monotonic() < deadline:
            received += await receiver.receive(count - len(received), 0.2)
        return received

    async def _started(self, group: str, topic: str) -> Receiver:
        receiver = self.make_receiver(group, topic)
        await receiver.connect()
        return receiver

    # ----- the contract ---------------------------------------------------------------------

    async def test_delivers_what_the_publisher_sent_decoded(self) -> None:
        topic, group = self.fresh_topic(), self.fresh_group()
        receiver = await self._started(group, topic)
        sent = [
            make_message(topic, {"order": 1, "text": "zürich ✓"}, key="k-1", headers={"tr": "a"}),
            make_message(topic, "plain text", headers={"a": "1", "b": "2"}),
            make_message(topic, b"\x00\x01binary\xff", key="k-2"),
        ]
        try:
            await self.publish(topic, sent)
            received = await self.collect(receiver, 3, self.receive_timeout)
            await receiver.ack(received)
        finally:
            await receiver.close()
            await self.cleanup(group, topic)
        by_id = {incoming.delivery.id: incoming for incoming in received}
        assert set(by_id) == {message.id for message in sent}
        for message in sent:
            incoming = by_id[message.id]
            assert incoming.malformed is None
            delivery = incoming.delivery
            assert (delivery.topic, delivery.key) == (message.topic, message.key)
            assert dict(delivery.headers) == dict(message.headers)
            assert delivery.body == message.payload
            assert delivery.content_type == message.content_type
        assert by_id[sent[0].id].delivery.payload == {"order": 1, "text": "zürich ✓"}
        assert by_id[sent[1].id].delivery.payload == "plain text"
        assert by_id[sent[2].id].delivery.payload == b"\x00\x01binary\xff"

    async def test_a_keys_messages_arrive_in_publish_order(self) -> None:
        topic, group = self.fresh_topic(), self.fresh_group()
        receiver = await self._started(group, topic)
        sent = [make_message(topic, {"n": n}, key=f"k{n % 2}") for n in range(30)]
        try:
            await self.publish(topic, sent)
            received = await self.collect(receiver, 30, self.receive_timeout)
            await receiver.ack(received)
        finally:
            await receiver.close()
            await self.cleanup(group, topic)
        for key in ("k0", "k1"):
            numbers = [i.delivery.payload["n"] for i in received if i.delivery.key == key]
            assert numbers == list(range(int(key[1]), 30, 2)), numbers

    async def test_unacknowledged_messages_come_again_acknowledged_ones_never(self) -> None:
        topic, group = self.fresh_topic(), self.fresh_group()
        first = await self._started(group, topic)
        sent = [make_message(topic, {"n": n}, key="k") for n in range(4)]
        try:
            await self.publish(topic, sent)
            received = await self.collect(first, 4, self.receive_timeout)
            assert [i.delivery.id for i in received] == [m.id for m in sent]
            await first.ack(received[:2])
            await first.close()  # as a crash would: the last two were never acknowledged
            second = await self._started(group, topic)
            try:
                again = await self.collect(second, 2, self.redelivery_timeout)
                assert [i.delivery.id for i in again] == [m.id for m in sent[2:]]
                await second.ack(again)
                assert await self.collect(second, 1, 1.0) == []
            finally:
                await second.close()
        finally:
            await first.close()
            await self.cleanup(group, topic)

    async def test_an_ack_on_a_new_connection_is_not_sent_for_an_old_message(self) -> None:
        topic, group = self.fresh_topic(), self.fresh_group()
        receiver = await self._started(group, topic)
        try:
            await self.publish(topic, [make_message(topic, {"n": 1})])
            [old] = await self.collect(receiver, 1, self.receive_timeout)
            await receiver.close()
            await receiver.connect()
            await receiver.ack([old])
            assert receiver.stats.stale_acks == 1
            [again] = await self.collect(receiver, 1, self.redelivery_timeout)
            assert again.delivery.id == old.delivery.id
            await receiver.ack([again])
        finally:
            await receiver.close()
            await self.cleanup(group, topic)

    async def test_unreachable_broker_fails_to_connect(self) -> None:
        receiver = self.make_unreachable_receiver()
        receiver.connect_timeout = 5.0
        started = time.monotonic()
        try:
            await receiver.connect()
        except BrokerUnavailableError:
            pass
        else:
            raise AssertionError("connected to an address where nothing listens")
        assert time.monotonic() - started < 10
        assert not receiver.connected

    async def test_extend_and_release_keep_the_messages_deliverable(self) -> None:
        topic, group = self.fresh_topic(), self.fresh_group()
        receiver = await self._started(group, topic)
        try:
            await self.publish(topic, [make_message(topic, {"n": 1}, key="k")])
            received = await self.collect(receiver, 1, self.receive_timeout)
            await receiver.extend(received)
            await receiver.release(received)
            await receiver.close()
            await receiver.connect()
            again = await self.collect(receiver, 1, self.redelivery_timeout)
            assert [i.delivery.id for i in again] == [i.delivery.id for i in received]
            await receiver.ack(again)
        finally:
            await receiver.close()
            await self.cleanup(group, topic)


__all__ = ["ReceiverContract"]
