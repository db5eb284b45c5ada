"""Keys that differ only in trailing spaces are distinct keys on MariaDB too. The tables'
utf8mb4_bin collation is PAD SPACE: `key` = 'a' also matched 'a ', so a row or dead letter
of one key held back the other, and an operator's filter on one key reached the other."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest

import outboxer
from outboxer.admin import MessageFilter
from outboxer.brokers.memory import memory_broker
from outboxer.consumer import Consumer, Delivery
from outboxer.retry import Backoff
from outboxer.testing import make_message
from tests.conftest import mysql_connect
from tests.relaying import enqueue


def execute(url: str, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    conn = mysql_connect(url)
    try:
        with conn.cursor() as cursor:
            cursor.execute(sql, args)
            found = list(cursor.fetchall())
        conn.commit()
        return found
    finally:
        conn.close()


def backing_off(url: str, message: outboxer.Message) -> None:
    """The row failed once and is due again only in an hour: it holds back its key."""
    execute(
        url,
        "UPDATE outbox SET status = 'FAILED', attempts = 1, "
        "next_attempt_at = UTC_TIMESTAMP(6) + INTERVAL 1 HOUR WHERE id = %s",
        str(message.id),
    )


async def test_a_failed_row_holds_back_only_its_own_key(mysql_url: str) -> None:
    padded, plain = enqueue(mysql_url, ("t", "a "), ("t", "a"))
    backing_off(mysql_url, padded)
    async with outboxer.create_store(mysql_url) as store:
        claimed = await store.claim("default", "r", 10, 60, True, max_attempts=5)
    assert [m.id for m in claimed] == [plain.id]


async def test_an_expired_lease_behind_another_keys_failed_row_is_recovered(
    mysql_url: str,
) -> None:
    padded, plain = enqueue(mysql_url, ("t", "a "), ("t", "a"))
    backing_off(mysql_url, padded)
    execute(
        mysql_url,
        "UPDATE outbox SET status = 'PROCESSING', locked_by = 'dead', lease = %s, "
        "locked_until = UTC_TIMESTAMP(6) - INTERVAL 1 HOUR WHERE id = %s",
        str(uuid.uuid4()),
        str(plain.id),
    )
    async with outboxer.create_store(mysql_url) as store:
        claimed = await store.claim("default", "r", 10, 60, True, max_attempts=5)
    assert [m.id for m in claimed] == [plain.id]


async def test_filters_match_keys_and_topics_byte_for_byte(mysql_url: str) -> None:
    enqueue(mysql_url, ("t", "a "), ("t", "a"), ("t ", "b"))
    async with outboxer.create_store(mysql_url) as store:
        assert await store.count_matching(MessageFilter(keys=("a",))) == {"default": {"PENDING": 1}}
        assert await store.count_matching(MessageFilter(topics=("t",))) == {
            "default": {"PENDING": 2}
        }
        assert await store.purge(MessageFilter(keys=("a ",))) == 1
    assert execute(mysql_url, "SELECT `key` FROM outbox ORDER BY seq") == [("a",), ("b",)]


async def test_replay_locks_the_slot_of_every_key(mysql_url: str) -> None:
    from outboxer.enqueue import mysql_key_slots

    enqueue(mysql_url, ("t", "a"), ("t", "a "))
    execute(mysql_url, "UPDATE outbox SET status = 'PUBLISHED'")
    async with (
        outboxer.create_store(mysql_url) as store,
        store._transaction() as cursor,  # type: ignore[attr-defined]
    ):
        await store._admin(cursor, "replay_keys", MessageFilter())  # type: ignore[attr-defined]
        keys = sorted(row["key"] for row in await cursor.fetchall())
    assert keys == ["a", "a "]
    assert len(mysql_key_slots(keys)) == 2  # the two keys' slots differ: both need locking


def test_a_dead_letter_holds_back_only_its_own_key(mysql_url: str) -> None:
    applied: list[str | None] = []

    def handler(message: Delivery, conn: Any) -> None:
        if message.key == "a ":
            raise RuntimeError("poison")
        applied.append(message.key)

    def run(key: str) -> Any:
        """One run of the consumer over one message of ``key``."""
        broker = f"padspace-{uuid.uuid4().hex[:8]}"
        memory_broker(broker).messages.append(make_message("t", {}, key=key))
        consumer = Consumer(
            db=mysql_url,
            broker=f"memory://{broker}",
            group="g",
            handler=handler,
            backoff=Backoff(0.01, 1, 0.01, 0),
            exit_when_idle=True,
            max_attempts=1,
            abandoned_blocks_key=True,
        )
        return asyncio.run(consumer.run_async())

    assert run("a ").dead_lettered == 1
    stats = run("a")
    assert applied == ["a"]
    assert (stats.applied, stats.held) == (1, 0)


def test_a_consumer_ending_in_a_space_is_refused(mysql_url: str) -> None:
    """'c' and 'c ' would share one inbox: what one applied, the other skipped."""
    from outboxer.errors import ConfigError, PayloadError
    from outboxer.inbox import Inbox

    conn = mysql_connect(mysql_url)
    try:
        assert Inbox().claim(conn, "c", uuid.uuid4())
        with pytest.raises(PayloadError, match="ends in a space"):
            Inbox().claim(conn, "c ", uuid.uuid4())
    finally:
        conn.rollback()
        conn.close()
    with pytest.raises(ConfigError, match="ends in a space"):
        Consumer(db=mysql_url, broker="memory://x", group="g ", handler=lambda m, c: None)
