"""KafkaReceiver edges on librdkafka's mock cluster: a member with no partition going idle, the
consumer of a connect that timed out, and a reset that moves a partition's position back."""

from __future__ import annotations

import asyncio
import os
import socket
import time
import uuid
from typing import Any

import pytest

from outboxer.brokers.kafka import KafkaPublisher
from outboxer.errors import BrokerUnavailableError
from outboxer.receivers import create_receiver
from outboxer.receivers.base import Incoming
from outboxer.testing import make_message
from tests.integration.test_kafka_audit_receiver import (
    MockCluster,
    collect,
    committed,
    make_receiver,
    one_partition_topic,
    push_errors,
)


def librdkafka_handles() -> int:
    """Live librdkafka client handles of this process: each has one ``rdk:main`` thread."""
    count = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                count += comm.read().strip() == "rdk:main"
        except OSError:  # the thread ended meanwhile
            pass
    return count


async def test_a_member_left_without_a_partition_goes_idle(cluster: MockCluster) -> None:
    """Two members, one partition: the group gives the second member nothing. idle() waited
    for a partition, so with exit_when_idle that consumer never exited."""
    topic = one_partition_topic(cluster)
    group = f"g-{uuid.uuid4().hex[:8]}"
    a = make_receiver(cluster.bootstrap, group, topic)
    b = make_receiver(cluster.bootstrap, group, topic)
    await a.connect()
    await b.connect()
    try:
        deadline = time.monotonic() + 8
        while not (a.idle() and b.idle()) and time.monotonic() < deadline:
            await a.receive(10, 0.05)
            await b.receive(10, 0.05)
        owners = [r for r in (a, b) if r._partitions]  # type: ignore[attr-defined]
        assert len(owners) == 1, "one member owns the partition, the other none"
        assert a.idle() and b.idle()
    finally:
        await b.close()
        await a.close()


async def test_a_connect_that_times_out_closes_its_consumer() -> None:
    """connect_timeout ended the connect while the first metadata request still waited (its
    timeout is the same one): the consumer was never closed, only dropped, so while anything
    held the failed attempt (the error kept, a logged traceback) its librdkafka handle, with
    its threads and sockets, stayed, one more per failed connect."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]  # closed again: nothing listens there
    receiver = create_receiver(
        f"kafka://127.0.0.1:{port}", group="g", topics=["t"], connect_timeout=0.2
    )
    before = librdkafka_handles()
    errors: list[BaseException] = []  # kept, as a log handler or an error report may
    for _ in range(4):
        with pytest.raises(BrokerUnavailableError) as failed:
            await receiver.connect()
        errors.append(failed.value)
    deadline = time.monotonic() + 3
    while librdkafka_handles() > before and time.monotonic() < deadline:
        await asyncio.sleep(0.05)  # the last probe's request ends just after the connect
    assert librdkafka_handles() <= before, f"{librdkafka_handles() - before} consumer(s) left"
    assert len(errors) == 4


OFFSET_OUT_OF_RANGE = 1  # Kafka error code
FETCH = 1  # Kafka API key


async def test_a_reset_back_neither_records_offsets_twice_nor_commits_backwards(
    cluster: MockCluster,
) -> None:
    """A fetch answered OFFSET_OUT_OF_RANGE: auto.offset.reset=earliest read the partition
    again from 0 while it stayed assigned. The copies' offsets went into the same series as
    the first reads: their acks committed 1, 2... after 5 had been committed, moving the
    group back (a restart re-read and re-applied what was done)."""
    topic = one_partition_topic(cluster)
    batch = [make_message(topic, {"n": n}, key=f"k{n}") for n in range(5)]
    later = make_message(topic, {"n": 5}, key="k5")
    async with KafkaPublisher(f"kafka://{cluster.bootstrap}") as publisher:
        assert all(o.published for o in await publisher.publish_batch(batch))
    group = f"g-{uuid.uuid4().hex[:8]}"
    receiver = make_receiver(cluster.bootstrap, group, topic)
    commits: list[int] = []
    original = receiver._commit  # type: ignore[attr-defined]

    def recording(consumer: Any) -> None:  # the polling thread's commits, in order
        with receiver._lock:  # type: ignore[attr-defined]
            commits.extend(receiver._to_commit.values())  # type: ignore[attr-defined]
        original(consumer)

    receiver._commit = recording  # type: ignore[attr-defined]
    await receiver.connect()
    try:
        first = await collect(receiver, 5)
        assert [i.delivery.id for i in first] == [m.id for m in batch]
        await receiver.ack(first)
        deadline = time.monotonic() + 5
        while 5 not in commits and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        push_errors(cluster, FETCH, OFFSET_OUT_OF_RANGE)
        again = await collect(receiver, 5, timeout=8)
        assert [i.delivery.id for i in again] == [m.id for m in batch], "read again from 0"
        await receiver.ack(again[:2])
        async with KafkaPublisher(f"kafka://{cluster.bootstrap}") as publisher:
            assert all(o.published for o in await publisher.publish_batch([later]))
        rest: list[Incoming] = await collect(receiver, 1)
        assert [i.delivery.id for i in rest] == [later.id]
        await receiver.ack(again[2:] + rest)
        deadline = time.monotonic() + 5
        while 6 not in commits and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
    finally:
        await receiver.close()
    assert commits == sorted(commits), f"the committed offset went back: {commits}"
    assert commits[-1] == 6
    assert await asyncio.to_thread(committed, cluster.bootstrap, group, topic) == 6
