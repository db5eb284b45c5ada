"""outboxer.Consumer on MariaDB (PyMySQL handlers), fed by the in-process broker: each
message once, a duplicate skipped, dead letters held behind their key and replayed."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest

from outboxer.brokers.memory import memory_broker
from outboxer.consumer import Consumer, Delivery
from outboxer.retry import Backoff
from outboxer.testing import make_message
from tests.conftest import mysql_connect


@pytest.fixture
def db(mysql_url: str) -> str:
    conn = mysql_connect(mysql_url)
    with conn.cursor() as cursor:
        cursor.execute(
            "CREATE TABLE applied (position INT AUTO_INCREMENT PRIMARY KEY, "
            "message_id CHAR(36) NOT NULL, `key` VARCHAR(40), n INT NOT NULL)"
        )
    conn.close()
    return mysql_url


def rows(db: str, sql: str) -> list[tuple[Any, ...]]:
    conn = mysql_connect(db)
    try:
        with conn.cursor() as cursor:
            cursor.execute(sql)
            return list(cursor.fetchall())
    finally:
        conn.close()


def handler(message: Delivery, conn: Any) -> None:
    if message.payload["n"] == 0 and not getattr(handler, "fixed", False):
        raise RuntimeError("zero")
    with conn.cursor() as cursor:
        cursor.execute(
            "INSERT INTO applied (message_id, `key`, n) VALUES (%s, %s, %s)",
            (str(message.id), message.key, message.payload["n"]),
        )


def run(db: str, broker: str, **options: Any) -> Any:
    consumer = Consumer(
        db=db,
        broker=f"memory://{broker}",
        group="g",
        handler=handler,
        backoff=Backoff(0.01, 1, 0.01, 0),
        exit_when_idle=True,
        **options,
    )
    return consumer, asyncio.run(consumer.run_async())


def test_mysql_applies_once_holds_behind_a_dead_letter_and_replays(db: str) -> None:
    broker = f"mysql-{uuid.uuid4().hex[:8]}"
    messages = [make_message("t", {"n": n}, key=f"k{n % 2}") for n in range(6)]
    memory_broker(broker).messages.extend([*messages, messages[3]])  # 3 comes twice
    consumer, stats = run(db, broker, max_attempts=2, abandoned_blocks_key=True)
    assert sorted(r[0] for r in rows(db, "SELECT n FROM applied")) == [1, 3, 5]
    assert (stats.applied, stats.duplicates, stats.dead_lettered, stats.held) == (3, 1, 3, 2)
    letters = rows(db, "SELECT `key`, attempts, held, error FROM dead_letters ORDER BY seq")
    assert [letter[:3] for letter in letters] == [("k0", 2, 0), ("k0", 0, 1), ("k0", 0, 1)]
    assert letters[0][3] == "RuntimeError: zero" and letters[1][3].startswith("held back")

    handler.fixed = True  # type: ignore[attr-defined]
    try:
        counts = asyncio.run(consumer.replay_dead_letters())
    finally:
        handler.fixed = False  # type: ignore[attr-defined]
    assert counts == {"replayed": 3, "duplicates": 0, "failed": 0, "skipped": 0}
    assert [
        r[0] for r in rows(db, "SELECT n FROM applied WHERE `key` = 'k0' ORDER BY position")
    ] == [0, 2, 4]
    assert rows(db, "SELECT count(*) FROM dead_letters") == [(0,)]
