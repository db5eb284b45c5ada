"""KafkaReceiver audit: hostile records at the boundary and offsets, on librdkafka's mock cluster.

Records no outboxer publisher would write (a header name that is not UTF-8) are produced
through librdkafka's C API (``rd_kafka_produceva``) on the mock cluster's own handle: the
Python client refuses to send them, a foreign producer does not.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import sys
import time
import uuid

import pytest
from confluent_kafka import Consumer, TopicPartition

from outboxer.brokers.kafka import KafkaPublisher
from outboxer.errors import ConfigError
from outboxer.receivers import create_receiver
from outboxer.receivers.base import Incoming, Receiver
from outboxer.testing import make_message
from tests.integration.test_broker_kafka import MockCluster, quiet


class _Mem(ctypes.Structure):
    _fields_ = [("ptr", ctypes.c_void_p), ("size", ctypes.c_size_t)]


class _Header(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("val", ctypes.c_void_p), ("size", ctypes.c_ssize_t)]


class _Value(ctypes.Union):
    _fields_ = [
        ("cstr", ctypes.c_char_p),
        ("mem", _Mem),
        ("header", _Header),
        ("_pad", ctypes.c_char * 64),  # rd_kafka_vu_t's union is padded to 64 bytes
    ]


class _VU(ctypes.Structure):
    _fields_ = [("vtype", ctypes.c_int), ("u", _Value)]


# rd_kafka_vtype_t
_END, _TOPIC, _VALUE, _HEADER = 0, 1, 4, 9


def produce_raw(
    cluster: MockCluster, topic: str, value: bytes, headers: list[tuple[bytes, bytes]]
) -> None:
    """Produce one record with arbitrary header bytes through the mock cluster's own handle."""
    handle = cluster._handle
    assert handle is not None, "this librdkafka has no mock API"
    lib = handle.lib
    lib.rd_kafka_produceva.argtypes = [ctypes.c_void_p, ctypes.POINTER(_VU), ctypes.c_size_t]
    lib.rd_kafka_produceva.restype = ctypes.c_void_p
    lib.rd_kafka_flush.argtypes = [ctypes.c_void_p, ctypes.c_int]
    keep = [ctypes.create_string_buffer(value, len(value))]  # alive until flushed
    args = (_VU * (3 + len(headers)))()
    args[0].vtype, args[0].u.cstr = _TOPIC, topic.encode()
    args[1].vtype = _VALUE
    args[1].u.mem = _Mem(ctypes.cast(keep[0], ctypes.c_void_p), len(value))
    for index, (name, data) in enumerate(headers, start=2):
        keep.append(ctypes.create_string_buffer(data, len(data)))
        args[index].vtype = _HEADER
        args[index].u.header = _Header(name, ctypes.cast(keep[-1], ctypes.c_void_p), len(data))
    args[len(args) - 1].vtype = _END
    assert lib.rd_kafka_produceva(handle.handle, args, len(args) - 1) is None
    assert lib.rd_kafka_flush(handle.handle, 10_000) == 0


def one_partition_topic(cluster: MockCluster, partitions: int = 1, prefix: str = "audit") -> str:
    """A new topic of ``partitions`` partitions on the mock cluster (its name)."""
    handle = cluster._handle
    assert handle is not None
    lib = handle.lib
    lib.rd_kafka_handle_mock_cluster.argtypes = [ctypes.c_void_p]
    lib.rd_kafka_handle_mock_cluster.restype = ctypes.c_void_p
    lib.rd_kafka_mock_topic_create.argtypes = [
        ctypes.c_void_p,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_int,
    ]
    topic = f"{prefix}-{uuid.uuid4().hex[:10]}"
    mock = lib.rd_kafka_handle_mock_cluster(handle.handle)
    assert lib.rd_kafka_mock_topic_create(mock, topic.encode(), partitions, 1) == 0
    return topic


def make_receiver(bootstrap: str, group: str, topic: str) -> Receiver:
    url = f"kafka://{bootstrap}?session.timeout.ms=2000&heartbeat.interval.ms=400"
    return create_receiver(url, group=group, topics=[topic])


async def collect(receiver: Receiver, count: int, timeout: float = 30.0) -> list[Incoming]:
    got: list[Incoming] = []
    deadline = time.monotonic() + timeout
    while len(got) < count and time.monotonic() < deadline:
        got.extend(await receiver.receive(count - len(got), 1.0))
    return got


def committed(bootstrap: str, group: str, topic: str) -> int:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "logger": quiet})
    try:
        [tp] = consumer.committed([TopicPartition(topic, 0)], timeout=10)
        return int(tp.offset)
    finally:
        consumer.close()


#: Runs a receiver over the topic in a process of its own: on the old code the record could
#: crash the interpreter (a segmentation fault), which must not take the test run with it.
CHILD = """
import asyncio, json, sys, time
from outboxer.receivers import create_receiver

async def main(bootstrap, group, topic, count):
    url = f"kafka://{bootstrap}?session.timeout.ms=2000&heartbeat.interval.ms=400"
    receiver = create_receiver(url, group=group, topics=[topic])
    await receiver.connect()
    got, lost = [], None
    try:
        deadline = time.monotonic() + 30
        while len(got) < count and time.monotonic() < deadline:
            got.extend(await receiver.receive(count - len(got), 1.0))
        await receiver.ack(got)
    except Exception as exc:
        lost = repr(exc)
    finally:
        await receiver.close()
    print(json.dumps({
        "lost": lost,
        "connects": receiver.stats.connects,
        "ids": [str(i.delivery.id) for i in got],
        "malformed": [i.malformed for i in got],
        "bodies": [i.delivery.body.decode("latin-1") for i in got],
    }))

asyncio.run(main(*sys.argv[1:4], int(sys.argv[4])))
"""


async def test_a_header_name_that_is_not_utf8_is_dead_lettered_not_a_crash(
    cluster: MockCluster,
) -> None:
    """For a header name that is not UTF-8, confluent-kafka's Message.headers() returns a list
    holding a NULL with an exception set. Called cold, that is a SystemError out of the
    polling thread: the receiver lost its "connection", and after the reconnect the same
    record came first again, for ever. Called from a warm (specialised) call site, nothing
    checks and reading the list is a segmentation fault: the consumer process dies, and
    after a restart dies again on the same record."""
    topic = one_partition_topic(cluster)
    warm = [make_message(topic, {"n": n}, key=f"k{n}") for n in range(20)]
    after = make_message(topic, {"n": 99}, key="k")
    async with KafkaPublisher(f"kafka://{cluster.bootstrap}") as publisher:
        outcomes = await publisher.publish_batch(warm)
        produce_raw(cluster, topic, b"foreign", [(b"\xff\xfe-name", b"x"), (b"ok", b"1")])
        outcomes += await publisher.publish_batch([after])
    assert all(o.published for o in outcomes), outcomes

    group = f"g-{uuid.uuid4().hex[:8]}"
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        CHILD,
        cluster.bootstrap,
        group,
        topic,
        str(len(warm) + 2),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await child.communicate()
    assert child.returncode == 0, (child.returncode, err.decode(errors="replace")[-2000:])
    report = json.loads(out.decode().strip().splitlines()[-1])
    assert report["lost"] is None and report["connects"] == 1, report
    assert report["ids"][: len(warm)] == [str(m.id) for m in warm]
    assert report["ids"][-1] == str(after.id)
    problem = report["malformed"][len(warm)]
    assert problem is not None and "header" in problem, report
    assert report["bodies"][len(warm)] == "foreign"
    assert report["malformed"][: len(warm)] == [None] * len(warm)
    # Dead-lettered and acknowledged like any unreadable record: the group moved past it.
    assert await asyncio.to_thread(committed, cluster.bootstrap, group, topic) == len(warm) + 2


class _Seen(logging.Handler):
    """Sets an event once a record whose message contains ``text`` is logged."""

    def __init__(self, text: str, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self.text, self.loop, self.event = text, loop, asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.loop.call_soon_threadsafe(self.event.set)


def push_errors(cluster: MockCluster, api: int, *codes: int) -> None:
    handle = cluster._handle
    assert handle is not None
    lib = handle.lib
    lib.rd_kafka_handle_mock_cluster.argtypes = [ctypes.c_void_p]
    lib.rd_kafka_handle_mock_cluster.restype = ctypes.c_void_p
    lib.rd_kafka_mock_push_request_errors_array.argtypes = [
        ctypes.c_void_p,
        ctypes.c_int16,
        ctypes.c_size_t,
        ctypes.POINTER(ctypes.c_int),
    ]
    mock = lib.rd_kafka_handle_mock_cluster(handle.handle)
    lib.rd_kafka_mock_push_request_errors_array(
        mock, api, len(codes), (ctypes.c_int * len(codes))(*codes)
    )


OFFSET_COMMIT = 8  # Kafka API key
REBALANCE_IN_PROGRESS = 27


async def test_a_refused_commit_is_tried_again_not_forgotten(cluster: MockCluster) -> None:
    """A commit the coordinator refuses for now (REBALANCE_IN_PROGRESS while the group
    rebalances and this member keeps its partitions) dropped the offsets: nothing committed
    them again, so applied messages were read again after every restart, for as long as no
    later ack moved the partition (beyond the inbox's memory, applied twice)."""
    topic = one_partition_topic(cluster)
    batch = [make_message(topic, {"n": n}, key="k") for n in range(3)]
    async with KafkaPublisher(f"kafka://{cluster.bootstrap}") as publisher:
        assert all(o.published for o in await publisher.publish_batch(batch))
    group = f"g-{uuid.uuid4().hex[:8]}"
    receiver = make_receiver(cluster.bootstrap, group, topic)
    seen = _Seen("failed", asyncio.get_running_loop())
    kafka_logger = logging.getLogger("outboxer.kafka")
    kafka_logger.addHandler(seen)
    level = kafka_logger.level
    kafka_logger.setLevel(logging.INFO)  # the failure is logged at INFO
    await receiver.connect()
    try:
        got = await collect(receiver, 3)
        assert [i.delivery.id for i in got] == [m.id for m in batch]
        push_errors(cluster, OFFSET_COMMIT, REBALANCE_IN_PROGRESS)
        await receiver.ack(got)
        await asyncio.wait_for(seen.event.wait(), 10)  # the polling thread's commit failed
    finally:
        kafka_logger.removeHandler(seen)
        kafka_logger.setLevel(level)
        await receiver.close()
    assert await asyncio.to_thread(committed, cluster.bootstrap, group, topic) == 3


async def test_offsets_commit_only_up_to_the_first_message_not_applied(
    cluster: MockCluster,
) -> None:
    """Lanes finish out of order: acks of offsets 0, 1, 3, 4 (not 2) commit offset 2 only, and
    the group's next member reads 2, 3, 4 again, never skipping the unapplied one."""
    topic = one_partition_topic(cluster)
    batch = [make_message(topic, {"n": n}, key=f"k{n}") for n in range(5)]
    async with KafkaPublisher(f"kafka://{cluster.bootstrap}") as publisher:
        assert all(o.published for o in await publisher.publish_batch(batch))
    group = f"g-{uuid.uuid4().hex[:8]}"
    receiver = make_receiver(cluster.bootstrap, group, topic)
    await receiver.connect()
    try:
        got = await collect(receiver, 5)
        assert sorted(str(i.delivery.id) for i in got) == sorted(str(m.id) for m in batch)
        by_id = {i.delivery.id: i for i in got}
        await receiver.ack([by_id[batch[n].id] for n in (4, 1, 3)])
        await receiver.ack([by_id[batch[0].id]])
    finally:
        await receiver.close()
    assert await asyncio.to_thread(committed, cluster.bootstrap, group, topic) == 2
    again = make_receiver(cluster.bootstrap, group, topic)
    await again.connect()
    try:
        redelivered = await collect(again, 3)
    finally:
        await again.close()
    assert sorted(str(i.delivery.id) for i in redelivered) == sorted(str(m.id) for m in batch[2:])


async def test_a_slow_runner_keeps_its_partitions_past_max_poll_interval(
    cluster: MockCluster,
) -> None:
    """The runner holds its messages longer than max.poll.interval.ms: the receiver's thread
    keeps polling (partitions paused), so the member is not evicted; nothing comes twice
    and nothing is skipped."""
    topic = one_partition_topic(cluster)
    batch = [make_message(topic, {"n": n}, key="k") for n in range(6)]
    async with KafkaPublisher(f"kafka://{cluster.bootstrap}") as publisher:
        assert all(o.published for o in await publisher.publish_batch(batch))
    group = f"g-{uuid.uuid4().hex[:8]}"
    url = (
        f"kafka://{cluster.bootstrap}?session.timeout.ms=2000&heartbeat.interval.ms=400"
        "&max.poll.interval.ms=2500"
    )
    receiver = create_receiver(url, group=group, topics=[topic], prefetch=2)
    await receiver.connect()
    seen: list[Incoming] = []
    try:
        seen += await collect(receiver, 2)
        await asyncio.sleep(4)  # the slow handler: longer than max.poll.interval.ms
        await receiver.ack(seen)
        while len(seen) < 6:
            more = await collect(receiver, 6 - len(seen), timeout=10)
            assert more, [str(i.delivery.id) for i in seen]
            await receiver.ack(more)
            seen += more
        assert receiver.connected and receiver.stats.connects == 1
        assert receiver.stats.stale_acks == 0
    finally:
        await receiver.close()
    assert [i.delivery.id for i in seen] == [m.id for m in batch]
    assert await asyncio.to_thread(committed, cluster.bootstrap, group, topic) == 6


def topic_of(cluster: MockCluster, partitions: int) -> str:
    handle = cluster._handle
    assert handle is not None
    lib = handle.lib
    topic = f"audit-{uuid.uuid4().hex[:10]}"
    mock = lib.rd_kafka_handle_mock_cluster(handle.handle)
    assert lib.rd_kafka_mock_topic_create(mock, topic.encode(), partitions, 1) == 0
    return topic


def committed_all(bootstrap: str, group: str, topic: str, partitions: int) -> list[int]:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "logger": quiet})
    try:
        wanted = [TopicPartition(topic, p) for p in range(partitions)]
        return [int(tp.offset) for tp in consumer.committed(wanted, timeout=10)]
    finally:
        consumer.close()


async def test_a_rebalance_commits_what_is_applied_and_drops_the_old_owners_later_acks(
    cluster: MockCluster,
) -> None:
    """Member A applied and committed offsets 0 and 1 of both partitions (not 2): when B
    joins, B's partition is read from 2. A's acks of the rest, after the rebalance, are for messages of
    an earlier assignment: they must commit nothing (committing them would move B's
    partition past messages B has not applied: lost if B then stops)."""
    one_partition_topic(cluster)  # sets the ctypes signatures
    topic = topic_of(cluster, 2)
    batch = [make_message(topic, {"n": n}, key=f"k{n}") for n in range(40)]
    async with KafkaPublisher(f"kafka://{cluster.bootstrap}") as publisher:
        assert all(o.published for o in await publisher.publish_batch(batch))
    group = f"g-{uuid.uuid4().hex[:8]}"
    a = make_receiver(cluster.bootstrap, group, topic)
    b = make_receiver(cluster.bootstrap, group, topic)
    await a.connect()
    try:
        got = await collect(a, 40)
        assert len(got) == 40
        offsets = {i: i.token[:2] for i in got}  # ((topic, partition), offset)
        assert {where[1] for where, _ in offsets.values()} == {0, 1}, "both partitions used"
        await a.ack([i for i in got if offsets[i][1] < 2])
        # Committed before B asks to join: the mock coordinator, stricter than Kafka's, refuses
        # commits (REBALANCE_IN_PROGRESS) during the whole rebalance, at revoke too.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            done = await asyncio.to_thread(committed_all, cluster.bootstrap, group, topic, 2)
            if done == [2, 2]:
                break
        assert done == [2, 2]
        await b.connect()
        try:
            from_b: list[Incoming] = []
            deadline = time.monotonic() + 30
            while not from_b and time.monotonic() < deadline:  # B's share, after the rebalance
                from_b = await b.receive(40, 1.0)
                await a.receive(40, 0.1)  # A keeps going (its redeliveries, unacked)
            assert from_b, "B never got a partition"
            b_partition = {i.token[0][1] for i in from_b}
            assert len(b_partition) == 1
            first = min(i.token[1] for i in from_b)
            assert first == 2, f"B starts at {first}: A's applied offsets 0, 1 must be committed"
            await a.ack([i for i in got if offsets[i][1] >= 2])  # an earlier assignment's
        finally:
            await b.close()  # B applied nothing
    finally:
        await a.close()
    assert await asyncio.to_thread(committed_all, cluster.bootstrap, group, topic, 2) == [2, 2]


@pytest.mark.parametrize("topic", ["orders created", "x" * 250, "a/b", "évènements", "t\n\x00"])
def test_a_topic_kafka_refuses_is_a_config_error(topic: str) -> None:
    """Kafka names a topic with 1 to 249 of a-z A-Z 0-9 . _ -: another name was subscribed to,
    and the member waited for ever on a topic that cannot exist, logging at INFO."""
    with pytest.raises(ConfigError, match="Kafka topic name") as caught:
        create_receiver("kafka://127.0.0.1:9092", group="g", topics=[topic])
    assert "\n" not in str(caught.value) and "\x00" not in str(caught.value)


async def test_a_pattern_librdkafka_refuses_is_a_config_error(cluster: MockCluster) -> None:
    """An invalid ^regex made every connect fail as if the broker were down: the consumer
    retried for ever instead of stopping with the configuration error."""
    receiver = create_receiver(f"kafka://{cluster.bootstrap}", group="g", topics=["^["])
    with pytest.raises(ConfigError, match="subscribe"):
        await receiver.connect()
    assert not receiver.connected
    assert receiver._consumer is None


async def test_json_nested_too_deep_is_dead_lettered_not_a_lost_connection(
    cluster: MockCluster,
) -> None:
    """json.loads raises RecursionError (not a ValueError) for an array nested 100,000 deep:
    out of the polling thread it read as a lost connection, and after the reconnect the same
    record came first again, for ever."""
    topic = one_partition_topic(cluster)
    record_id = str(uuid.uuid4())
    produce_raw(
        cluster,
        topic,
        b"[" * 100_000,
        [(b"outboxer-id", record_id.encode()), (b"content-type", b"application/json")],
    )
    after = make_message(topic, {"n": 1}, key="k")
    async with KafkaPublisher(f"kafka://{cluster.bootstrap}") as publisher:
        [outcome] = await publisher.publish_batch([after])
    assert outcome.published, outcome
    group = f"g-{uuid.uuid4().hex[:8]}"
    receiver = make_receiver(cluster.bootstrap, group, topic)
    await receiver.connect()
    try:
        got = await collect(receiver, 2)
        assert receiver.connected and receiver.stats.connects == 1
        assert len(got) == 2, got
        bad, good = got
        assert bad.malformed is not None and "nested too deep" in bad.malformed, bad.malformed
        assert bad.delivery.body == b"[" * 100_000
        assert good.malformed is None and good.delivery.id == after.id
        await receiver.ack(got)
    finally:
        await receiver.close()
    assert await asyncio.to_thread(committed, cluster.bootstrap, group, topic) == 2
