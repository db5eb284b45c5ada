"""Every receiver passes the receiver contract (outboxer.testing_consumer) on its real server."""

from __future__ import annotations

import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import aio_pika
import pytest

from outboxer.brokers import create_publisher
from outboxer.brokers.base import Publisher
from outboxer.receivers import create_receiver
from outboxer.receivers.base import Receiver
from outboxer.testing import make_message
from outboxer.testing_consumer import ReceiverContract
from tests.services import require

AMQP = "amqp://guest:guest@127.0.0.1:5672/"
REDIS = "redis://127.0.0.1:6379/0"


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class TestRabbitMQReceiver(ReceiverContract):
    @pytest.fixture(autouse=True)
    def _service(self) -> None:
        require("rabbitmq")

    def url(self, topic: str) -> str:
        return f"{AMQP}?exchange=x-{topic}"

    def make_publisher(self, topic: str) -> Publisher:
        return create_publisher(self.url(topic))

    def make_receiver(self, group: str, topic: str) -> Receiver:
        return create_receiver(self.url(topic), group=group, topics=[topic])

    def make_unreachable_receiver(self) -> Receiver:
        return create_receiver(f"amqp://guest:guest@127.0.0.1:{closed_port()}/", group="g")

    async def cleanup(self, group: str, topic: str) -> None:
        connection = await aio_pika.connect(AMQP)
        channel = await connection.channel()
        await channel.queue_delete(group)
        await channel.exchange_delete(f"x-{topic}")
        await connection.close()


class TestRedisReceiver(ReceiverContract):
    @pytest.fixture(autouse=True)
    def _service(self) -> None:
        require("redis")

    def make_publisher(self, topic: str) -> Publisher:
        return create_publisher(REDIS)

    def make_receiver(self, group: str, topic: str) -> Receiver:
        return create_receiver(REDIS, group=group, topics=[topic], name="contract")

    def make_unreachable_receiver(self) -> Receiver:
        return create_receiver(f"redis://127.0.0.1:{closed_port()}/0", group="g", topics=["t"])

    async def cleanup(self, group: str, topic: str) -> None:
        import redis.asyncio as aioredis

        client = aioredis.Redis.from_url(REDIS)
        await client.delete(topic)
        await client.aclose()

    async def test_a_dead_consumers_entries_are_claimed_by_another(self) -> None:
        topic, group = self.fresh_topic(), self.fresh_group()
        dead = create_receiver(REDIS, group=group, topics=[topic], name="dead")
        await dead.connect()
        try:
            await self.publish(topic, [make_message(topic, {"n": n}, key="k") for n in range(3)])
            held = await self.collect(dead, 3, self.receive_timeout)
            await dead.close()  # never acks: it died
            alive = create_receiver(
                f"{REDIS}?claim_idle=0.3", group=group, topics=[topic], name="alive"
            )
            await alive.connect()
            try:
                taken = await self.collect(alive, 3, 5.0)
                assert [i.delivery.id for i in taken] == [i.delivery.id for i in held]
                await alive.ack(taken)
            finally:
                await alive.close()
        finally:
            await self.cleanup(group, topic)


class TestNatsReceiver(ReceiverContract):
    redelivery_timeout = 10.0

    @pytest.fixture(autouse=True)
    def _service(self) -> None:
        require("nats")

    def url(self, topic: str) -> str:
        stream = topic.replace(".", "_")
        return f"nats://127.0.0.1:4222?stream={stream}&create_stream=true&subjects={topic}"

    def make_publisher(self, topic: str) -> Publisher:
        return create_publisher(self.url(topic))

    def make_receiver(self, group: str, topic: str) -> Receiver:
        return create_receiver(self.url(topic), group=group, topics=[topic], ack_wait=1.5)

    def make_unreachable_receiver(self) -> Receiver:
        return create_receiver(f"nats://127.0.0.1:{closed_port()}", group="g")

    async def cleanup(self, group: str, topic: str) -> None:
        import nats

        nc = await nats.connect("nats://127.0.0.1:4222")
        await nc.jetstream().delete_stream(topic.replace(".", "_"))
        await nc.close()

    async def test_in_progress_acks_keep_a_slow_message_from_redelivery(self) -> None:
        topic, group = self.fresh_topic(), self.fresh_group()
        holder = self.make_receiver(group, topic)
        other = self.make_receiver(group, topic)
        await holder.connect()
        await other.connect()
        try:
            await self.publish(topic, [make_message(topic, {"n": 1})])
            held = await self.collect(holder, 1, self.receive_timeout)
            for _ in range(6):  # 3 s: twice ack_wait, kept alive every 0.5 s
                await holder.extend(held)
                assert await other.receive(1, 0.5) == []
            await holder.ack(held)
        finally:
            await holder.close()
            await other.close()
            await self.cleanup(group, topic)


@pytest.fixture(scope="module")
def kafka_cluster() -> Iterator[str]:
    from tests.integration.test_broker_kafka import MockCluster

    cluster = MockCluster()
    yield cluster.bootstrap
    cluster.stop()


class TestKafkaReceiver(ReceiverContract):
    """On librdkafka's mock cluster (no Kafka broker runs here), as the publisher's tests."""

    receive_timeout = redelivery_timeout = 30.0

    @pytest.fixture(autouse=True)
    def _cluster(self, kafka_cluster: str) -> None:
        self.bootstrap = kafka_cluster

    def fresh_topic(self) -> str:
        from confluent_kafka.admin import AdminClient

        topic = f"contract-{uuid.uuid4().hex[:10]}"
        admin = AdminClient({"bootstrap.servers": self.bootstrap})
        # A metadata request creates the topic on the mock cluster (4 partitions).
        assert admin.list_topics(topic=topic, timeout=10).topics[topic].partitions
        return topic

    def make_publisher(self, topic: str) -> Publisher:
        return create_publisher(f"kafka://{self.bootstrap}")

    def make_receiver(self, group: str, topic: str) -> Receiver:
        # The mock cluster lets a new member in once the old one's session timed out, and
        # holds a rebalance open for the session timeout less 1 s. The mock, unlike a
        # broker (group.min.session.timeout.ms, 6 s), takes a shorter one.
        url = f"kafka://{self.bootstrap}?session.timeout.ms=2000&heartbeat.interval.ms=400"
        return create_receiver(url, group=group, topics=[topic])

    def make_unreachable_receiver(self) -> Receiver:
        return create_receiver(f"kafka://127.0.0.1:{closed_port()}", group="g", topics=["t"])


class TestMqttReceiver(ReceiverContract):
    @pytest.fixture(autouse=True)
    def _service(self) -> None:
        require("mosquitto")

    def make_publisher(self, topic: str) -> Publisher:
        return create_publisher("mqtt://127.0.0.1:1883")

    def make_receiver(self, group: str, topic: str) -> Receiver:
        return create_receiver(  # sessions left on the broker expire within a minute
            "mqtt://127.0.0.1:1883?session_expiry=60", group=group, topics=[topic], name="contract"
        )

    def make_unreachable_receiver(self) -> Receiver:
        return create_receiver(f"mqtt://127.0.0.1:{closed_port()}", group="g")

    async def test_pubacks_go_out_in_arrival_order(self) -> None:
        topic, group = self.fresh_topic(), self.fresh_group()
        receiver = self.make_receiver(group, topic)
        await receiver.connect()
        try:
            await self.publish(topic, [make_message(topic, {"n": n}) for n in range(3)])
            received = await self.collect(receiver, 3, self.receive_timeout)
            await receiver.ack(received[1:])  # the first is not done: no PUBACK goes out yet
            await receiver.close()
            await receiver.connect()
            again = await self.collect(receiver, 3, self.redelivery_timeout)
            assert [i.delivery.id for i in again] == [i.delivery.id for i in received]
            await receiver.ack(again)
        finally:
            await receiver.close()


class TestFileReceiver(ReceiverContract):
    """The demo's JSON-lines broker (no server)."""

    @pytest.fixture(autouse=True)
    def _folder(self, tmp_path: Path) -> None:
        self.folder = tmp_path

    def url(self, topic: str) -> str:
        return f"file://{self.folder / topic}.jsonl"

    def make_publisher(self, topic: str) -> Publisher:
        return create_publisher(self.url(topic))

    def make_receiver(self, group: str, topic: str) -> Receiver:
        (self.folder / f"{topic}.jsonl").touch()
        return create_receiver(self.url(topic), group=group)

    def make_unreachable_receiver(self) -> Receiver:
        return create_receiver(f"file://{self.folder}/missing/events.jsonl", group="g")
