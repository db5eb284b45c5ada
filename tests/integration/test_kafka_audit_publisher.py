"""KafkaPublisher audit, on librdkafka's mock cluster with errors injected through its C API
(``rd_kafka_mock_push_request_errors_array``: the next requests of an API get these errors)."""

from __future__ import annotations

import ctypes
import uuid
from collections.abc import Iterator

import pytest

from outboxer.brokers.base import OutcomeKind
from outboxer.brokers.kafka import KafkaPublisher
from outboxer.errors import ConfigError
from outboxer.testing import make_message
from tests.integration.test_broker_kafka import MockCluster, TopicConsumer

PRODUCE = 0  # Kafka API key
MSG_SIZE_TOO_LARGE = 10
INVALID_RECORD = 87


class Mock:
    """The mock cluster's C handle: create topics and inject broker errors."""

    def __init__(self, cluster: MockCluster) -> None:
        handle = cluster._handle
        if handle is None:
            pytest.skip("this librdkafka exposes no mock cluster API")
        self.lib = lib = handle.lib
        lib.rd_kafka_handle_mock_cluster.argtypes = [ctypes.c_void_p]
        lib.rd_kafka_handle_mock_cluster.restype = ctypes.c_void_p
        lib.rd_kafka_mock_topic_create.argtypes = [
            ctypes.c_void_p,
            ctypes.c_char_p,
            ctypes.c_int,
            ctypes.c_int,
        ]
        lib.rd_kafka_mock_push_request_errors_array.argtypes = [
            ctypes.c_void_p,
            ctypes.c_int16,
            ctypes.c_size_t,
            ctypes.POINTER(ctypes.c_int),
        ]
        lib.rd_kafka_mock_clear_request_errors.argtypes = [ctypes.c_void_p, ctypes.c_int16]
        self.cluster = lib.rd_kafka_handle_mock_cluster(handle.handle)
        self.bootstrap = cluster.bootstrap

    def topic(self, partitions: int = 1) -> str:
        name = f"audit-{uuid.uuid4().hex[:10]}"
        assert self.lib.rd_kafka_mock_topic_create(self.cluster, name.encode(), partitions, 1) == 0
        return name

    def push_errors(self, api: int, *codes: int) -> None:
        """The next ``len(codes)`` requests of ``api`` get these error codes (0: served)."""
        array = (ctypes.c_int * len(codes))(*codes)
        self.lib.rd_kafka_mock_push_request_errors_array(self.cluster, api, len(codes), array)

    def clear(self, api: int) -> None:
        self.lib.rd_kafka_mock_clear_request_errors(self.cluster, api)


@pytest.fixture
def mock() -> Iterator[Mock]:
    cluster = MockCluster()  # a cluster per test: injected errors must not leak
    try:
        yield Mock(cluster)
    finally:
        cluster.stop()


async def test_a_batch_refused_for_size_does_not_abandon_the_messages_that_fit(mock: Mock) -> None:
    """The broker refuses a whole record batch for one record's fault (MESSAGE_TOO_LARGE above
    the topic's max.message.bytes, INVALID_RECORD for a keyless record on a compacted topic),
    and librdkafka reports that error for every message the batch held. Those reports were
    final: messages of other keys that happened to share the batch were abandoned as poison."""
    topic = mock.topic()
    batch = [make_message(topic, {"n": n}, key=f"k{n}") for n in range(5)]
    async with KafkaPublisher(f"kafka://{mock.bootstrap}", config={"linger.ms": 50}) as publisher:
        mock.push_errors(PRODUCE, MSG_SIZE_TOO_LARGE)  # the wave's one batch
        outcomes = await publisher.publish_batch(batch)
    assert [o.kind for o in outcomes] == [OutcomeKind.PUBLISHED] * 5, outcomes
    consumer = TopicConsumer(mock.bootstrap, topic, [0])
    got = await consumer.receive(5)
    await consumer.close()
    assert sorted(g.id for g in got) == sorted(str(m.id) for m in batch)


async def test_only_the_record_at_fault_is_abandoned(mock: Mock) -> None:
    """Sent alone, each message gets its own verdict: only the one refused alone fails for good."""
    topic = mock.topic()
    batch = [make_message(topic, {"n": n}, key=f"k{n}") for n in range(4)]
    async with KafkaPublisher(f"kafka://{mock.bootstrap}", config={"linger.ms": 50}) as publisher:
        # The batch, then each message alone in order: the third is refused again.
        mock.push_errors(PRODUCE, INVALID_RECORD, 0, 0, INVALID_RECORD, 0)
        outcomes = await publisher.publish_batch(batch)
        mock.clear(PRODUCE)
    kinds = [o.kind for o in outcomes]
    assert kinds == [
        OutcomeKind.PUBLISHED,
        OutcomeKind.PUBLISHED,
        OutcomeKind.FAILED,
        OutcomeKind.PUBLISHED,
    ], outcomes
    assert not outcomes[2].retryable
    assert "INVALID_RECORD" in (outcomes[2].error or "")


async def test_a_fatal_producer_error_builds_a_new_producer_on_reconnect(mock: Mock) -> None:
    """With enable.gapless.guarantee a sequence gap is fatal: confluent-kafka raises it out of
    poll() (error_cb never sees it), so it went unrecorded; every later wave failed with
    _FATAL, counted as an attempt, and each reconnect kept the dead producer: the relay
    published nothing more and used up its messages' attempts."""
    OUT_OF_ORDER_SEQUENCE_NUMBER = 45
    topic = mock.topic()
    first, second, third = (make_message(topic, {"n": n}, key="k") for n in range(3))
    publisher = KafkaPublisher(
        f"kafka://{mock.bootstrap}", config={"enable.gapless.guarantee": True}
    )
    await publisher.connect()
    try:
        [one] = await publisher.publish_batch([first])
        assert one.published, one
        old = publisher._producer
        mock.push_errors(PRODUCE, OUT_OF_ORDER_SEQUENCE_NUMBER)
        [two] = await publisher.publish_batch([second])
        assert two.kind is OutcomeKind.FAILED and two.retryable, two
        assert not publisher.connected, "a fatal error must make the relay reconnect"
        await publisher.connect()
        assert publisher._producer is not old
        [two_again, three] = await publisher.publish_batch([second, third])
        assert two_again.published and three.published, (two_again, three)
    finally:
        await publisher.close()
    consumer = TopicConsumer(mock.bootstrap, topic, [0])
    got = await consumer.receive(3)
    await consumer.close()
    assert [g.id for g in got] == [str(m.id) for m in (first, second, third)]


async def test_a_wave_on_a_fatal_producer_is_not_sent_and_counts_no_attempt(mock: Mock) -> None:
    topic = mock.topic()
    publisher = KafkaPublisher(
        f"kafka://{mock.bootstrap}", config={"enable.gapless.guarantee": True}
    )
    await publisher.connect()
    try:
        [one] = await publisher.publish_batch([make_message(topic, key="k")])
        assert one.published, one
        mock.push_errors(PRODUCE, 45)
        [two] = await publisher.publish_batch([make_message(topic, key="k")])
        assert two.kind is OutcomeKind.FAILED
        publisher._connected = True  # another loop's batch, sent before the reconnect
        outcomes = await publisher.publish_batch(
            [make_message(topic, key=f"k{n}") for n in range(3)]
        )
        assert [o.kind for o in outcomes] == [OutcomeKind.FAILED] * 3, outcomes
        assert not any(o.attempted for o in outcomes), outcomes
        assert not publisher.connected
    finally:
        await publisher.close()


@pytest.mark.parametrize(
    ("url", "config"),
    [
        ("kafka://h:9092?transactional.id=relay-1", None),
        ("kafka://h:9092", {"transactional.id": "r"}),
    ],
)
def test_a_transactional_id_is_a_config_error(url: str, config: dict[str, object] | None) -> None:
    """A transactional producer refuses every produce() outside a transaction (_STATE, which
    is retryable): the relay accepted the option and then failed every message until its
    attempts ran out."""
    with pytest.raises(ConfigError, match=r"transactional\.id"):
        KafkaPublisher(url, config=config)


async def test_a_topic_name_kafka_refuses_fails_that_message_for_good_not_the_connection(
    mock: Mock,
) -> None:
    """A name Kafka refuses (illegal characters, over 249 characters): permanent for that
    message only; the other topic's message of the wave is published and the publisher stays
    connected. Refused before librdkafka sees it: asked, the cluster answers
    TOPIC_EXCEPTION (permanent), but on a busy box librdkafka's metadata cache answered
    first, "Local: Unknown topic", retryable: the message used up its attempts."""
    bad = "orders created!"
    good = mock.topic()
    async with KafkaPublisher(f"kafka://{mock.bootstrap}", publish_timeout=10) as publisher:
        refused, published = await publisher.publish_batch(
            [make_message(bad, key="a"), make_message(good, key="b")]
        )
        too_long = await publisher.publish_batch([make_message("t" * 250, key="c")])
        assert publisher.connected
    assert refused.kind is OutcomeKind.FAILED and not refused.retryable, refused
    assert "not a Kafka topic name" in (refused.error or "")
    assert published.published, published
    assert not too_long[0].retryable and "not a Kafka topic name" in (too_long[0].error or "")


async def test_librdkafka_retries_keep_key_order_and_add_no_duplicates(mock: Mock) -> None:
    """Produce requests refused retryably (leader moved, not enough replicas, request timed
    out) are retried by librdkafka itself with five requests in flight: with the idempotent
    producer every record lands once, and each key's records in publish order."""
    NOT_LEADER, REQUEST_TIMED_OUT, NOT_ENOUGH_REPLICAS = 6, 7, 19
    topic = mock.topic(partitions=4)
    batch = [
        make_message(topic, {"k": k, "n": n}, key=f"k{k}") for n in range(8) for k in range(50)
    ]
    async with KafkaPublisher(
        f"kafka://{mock.bootstrap}",
        config={"linger.ms": 5, "max.in.flight.requests.per.connection": 5, "retry.backoff.ms": 10},
    ) as publisher:
        mock.push_errors(
            PRODUCE, NOT_LEADER, 0, REQUEST_TIMED_OUT, NOT_ENOUGH_REPLICAS, 0, NOT_LEADER, 0, 0
        )
        outcomes = await publisher.publish_batch(batch)
    assert all(o.published for o in outcomes), [o for o in outcomes if not o.published][:3]
    consumer = TopicConsumer(mock.bootstrap, topic, [0, 1, 2, 3])
    got = await consumer.receive(len(batch) + 1, timeout=3)  # one more: a duplicate would show
    await consumer.close()
    assert sorted(g.id for g in got) == sorted(str(m.id) for m in batch)
    order = {str(m.id): (m.key, i) for i, m in enumerate(batch)}
    by_key: dict[str | None, list[int]] = {}
    for g in got:
        key, position = order[g.id]
        by_key.setdefault(key, []).append(position)
    assert all(positions == sorted(positions) for positions in by_key.values())
