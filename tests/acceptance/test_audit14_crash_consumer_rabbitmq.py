"""`outboxer consume` on RabbitMQ with a handler that kills the process on one message.

The test is the supervisor: it starts the consumer again after each death, as systemd or
Kubernetes would. Before suspects, RabbitMQ delivered the killer again after every restart,
for ever, and nothing after it on its key was ever applied (a crash loop). Now each
redelivered attempt is recorded before its handler runs; after ``max_attempts`` recorded
deaths the message is a dead letter, and everything else is applied once, in key order.
"""

from __future__ import annotations

import asyncio
import sqlite3
import subprocess
import sys
import uuid
from pathlib import Path

import aio_pika

from outboxer.brokers import create_publisher
from outboxer.message import Message
from outboxer.testing import make_message
from tests.audit14_crash_handlers import KILLED
from tests.services import require

OUTBOXER = [sys.executable, "-m", "outboxer.cli"]
ROOT = Path(__file__).resolve().parents[2]
MAX_ATTEMPTS = 3
#: Deaths the supervisor puts up with before it calls the consumer a crash loop: the first
#: delivery's (never recorded: the normal path pays no commit) and MAX_ATTEMPTS recorded.
DEATHS_ALLOWED = MAX_ATTEMPTS + 1

# Every write to the suspects table, kept by the database itself: the cost of the normal
# path measured where it is paid, without touching the consumer's code.
SUSPECT_LOG = "CREATE TABLE suspect_log (message_id TEXT NOT NULL, deaths INTEGER NOT NULL)"
SUSPECT_TRIGGERS = """
CREATE TRIGGER suspect_inserted AFTER INSERT ON inbox_suspects
BEGIN INSERT INTO suspect_log VALUES (NEW.message_id, NEW.deaths); END;
CREATE TRIGGER suspect_updated AFTER UPDATE ON inbox_suspects
BEGIN INSERT INTO suspect_log VALUES (NEW.message_id, NEW.deaths); END;
"""


def query(path: Path, sql: str) -> list[tuple[object, ...]]:
    with sqlite3.connect(path) as lite:
        return lite.execute(sql).fetchall()


def consume(db: str, broker: str, group: str, log: Path) -> int:
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
        "crash.*",
        "--max-attempts",
        str(MAX_ATTEMPTS),
        "--abandoned-blocks-key",
        "false",
        "--exit-when-idle",
        "tests.audit14_crash_handlers:record_or_die",
    ]
    with log.open("ab") as out:
        return subprocess.run(args, cwd=ROOT, stdout=out, stderr=out, timeout=30).returncode


async def publish(broker: str, messages: list[Message]) -> None:
    async with create_publisher(broker) as publisher:
        outcomes = await publisher.publish_batch(messages)
    assert all(outcome.published for outcome in outcomes), outcomes


async def declare(exchange: str, group: str, routing_key: str = "crash.*") -> None:
    """The queue the consumer declares on its first connect (durable, classic), bound
    already: messages published before that would have nowhere to go."""
    connection = await aio_pika.connect("amqp://guest:guest@127.0.0.1:5672/")
    try:
        channel = await connection.channel()
        topic = await channel.declare_exchange(exchange, aio_pika.ExchangeType.TOPIC, durable=True)
        queue = await channel.declare_queue(group, durable=True)
        await queue.bind(topic, routing_key=routing_key)
    finally:
        await connection.close()


async def unacked_and_ready(group: str) -> int:
    connection = await aio_pika.connect("amqp://guest:guest@127.0.0.1:5672/")
    try:
        channel = await connection.channel()
        queue = await channel.declare_queue(group, passive=True)
        return int(queue.declaration_result.message_count)
    finally:
        await connection.close()


async def remove(exchange: str, group: str) -> None:
    connection = await aio_pika.connect("amqp://guest:guest@127.0.0.1:5672/")
    try:
        channel = await connection.channel()
        await channel.queue_delete(group)
        await channel.exchange_delete(exchange)
    finally:
        await connection.close()


def test_a_message_that_kills_the_consumer_is_dead_lettered_after_max_attempts_deaths(
    sqlite_url: str, tmp_path: Path
) -> None:
    require("rabbitmq")
    path = Path(sqlite_url.removeprefix("sqlite:///"))
    with sqlite3.connect(path) as lite:
        lite.execute("CREATE TABLE applied (message_id TEXT, key TEXT, n INTEGER)")
        lite.execute(SUSPECT_LOG)
        tables = {name for (name,) in lite.execute("SELECT name FROM sqlite_master")}
        if "inbox_suspects" in tables:  # not before suspects: the crash loop shows there
            lite.executescript(SUSPECT_TRIGGERS)
    exchange = f"crash-{uuid.uuid4().hex[:8]}"
    broker = f"amqp://guest:guest@127.0.0.1:5672/?exchange={exchange}"
    group = f"g-{exchange}"
    log = tmp_path / "consumer.log"
    try:
        asyncio.run(declare(exchange, group))
        # First deliveries only.
        firsts = [make_message("crash.a", {"n": n}, key=f"f{n % 3}") for n in range(30)]
        asyncio.run(publish(broker, firsts))
        assert consume(sqlite_url, broker, group, log) == 0, log.read_text()
        assert query(path, "SELECT count(*) FROM applied") == [(30,)]
        # The normal path's cost: not one write to the suspects table.
        assert query(path, "SELECT count(*) FROM suspect_log") == [(0,)]

        killer = make_message("crash.b", {"die": True}, key="k")
        after = [make_message("crash.b", {"n": 100 + n}, key="k") for n in range(3)]
        others = [make_message("crash.c", {"n": 200 + n}, key="j") for n in range(3)]
        asyncio.run(publish(broker, [make_message("crash.b", {"n": 99}, key="k"), killer]))
        asyncio.run(publish(broker, [*after, *others]))
        killer_dead_lettered(sqlite_url, broker, group, log, path, killer.id)
        assert asyncio.run(unacked_and_ready(group)) == 0
    finally:
        asyncio.run(remove(exchange, group))


def killer_dead_lettered(
    sqlite_url: str, broker: str, group: str, log: Path, path: Path, killer: uuid.UUID
) -> None:
    """Restart the consumer each time the killer kills it, until a run ends by itself: the
    killer dead-lettered after MAX_ATTEMPTS recorded deaths, every other message (keys k
    and j, 99 on k before the killer) applied once in key order, no suspect row left."""
    deaths = 0
    while (status := consume(sqlite_url, broker, group, log)) != 0:
        assert status == KILLED, log.read_text()
        deaths += 1
        assert deaths <= DEATHS_ALLOWED, f"a crash loop: {deaths} deaths\n{log.read_text()}"
    assert deaths == DEATHS_ALLOWED

    [(message_id, error, attempts)] = query(
        path, "SELECT message_id, error, attempts FROM dead_letters"
    )
    assert (message_id, attempts) == (str(killer), MAX_ATTEMPTS)
    assert f"died {MAX_ATTEMPTS} times" in str(error)
    # Every other message once, each key in order, the killer's followers included.
    rows = query(path, "SELECT key, n FROM applied WHERE key IN ('k', 'j') ORDER BY rowid")
    assert [n for key, n in rows if key == "k"] == [99, 100, 101, 102]
    assert [n for key, n in rows if key == "j"] == [200, 201, 202]
    assert query(path, "SELECT count(*) FROM applied") == [(37,)]
    # Each recorded attempt of the killer, deaths before it 0, 1, 2, 3 (the last one
    # dead-lettered it); nothing left behind in the database.
    killer_log = query(path, f"SELECT deaths FROM suspect_log WHERE message_id = '{killer}'")
    assert [d for (d,) in killer_log] == list(range(MAX_ATTEMPTS + 1))
    assert query(path, "SELECT count(*) FROM inbox_suspects") == [(0,)]
