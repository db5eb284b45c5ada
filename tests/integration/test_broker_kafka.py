"""KafkaPublisher: the contract against librdkafka's mock cluster, and against a real broker.

No Kafka broker runs on this machine, so the contract runs against the mock
cluster librdkafka builds into every client (``test.mock.num.brokers``): a
real Kafka protocol server on 127.0.0.1 that lives as long as the client that
made it. ``TestKafkaRealBroker`` runs the same contract against a real broker
when ``OUTBOXER_KAFKA_BOOTSTRAP=host:port`` is set, and skips otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import logging
import os
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import OFFSET_BEGINNING, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka import Consumer as KafkaConsumer
from confluent_kafka import Message as KafkaMessage
from confluent_kafka.admin import AdminClient, NewTopic

from outboxer.brokers import create_publisher
from outboxer.brokers.base import OutcomeKind
from outboxer.brokers.kafka import KafkaPublisher, KafkaPublishError
from outboxer.errors import BrokerUnavailableError, ConfigError
from outboxer.message import HEADER_CONTENT_TYPE, HEADER_ID, HEADER_KEY, HEADER_TOPIC, Message
from outboxer.testing import Consumer, PublisherContract, Received, make_message

REAL_BOOTSTRAP = os.environ.get("OUTBOXER_KAFKA_BOOTSTRAP", "")

quiet = logging.getLogger("tests.kafka.quiet")
quiet.propagate = False
quiet.addHandler(logging.NullHandler())


class MockCluster:
    """A librdkafka mock cluster; it lives as long as the client that created it.

    A consumer group's first member is let in after the mock's
    group.initial.rebalance.delay.ms, 3 s by default, which every Kafka consumer test pays
    on each fresh group; the delay is set to 0 through librdkafka's mock API (not exposed
    by confluent_kafka, so called with ctypes), and stays 3 s where that is unavailable.
    """

    def __init__(self) -> None:
        self._owner: Producer | None = None
        self._handle: _MockHandle | None = _MockHandle.create()
        if self._handle is not None:
            self.bootstrap = self._handle.bootstrap
            return
        self._owner = Producer(
            {"bootstrap.servers": "mock", "test.mock.num.brokers": 1, "logger": quiet}
        )
        brokers = self._owner.list_topics(timeout=10).brokers.values()
        self.bootstrap = ",".join(f"{broker.host}:{broker.port}" for broker in brokers)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.destroy()
            self._handle = None
        if self._owner is not None:
            self._owner.close()
            self._owner = None


class _MockHandle:
    """A producer handle of the librdkafka confluent_kafka runs on, made through its C API,
    owning a one-broker mock cluster with no initial rebalance delay."""

    def __init__(self, lib: ctypes.CDLL, handle: int, bootstrap: str) -> None:
        self.lib, self.handle, self.bootstrap = lib, handle, bootstrap

    @classmethod
    def create(cls) -> _MockHandle | None:
        lib = _librdkafka()
        if lib is None or not hasattr(lib, "rd_kafka_mock_group_initial_rebalance_delay_ms"):
            return None
        lib.rd_kafka_conf_new.restype = ctypes.c_void_p
        lib.rd_kafka_conf_set.argtypes = [
            ctypes.c_void_p,
            ctypes.c_char_p,
            ctypes.c_char_p,
            ctypes.c_char_p,
            ctypes.c_size_t,
        ]
        lib.rd_kafka_new.argtypes = [
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_char_p,
            ctypes.c_size_t,
        ]
        lib.rd_kafka_new.restype = ctypes.c_void_p
        lib.rd_kafka_handle_mock_cluster.argtypes = [ctypes.c_void_p]
        lib.rd_kafka_handle_mock_cluster.restype = ctypes.c_void_p
        lib.rd_kafka_mock_cluster_bootstraps.argtypes = [ctypes.c_void_p]
        lib.rd_kafka_mock_cluster_bootstraps.restype = ctypes.c_char_p
        lib.rd_kafka_mock_group_initial_rebalance_delay_ms.argtypes = [
            ctypes.c_void_p,
            ctypes.c_int32,
        ]
        lib.rd_kafka_destroy.argtypes = [ctypes.c_void_p]
        conf = lib.rd_kafka_conf_new()
        error = ctypes.create_string_buffer(512)
        # log_level 0: the mock's own log lines would go to stderr (no Python logger here).
        for name, value in ((b"test.mock.num.brokers", b"1"), (b"log_level", b"0")):
            assert lib.rd_kafka_conf_set(conf, name, value, error, len(error)) == 0, error.value
        handle = lib.rd_kafka_new(0, conf, error, len(error))  # 0: RD_KAFKA_PRODUCER
        assert handle, error.value
        cluster = lib.rd_kafka_handle_mock_cluster(handle)
        assert cluster, "test.mock.num.brokers made no mock cluster"
        lib.rd_kafka_mock_group_initial_rebalance_delay_ms(cluster, 0)
        return cls(lib, handle, lib.rd_kafka_mock_cluster_bootstraps(cluster).decode())

    def destroy(self) -> None:
        self.lib.rd_kafka_destroy(self.handle)


def _librdkafka() -> ctypes.CDLL | None:
    """The librdkafka confluent_kafka loaded: its wheel's copy, else the system's."""
    import confluent_kafka

    bundled = sorted(
        (Path(confluent_kafka.__file__).parent.parent / "confluent_kafka.libs").glob(
            "librdkafka*.so*"
        )
    )
    path = str(bundled[0]) if bundled else ctypes.util.find_library("rdkafka")
    if path is None:
        return None
    try:
        return ctypes.CDLL(path)
    except OSError:
        return None


@pytest.fixture(scope="module")
def mock_cluster() -> Iterator[MockCluster]:
    cluster = MockCluster()
    yield cluster
    cluster.stop()


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def received(message: KafkaMessage) -> Received:
    headers = {name: (value or b"").decode() for name, value in message.headers() or []}
    key = message.key()
    return Received(
        id=headers.get(HEADER_ID, ""),
        topic=headers.get(HEADER_TOPIC, ""),
        key=key.decode() if key is not None else None,
        headers=headers,
        payload=message.value() or b"",
    )


class TopicConsumer(Consumer):
    """Reads every partition of one topic from the beginning (no group rebalance to wait for)."""

    def __init__(self, bootstrap: str, topic: str, partitions: list[int]) -> None:
        self.raw: list[KafkaMessage] = []
        self._consumer = KafkaConsumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": f"test-{uuid.uuid4().hex}",
                "enable.auto.commit": False,
                "logger": quiet,
            }
        )
        self._consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])

    async def receive(self, count: int, timeout: float = 10.0) -> list[Received]:
        deadline = time.monotonic() + timeout
        got: list[Received] = []
        while len(got) < count and (left := deadline - time.monotonic()) > 0:
            batch = await asyncio.to_thread(
                self._consumer.consume, count - len(got), min(left, 0.5)
            )
            for message in batch:
                if message.error() is None:
                    self.raw.append(message)
                    got.append(received(message))
        return got

    async def close(self) -> None:
        await asyncio.to_thread(self._consumer.close)


class KafkaContract(PublisherContract):
    bootstrap: str

    def make_publisher(self, **options: object) -> KafkaPublisher:
        return KafkaPublisher(f"kafka://{self.bootstrap}", **options)  # type: ignore[arg-type]

    def make_unreachable_publisher(self) -> KafkaPublisher:
        return KafkaPublisher(f"kafka://127.0.0.1:{closed_port()}?connect_timeout=2")

    def fresh_topic(self) -> str:
        return f"contract-{uuid.uuid4().hex[:12]}"

    async def start_consumer(self, topic: str) -> TopicConsumer:
        partitions = await asyncio.to_thread(self._create_topic, topic)
        return TopicConsumer(self.bootstrap, topic, partitions)

    def _create_topic(self, topic: str) -> list[int]:
        """Create ``topic``: a metadata request does on the mock cluster (and on brokers with
        auto.create.topics.enable); otherwise ask the controller."""
        admin = AdminClient({"bootstrap.servers": self.bootstrap, "logger": quiet})
        created = False
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            metadata = admin.list_topics(topic=topic, timeout=10).topics[topic]
            if metadata.error is None and metadata.partitions:
                return sorted(metadata.partitions)
            if not created:
                for future in admin.create_topics([NewTopic(topic, num_partitions=4)]).values():
                    with contextlib.suppress(KafkaException):  # e.g. TOPIC_ALREADY_EXISTS
                        future.result(10)
                created = True
            time.sleep(0.1)
        raise AssertionError(f"topic {topic} did not appear")

    def rejected_message(self, topic: str) -> Message:
        # Bigger than message.max.bytes (1,000,000 by default): refused for good.
        return make_message(topic, b"x" * 1_100_000)

    async def restart_server(self) -> None:
        pytest.skip(
            "a Kafka cluster cannot be restarted from a test (the mock cluster gets a new port, "
            "and a TCP proxy is bypassed because brokers advertise their own address); "
            "test_broker_gone_is_a_retryable_connection_error covers the outage"
        )


class TestKafkaMockCluster(KafkaContract):
    @pytest.fixture(autouse=True)
    def _cluster(self, mock_cluster: MockCluster) -> None:
        self.bootstrap = mock_cluster.bootstrap

    async def test_key_and_envelope_headers_are_native(self) -> None:
        topic = self.fresh_topic()
        consumer = await self.start_consumer(topic)
        message = make_message(topic, {"a": 1}, key="order-7", headers={"trace": "t-1"})
        async with self.make_publisher() as publisher:
            [outcome] = await publisher.publish_batch([message])
        assert outcome.published, outcome
        [got] = await consumer.receive(1, self.receive_timeout)
        await consumer.close()
        raw = consumer.raw[0]
        assert raw.key() == b"order-7"
        assert raw.topic() == topic
        assert got.headers[HEADER_ID] == str(message.id)
        assert got.headers[HEADER_TOPIC] == topic
        assert got.headers[HEADER_KEY] == "order-7"
        assert got.headers[HEADER_CONTENT_TYPE] == "application/json"
        assert got.headers["trace"] == "t-1"

    async def test_routes_name_the_kafka_topic(self) -> None:
        kafka_topic = self.fresh_topic()
        consumer = await self.start_consumer(kafka_topic)
        message = make_message("orders.created", {"a": 1}, key="k")
        async with self.make_publisher(routes={"orders.created": kafka_topic}) as publisher:
            [outcome] = await publisher.publish_batch([message])
        assert outcome.published, outcome
        [got] = await consumer.receive(1, self.receive_timeout)
        await consumer.close()
        assert got.id == str(message.id)
        assert got.topic == "orders.created"

    async def test_a_large_batch_is_in_flight_at_once_and_keeps_key_order(self) -> None:
        topic = self.fresh_topic()
        consumer = await self.start_consumer(topic)
        batch = [
            make_message(topic, {"k": k, "n": n}, key=f"k{k}")
            for n in range(10)
            for k in range(200)
        ]
        async with self.make_publisher(config={"linger.ms": 20}) as publisher:
            started = time.monotonic()
            outcomes = await publisher.publish_batch(batch)
            elapsed = time.monotonic() - started
        assert all(o.published for o in outcomes)
        # 10 waves of 200: one confirm at a time would need 2,000 round trips of >= 20 ms.
        assert elapsed < 20, elapsed
        got = await consumer.receive(len(batch), self.receive_timeout)
        await consumer.close()
        assert len(got) == len(batch)
        seen: dict[str | None, list[int]] = {}
        for item in got:
            seen.setdefault(item.key, []).append(int(item.payload.split(b'"n":')[1].rstrip(b"}")))
        assert all(numbers == sorted(numbers) for numbers in seen.values())

    async def test_broker_gone_is_a_retryable_connection_error(self) -> None:
        cluster = MockCluster()  # a cluster of its own, to take away
        publisher = KafkaPublisher(
            f"kafka://{cluster.bootstrap}?connect_timeout=2", config={"message.timeout.ms": 1500}
        )
        await publisher.connect()
        [first] = await publisher.publish_batch([make_message("gone", key="k")])
        assert first.published, first
        cluster.stop()
        outcomes = await publisher.publish_batch(
            [make_message("gone", key="k"), make_message("gone")]
        )
        assert [o.kind for o in outcomes] == [OutcomeKind.FAILED] * 2, outcomes
        assert all(o.retryable for o in outcomes)
        assert not publisher.connected  # the relay reconnects before going on
        with pytest.raises(BrokerUnavailableError):  # a fresh metadata request, not the cache
            await publisher.connect()
        await publisher.close()

    async def test_close_without_connect_and_twice(self) -> None:
        publisher = self.make_publisher()
        await publisher.close()
        await publisher.connect()
        await publisher.close()
        await publisher.close()

    async def test_reconnect_keeps_a_healthy_producer(self) -> None:
        topic = self.fresh_topic()
        async with self.make_publisher() as publisher:
            producer = publisher._producer
            publisher._connected = False  # as after a transient connection error
            await publisher.connect()
            assert publisher._producer is producer
            [outcome] = await publisher.publish_batch([make_message(topic)])
            assert outcome.published


@pytest.mark.skipif(
    not REAL_BOOTSTRAP,
    reason="set OUTBOXER_KAFKA_BOOTSTRAP=host:port to run against a real Kafka broker",
)
class TestKafkaRealBroker(KafkaContract):
    @pytest.fixture(autouse=True)
    def _cluster(self) -> None:
        self.bootstrap = REAL_BOOTSTRAP


# ----- configuration and error mapping (no broker needed) ---------------------------------


def test_url_options_go_to_librdkafka_and_keywords_win() -> None:
    publisher = KafkaPublisher(
        "kafka://h1:9092,h2:9092?linger.ms=5&compression.type=lz4&connect_timeout=3",
        config={"linger.ms": 50},
        publish_timeout=12,
    )
    assert publisher.config["bootstrap.servers"] == "h1:9092,h2:9092"
    assert publisher.config["linger.ms"] == 50
    assert publisher.config["compression.type"] == "lz4"
    assert publisher.config["acks"] == "all"
    assert publisher.config["enable.idempotence"] == "true"
    assert publisher.config["message.timeout.ms"] == 12_000
    assert "connect_timeout" not in publisher.config
    assert publisher.connect_timeout == 3
    assert KafkaPublisher("kafka://h:1?connect_timeout=3", connect_timeout=7).connect_timeout == 7


def test_credentials_in_the_url_are_sasl_and_hidden() -> None:
    publisher = KafkaPublisher(
        "kafka://app:s%3Acret@h1:9092,h2:9092?security.protocol=SASL_PLAINTEXT"
        "&sasl.mechanism=PLAIN&ssl.key.password=pw"
    )
    assert publisher.config["sasl.username"] == "app"
    assert publisher.config["sasl.password"] == "s:cret"
    assert "cret" not in publisher.safe_url and "pw" not in publisher.safe_url.split("?")[1]
    assert publisher.safe_url.startswith("kafka://app:***@h1:9092,h2:9092?")


@pytest.mark.parametrize(
    ("url", "config", "match"),
    [
        ("kafka://h:9092?acks=1", None, "acks"),
        ("kafka://h:9092", {"enable.idempotence": False}, "enable.idempotence"),
        ("kafka://h:9092?no.such.property=1", None, "no.such.property"),
        ("kafka://h:9092?linger.ms=soon", None, "linger.ms|queue.buffering.max.ms"),
        ("kafka://h:9092?connect_timeout=0", None, "connect_timeout"),
        ("kafka://h:9092?connect_timeout=x", None, "connect_timeout"),
        ("kafka:///just-a-path", None, "bootstrap"),
    ],
)
def test_invalid_configuration_is_a_config_error(
    url: str, config: dict[str, object] | None, match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        KafkaPublisher(url, config=config)


def test_acks_minus_one_means_all() -> None:
    assert KafkaPublisher("kafka://h:9092?acks=-1").config["acks"] == "all"


def test_registry_builds_a_kafka_publisher() -> None:
    assert isinstance(create_publisher("kafka://h:9092"), KafkaPublisher)


@pytest.mark.parametrize(
    ("code", "retryable", "connection"),
    [
        (KafkaError.MSG_SIZE_TOO_LARGE, False, False),
        (KafkaError.TOPIC_AUTHORIZATION_FAILED, False, False),
        (KafkaError.INVALID_RECORD, False, False),
        (KafkaError._MSG_TIMED_OUT, True, True),
        (KafkaError._TRANSPORT, True, True),
        (KafkaError._ALL_BROKERS_DOWN, True, True),
        (KafkaError.NOT_LEADER_FOR_PARTITION, True, False),
        (KafkaError.NOT_ENOUGH_REPLICAS, True, False),
        (KafkaError.UNKNOWN_TOPIC_OR_PART, True, False),
    ],
)
def test_error_mapping(code: int, retryable: bool, connection: bool) -> None:
    error = KafkaPublishError(KafkaError(code))
    publisher = KafkaPublisher("kafka://h:9092")
    assert publisher.is_retryable(error) is retryable
    assert publisher.is_connection_error(error) is connection


def test_a_fatal_error_rebuilds_the_producer() -> None:
    error = KafkaPublishError(KafkaError(KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER, fatal=True))
    assert error.retryable and error.connection
