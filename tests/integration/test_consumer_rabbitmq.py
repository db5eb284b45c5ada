"""outboxer.Consumer on PostgreSQL and RabbitMQ, through the Python API: retries, dead
letters, replay, duplicates between two runners, shutdown, and async and sync handlers."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import aio_pika
import psycopg
import pytest

import outboxer
from outboxer.consumer import Consumer, Delivery
from outboxer.retry import Backoff
from tests.consumer_handlers import APPLIED_DDL, record, record_async, record_psycopg_async
from tests.services import require

AMQP = "amqp://guest:guest@127.0.0.1:5672/"
FAST = Backoff(base=0.05, multiplier=2, cap=0.2, jitter=0)


class Rabbit:
    """A fresh exchange and group; ``publish`` sends as the relay does (through the relay)."""

    def __init__(self) -> None:
        self.exchange = f"ct-{uuid.uuid4().hex[:8]}"
        self.group = f"g-{self.exchange}"
        self.url = f"{AMQP}?exchange={self.exchange}"

    async def cleanup(self) -> None:
        connection = await aio_pika.connect(AMQP)
        channel = await connection.channel()
        await channel.queue_delete(self.group)
        await channel.exchange_delete(self.exchange)
        await connection.close()

    async def ready_count(self) -> int:
        connection = await aio_pika.connect(AMQP)
        try:
            channel = await connection.channel()
            queue = await channel.declare_queue(self.group, passive=True)
            return int(queue.declaration_result.message_count)
        finally:
            await connection.close()


@pytest.fixture
async def rabbit() -> AsyncIterator[Rabbit]:
    require("rabbitmq")
    made = Rabbit()
    yield made
    await made.cleanup()


@pytest.fixture
def db(pg_url: str) -> str:
    with psycopg.connect(pg_url) as conn:
        conn.execute(APPLIED_DDL)
    return pg_url


def enqueue(db: str, count: int, keys: int = 3, topic: str = "t.order") -> list[str]:
    with psycopg.connect(db) as conn:
        messages = outboxer.enqueue_many(
            conn,
            [{"topic": topic, "payload": {"n": n}, "key": f"k{n % keys}"} for n in range(count)],
        )
    return [str(m.id) for m in messages]


async def relay(db: str, broker: str) -> None:
    settings = outboxer.load_settings({"db": db, "broker": broker}, environ={})
    stats = await outboxer.Relay.from_settings(settings).drain()
    assert stats.failed == 0


def rows(db: str, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(db) as conn:
        return conn.execute(sql, params).fetchall()


async def until(check: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def started(consumer: Consumer) -> asyncio.Task[outboxer.consumer.ConsumerStats]:
    task = asyncio.create_task(consumer.run_async())
    await until(lambda: consumer.receiver.connected)
    return task


def consumer_for(db: str, rabbit: Rabbit, handler: Any, **options: Any) -> Consumer:
    options.setdefault("backoff", FAST)
    return Consumer(db=db, broker=rabbit.url, group=rabbit.group, handler=handler, **options)


@pytest.mark.parametrize(
    ("handler", "driver"),
    [(record, None), (record_async, "asyncpg"), (record_psycopg_async, "psycopg")],
    ids=["sync-psycopg", "async-asyncpg", "async-psycopg"],
)
async def test_applies_each_message_once_and_acks_after_commit(
    db: str, rabbit: Rabbit, handler: Any, driver: str | None
) -> None:
    consumer = consumer_for(db, rabbit, handler, topics=["t.*"], async_driver=driver)
    task = await started(consumer)
    ids = enqueue(db, 60)
    await relay(db, rabbit.url)
    await until(lambda: len(rows(db, "SELECT 1 FROM applied")) == 60)
    consumer.stop()
    stats = await task
    assert stats.applied == 60 and stats.duplicates == 0
    assert sorted(str(r[0]) for r in rows(db, "SELECT message_id FROM applied")) == sorted(ids)
    assert consumer.receiver.stats.acked == 60
    assert await rabbit.ready_count() == 0


async def test_handler_failing_twice_applies_once(db: str, rabbit: Rabbit) -> None:
    attempts: list[int] = []

    def flaky(message: Delivery, conn: Any) -> None:
        attempts.append(message.attempt)
        record(message, conn)  # rolled back with the rest when it raises
        if message.attempt < 3:
            raise RuntimeError(f"attempt {message.attempt} failed")

    consumer = consumer_for(db, rabbit, flaky, max_attempts=5)
    task = await started(consumer)
    enqueue(db, 1)
    await relay(db, rabbit.url)
    await until(lambda: len(rows(db, "SELECT 1 FROM applied")) == 1)
    consumer.stop()
    stats = await task
    assert attempts == [1, 2, 3]
    assert rows(db, "SELECT attempt FROM applied") == [(3,)]
    assert (stats.applied, stats.failed, stats.dead_lettered) == (1, 2, 0)
    assert rows(db, "SELECT count(*) FROM outboxer.dead_letters") == [(0,)]


async def test_handler_always_failing_is_dead_lettered_after_max_attempts_and_acked(
    db: str, rabbit: Rabbit
) -> None:
    def poison(message: Delivery, conn: Any) -> None:
        if message.payload["n"] == 0:
            raise ValueError("cannot ship to the moon")
        record(message, conn)

    consumer = consumer_for(db, rabbit, poison, max_attempts=3)
    task = await started(consumer)
    enqueue(db, 4, keys=1)  # one key: the later three wait for the poison one, then go on
    await relay(db, rabbit.url)
    await until(lambda: len(rows(db, "SELECT 1 FROM applied")) == 3)
    consumer.stop()
    stats = await task
    [letter] = rows(
        db,
        "SELECT consumer, topic, key, error, attempts, held, payload FROM outboxer.dead_letters",
    )
    assert letter[:6] == (
        rabbit.group,
        "t.order",
        "k0",
        "ValueError: cannot ship to the moon",
        3,
        False,
    )
    assert bytes(letter[6]) == b'{"n":0}'
    assert [r[0] for r in rows(db, "SELECT n FROM applied ORDER BY position")] == [1, 2, 3]
    assert (stats.failed, stats.dead_lettered) == (3, 1)
    assert await rabbit.ready_count() == 0  # the dead letter was acked too

    # Replay, with the bug fixed: applied once, and the dead letter is gone.
    fixed = consumer_for(db, rabbit, record)
    assert await fixed.replay_dead_letters() == {
        "replayed": 1,
        "duplicates": 0,
        "failed": 0,
        "skipped": 0,
    }
    assert [r[0] for r in rows(db, "SELECT n FROM applied ORDER BY position")] == [1, 2, 3, 0]
    assert rows(db, "SELECT count(*) FROM outboxer.dead_letters") == [(0,)]


async def test_abandoned_blocks_key_holds_later_messages_until_replay(
    db: str, rabbit: Rabbit
) -> None:
    def poison(message: Delivery, conn: Any) -> None:
        if message.payload["n"] == 0:
            raise ValueError("poison")
        record(message, conn)

    consumer = consumer_for(db, rabbit, poison, max_attempts=2, abandoned_blocks_key=True)
    task = await started(consumer)
    enqueue(db, 6, keys=2)  # k0: 0, 2, 4 (0 is poison); k1: 1, 3, 5
    await relay(db, rabbit.url)
    await until(lambda: len(rows(db, "SELECT 1 FROM outboxer.dead_letters")) == 3)
    await until(lambda: len(rows(db, "SELECT 1 FROM applied")) == 3)
    consumer.stop()
    stats = await task
    assert sorted(r[0] for r in rows(db, "SELECT n FROM applied")) == [1, 3, 5]
    letters = rows(db, "SELECT key, held, attempts FROM outboxer.dead_letters ORDER BY seq")
    assert letters == [("k0", False, 2), ("k0", True, 0), ("k0", True, 0)]
    assert (stats.dead_lettered, stats.held) == (3, 2)

    still_broken = consumer_for(db, rabbit, poison, abandoned_blocks_key=True)
    counts = await still_broken.replay_dead_letters()
    assert counts == {"replayed": 0, "duplicates": 0, "failed": 1, "skipped": 2}
    assert rows(db, "SELECT attempts FROM outboxer.dead_letters ORDER BY seq") == [(3,), (0,), (0,)]

    fixed = consumer_for(db, rabbit, record, abandoned_blocks_key=True)
    assert (await fixed.replay_dead_letters())["replayed"] == 3
    k0 = [r[0] for r in rows(db, "SELECT n FROM applied WHERE key = 'k0' ORDER BY position")]
    assert k0 == [0, 2, 4]


async def test_two_runners_apply_a_redelivered_message_once(db: str, rabbit: Rabbit) -> None:
    """The same message reaches two runners of one group at once: one applies it, the other
    waits on the inbox row, then finds it applied."""
    entered = asyncio.Event()
    release = asyncio.Event()

    async def slow(message: Delivery, conn: Any) -> None:
        await record_async(message, conn)
        entered.set()
        await release.wait()  # holds its transaction open, with the inbox row

    first = consumer_for(db, rabbit, slow, prefetch=1)  # holding one: the copy goes elsewhere
    second = consumer_for(db, rabbit, record_async)
    first_task = await started(first)
    enqueue(db, 1)
    await relay(db, rabbit.url)
    await asyncio.wait_for(entered.wait(), 20)
    second_task = await started(second)
    await republish(db, rabbit)  # a copy of the message, as a relay that lost its settle sends
    await until(lambda: second.stats.received == 1)
    await asyncio.sleep(0.3)  # the second runner's claim waits on the first's inbox row
    assert second.stats.applied + second.stats.duplicates == 0
    release.set()
    await until(lambda: second.stats.duplicates == 1)
    first.stop()
    second.stop()
    assert (await first_task).applied == 1
    assert (await second_task).applied == 0
    assert rows(db, "SELECT count(*) FROM applied") == [(1,)]


async def republish(db: str, rabbit: Rabbit) -> None:
    """Publish the outbox's messages once more, as a relay that lost its settle would."""
    with psycopg.connect(db) as conn:
        conn.execute("UPDATE outboxer.outbox SET status = 'PENDING'")
    await relay(db, rabbit.url)


async def test_sigterm_finishes_handlers_in_flight_and_acks_them(db: str, rabbit: Rabbit) -> None:
    entered = asyncio.Event()
    release = asyncio.Event()

    async def slow(message: Delivery, conn: Any) -> None:
        entered.set()
        await release.wait()
        await record_async(message, conn)

    consumer = consumer_for(db, rabbit, slow, concurrency=1, batch=1)
    task = await started(consumer)
    enqueue(db, 5, keys=1)
    await relay(db, rabbit.url)
    await asyncio.wait_for(entered.wait(), 20)
    consumer.stop()  # mid-handler: that one finishes and is acked, the others go back
    await asyncio.sleep(0.1)
    release.set()
    stats = await task
    assert stats.applied == 1
    assert rows(db, "SELECT count(*) FROM applied") == [(1,)]
    assert consumer.receiver.stats.acked == 1
    deadline = time.monotonic() + 10
    while await rabbit.ready_count() != 4:  # the rest go back to the queue, unacked
        assert time.monotonic() < deadline, "the unstarted messages did not go back"
        await asyncio.sleep(0.05)


async def test_a_lost_database_connection_costs_no_attempt(db: str, rabbit: Rabbit) -> None:
    """The consumer's connections are cut three times mid-run: it reconnects, applies
    everything once and counts no handler failure."""

    async def slow(message: Delivery, conn: Any) -> None:
        await record_async(message, conn)
        await asyncio.sleep(0.01)

    consumer = consumer_for(db, rabbit, slow, batch=4)
    task = await started(consumer)
    enqueue(db, 200, keys=10)
    publishing = asyncio.create_task(relay(db, rabbit.url))
    cuts = 0
    deadline = time.monotonic() + 60
    while len(rows(db, "SELECT 1 FROM applied")) < 200:
        assert time.monotonic() < deadline, "timed out"
        if cuts < 3 and len(rows(db, "SELECT 1 FROM applied")) >= 20 + 50 * cuts:
            with psycopg.connect(db, autocommit=True) as conn:
                conn.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid() "
                    "AND application_name NOT LIKE 'outboxer-relay%'"
                )
            cuts += 1
        await asyncio.sleep(0.01)
    await publishing
    consumer.stop()
    stats = await task
    assert cuts == 3
    assert rows(db, "SELECT count(*), count(DISTINCT message_id) FROM applied") == [(200, 200)]
    assert stats.failed == 0 and stats.dead_lettered == 0
    assert stats.database_errors >= 1
    assert await rabbit.ready_count() == 0
