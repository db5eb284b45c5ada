"""`outboxer consume` on Kafka (librdkafka's mock cluster, served from this test process
over TCP) with a handler that kills the process on one message; the test restarts it after
each death, as a supervisor would.

Kafka marks nothing redelivered: without ``suspect_window`` the killer came first again
after every restart, for ever, its partition stopped. With ``--option suspect_window=4``
(at least ``--prefetch``) the first messages read after each assignment are suspects: the
killer is dead-lettered after ``max_attempts`` deaths (its first delivery is recorded too,
the window covering the first assignment), everything else applied once, in key order.
"""

from __future__ import annotations

import asyncio
import sqlite3
import subprocess
import sys
import time
import uuid
from pathlib import Path

from outboxer.brokers.kafka import KafkaPublisher
from outboxer.message import Message
from outboxer.testing import make_message
from tests.audit14_crash_handlers import KILLED
from tests.integration.test_broker_kafka import MockCluster
from tests.integration.test_kafka_audit_receiver import one_partition_topic

OUTBOXER = [sys.executable, "-m", "outboxer.cli"]
ROOT = Path(__file__).resolve().parents[2]
MAX_ATTEMPTS = 3


def query(path: Path, sql: str) -> list[tuple[object, ...]]:
    with sqlite3.connect(path) as lite:
        return lite.execute(sql).fetchall()


def consume(db: str, broker: str, group: str, topic: str, window: int, log: Path) -> int:
    """One run of `outboxer consume` until it is idle (0) or dies; its exit status."""
    args = [
        *OUTBOXER,
        "consume",
        "--db",
        db,
        "--broker",
        broker,
        "--group",
        group,
        "--topic",
        topic,
        "--prefetch",
        "4",
        "--option",
        f"suspect_window={window}",
        "--max-attempts",
        str(MAX_ATTEMPTS),
        "--abandoned-blocks-key",
        "false",
        "--exit-when-idle",
        "tests.audit14_crash_handlers:record_or_die",
    ]
    with log.open("ab") as out:
        return subprocess.run(args, cwd=ROOT, stdout=out, stderr=out, timeout=30).returncode


async def publish(cluster: MockCluster, messages: list[Message]) -> None:
    async with KafkaPublisher(f"kafka://{cluster.bootstrap}") as publisher:
        outcomes = await publisher.publish_batch(messages)
    assert all(outcome.published for outcome in outcomes), outcomes


def setup(cluster: MockCluster, sqlite_url: str) -> tuple[Path, str, str, uuid.UUID]:
    """The applied table, a one-partition topic holding, in order: 99 and the killer on key
    k, then 100-102 on k and 200-202 on j."""
    path = Path(sqlite_url.removeprefix("sqlite:///"))
    with sqlite3.connect(path) as lite:
        lite.execute("CREATE TABLE applied (message_id TEXT, key TEXT, n INTEGER)")
    topic = one_partition_topic(cluster, prefix="crash")
    killer = make_message(topic, {"die": True}, key="k")
    asyncio.run(
        publish(
            cluster,
            [
                make_message(topic, {"n": 99}, key="k"),
                killer,
                *[make_message(topic, {"n": 100 + n}, key="k") for n in range(3)],
                *[make_message(topic, {"n": 200 + n}, key="j") for n in range(3)],
            ],
        )
    )
    # A killed member is not waited for: its session ends in a second (the mock takes it).
    broker = f"kafka://{cluster.bootstrap}?session.timeout.ms=1000&heartbeat.interval.ms=100"
    return path, broker, topic, killer.id


def test_without_the_window_a_killer_is_a_crash_loop(
    cluster: MockCluster, sqlite_url: str, tmp_path: Path
) -> None:
    path, broker, topic, _killer = setup(cluster, sqlite_url)
    group, log = f"g-{uuid.uuid4().hex[:8]}", tmp_path / "consumer.log"
    started = time.monotonic()
    for _ in range(4):
        assert consume(sqlite_url, broker, group, topic, 0, log) == KILLED, log.read_text()
        assert time.monotonic() - started < 20
    assert query(path, "SELECT count(*) FROM dead_letters") == [(0,)]
    assert query(path, "SELECT count(*) FROM inbox_suspects") == [(0,)]


def test_with_the_window_a_killer_is_dead_lettered_after_max_attempts_deaths(
    cluster: MockCluster, sqlite_url: str, tmp_path: Path
) -> None:
    path, broker, topic, killer = setup(cluster, sqlite_url)
    group, log = f"g-{uuid.uuid4().hex[:8]}", tmp_path / "consumer.log"
    deaths = 0
    while (status := consume(sqlite_url, broker, group, topic, 4, log)) != 0:
        assert status == KILLED, log.read_text()
        deaths += 1
        assert deaths <= MAX_ATTEMPTS, f"a crash loop: {deaths} deaths\n{log.read_text()}"
    # Every attempt recorded, the first delivery's included (the window covers the first
    # assignment): MAX_ATTEMPTS deaths, not one more as on RabbitMQ.
    assert deaths == MAX_ATTEMPTS
    [(message_id, error, attempts)] = query(
        path, "SELECT message_id, error, attempts FROM dead_letters"
    )
    assert (message_id, attempts) == (str(killer), MAX_ATTEMPTS)
    assert f"died {MAX_ATTEMPTS} times" in str(error)
    rows = query(path, "SELECT key, n FROM applied ORDER BY rowid")
    assert [n for key, n in rows if key == "k"] == [99, 100, 101, 102]
    assert [n for key, n in rows if key == "j"] == [200, 201, 202]
    assert query(path, "SELECT count(*) FROM inbox_suspects") == [(0,)]
