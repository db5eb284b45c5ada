"""Partition upkeep under the whole load at once, on one-second partitions: writers (one
message per transaction, many keys), two relays claiming and settling (some rows
abandoned once), an upkeep making partitions near now and dropping published ones every
round, and an operator requeuing and purging (by filter and by destination). Before the
upkeep attached near-now partitions under ACCESS EXCLUSIVE on the table, this load met
deadlocks (40P01 in a purge's, a requeue's or a claim's transaction) and writers that
waited a whole lock_timeout (1 s) behind the upkeep."""

from __future__ import annotations

import asyncio
import collections
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

import outboxer
from outboxer.admin import MessageFilter
from outboxer.stores import Failure
from outboxer.stores.pgpartitions import PartitionPolicy, PartitionReport
from outboxer.stores.postgres import PostgresStore
from tests.conftest import _admin_execute, _pg_url

WRITERS = 6
RELAYS = 2
WRITING = 6.0
#: One-second partitions, one ahead: every round attaches one near now (writers held back).
POLICY = PartitionPolicy(ahead=1, interval=1.0, published_retention=1.0, abandoned_retention=3600.0)
#: The longest a writer's commit may take: a lock_timeout (1 s) is a convoy.
MAX_COMMIT = 0.5


@pytest.fixture
def second_partitions_url() -> Iterator[str]:
    name = f"outboxer_t_{uuid.uuid4().hex[:12]}"
    _admin_execute(f"CREATE DATABASE {name}")
    url = _pg_url(name)

    async def apply() -> None:
        async with PostgresStore(url) as store:
            await store.apply_schema(partitioned=True, partition_interval=1.0, partitions_ahead=1)

    asyncio.run(apply())
    yield url
    _admin_execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


class Load:
    def __init__(self, url: str) -> None:
        self.url = url
        self.errors: list[str] = []
        self.lock = threading.Lock()
        self.committed: list[str] = []
        self.junk: list[str] = []
        self.slowest_commit = 0.0
        self.published: collections.Counter[str] = collections.Counter()
        self.failed_once: set[str] = set()
        self.reports: list[PartitionReport] = []
        self.operator: collections.Counter[str] = collections.Counter()

    def error(self, who: str, exc: BaseException) -> None:
        self.errors.append(f"{who}: {getattr(exc, 'sqlstate', None)} {exc}")

    def write(self, writer: int, stop: threading.Event) -> None:
        with psycopg.connect(self.url) as conn:
            n = 0
            while not stop.is_set():
                topic = "junk" if n % 7 == 0 else "t"
                started = time.monotonic()
                try:
                    message = outboxer.enqueue(conn, topic, {"n": n}, key=f"k{(writer + n) % 40}")
                    conn.commit()
                except psycopg.Error as exc:
                    self.error(f"writer {writer}", exc)
                    conn.rollback()
                    continue
                took = time.monotonic() - started
                with self.lock:
                    self.slowest_commit = max(self.slowest_commit, took)
                    (self.junk if topic == "junk" else self.committed).append(str(message.id))
                n += 1

    async def relay(self, relay_id: str, stop: asyncio.Event) -> None:
        async with PostgresStore(self.url) as store:
            while True:
                try:
                    claim = await store.claim("default", relay_id, 30, 30, False)
                except Exception as exc:
                    self.error(f"claim {relay_id}", exc)
                    continue
                if not claim:
                    if stop.is_set():
                        return
                    await asyncio.sleep(0.02)
                    continue
                published, failed = [], []
                for message in claim:
                    first = str(message.id) not in self.failed_once
                    if first and message.topic == "t" and message.stored_seq % 11 == 0:
                        self.failed_once.add(str(message.id))
                        failed.append(Failure(message.stored_seq, "rejected", 0, True))
                    else:
                        published.append(message.stored_seq)
                try:
                    await store.settle("default", claim.lease, published, failed, [], 5)
                except Exception as exc:
                    self.error(f"settle {relay_id}", exc)
                    continue
                done = set(published)
                self.published.update(str(m.id) for m in claim if m.stored_seq in done)

    async def upkeep(self, stop: asyncio.Event) -> None:
        async with PostgresStore(self.url) as store:
            while not stop.is_set():
                try:
                    self.reports.append(await store.maintain_partitions(POLICY))
                except Exception as exc:
                    self.error("upkeep", exc)
                await asyncio.sleep(0.1)

    async def operate(self, stop: asyncio.Event) -> None:
        abandoned = MessageFilter(statuses=("ABANDONED",))
        async with PostgresStore(self.url) as store:
            while not stop.is_set():
                try:
                    self.operator["requeued"] += await store.requeue_matching(abandoned)
                    self.operator["purged"] += await store.purge(MessageFilter(topics=("junk",)))
                    self.operator["requeued"] += await store.requeue(
                        ["default"], ["ABANDONED"], None
                    )
                except Exception as exc:
                    self.error("operator", exc)
                await asyncio.sleep(0.05)


@pytest.mark.timeout(60)
async def test_upkeep_beside_writers_relays_and_operators(second_partitions_url: str) -> None:
    load = Load(second_partitions_url)
    stop_writers, stop_upkeep, stop_relays = threading.Event(), asyncio.Event(), asyncio.Event()
    relays = [asyncio.create_task(load.relay(f"relay-{n}", stop_relays)) for n in range(RELAYS)]
    others = [
        asyncio.create_task(load.upkeep(stop_upkeep)),
        asyncio.create_task(load.operate(stop_upkeep)),
    ]
    writers = [
        asyncio.create_task(asyncio.to_thread(load.write, w, stop_writers)) for w in range(WRITERS)
    ]
    await asyncio.sleep(WRITING)
    stop_writers.set()
    await asyncio.gather(*writers)
    stop_upkeep.set()
    await asyncio.gather(*others)
    async with PostgresStore(second_partitions_url) as store:
        # The rows abandoned after the operator's last round go out too.
        await store.requeue_matching(MessageFilter(statuses=("ABANDONED",)))
    stop_relays.set()
    await asyncio.gather(*relays)

    assert load.errors == [], load.errors[:5]
    assert load.slowest_commit < MAX_COMMIT, f"a writer waited {load.slowest_commit:.2f}s"
    assert len(load.committed) > 1000 and load.operator["purged"] > 0
    assert any(load.failed_once), "no row was abandoned and requeued"
    twice = [i for i, count in load.published.items() if count > 1]
    assert twice == [], "published twice"
    unsent = [i for i in load.committed if load.published[i] == 0]
    assert unsent == [], f"{len(unsent)} committed message(s) never published"
    assert sum(len(r.dropped) for r in load.reports) > 0, "no partition dropped"
    assert sum(len(r.created) for r in load.reports) > 0, "no partition made"
    assert [r.busy for r in load.reports if r.busy] == [], "the upkeep waited out a lock"
    with psycopg.connect(second_partitions_url) as conn:
        left: list[Any] = conn.execute(
            "SELECT DISTINCT status FROM outboxer.outbox WHERE topic = 't'"
        ).fetchall()
    assert left in ([], [("PUBLISHED",)])
