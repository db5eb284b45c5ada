"""``Consumer.replay_dead_letters`` reads only what it replays, on SQLite, PostgreSQL (psycopg
and asyncpg) and MariaDB.

It read every dead letter of the group at once (``limit=10_000_000``) even to replay one id:
the Django admin's Replay of one row on a group with millions of dead letters loaded them all.
Given ids, it now reads those ids' rows (and asks the database, per key, whether an earlier
dead letter of the key is still there); a whole group is walked in bounded pages of seq. The
outcomes stay as they were: a dead letter behind an earlier one of its key that was not
chosen, or that failed again, is skipped (``abandoned_blocks_key``); without that option
none is.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psycopg
import pytest

from outboxer import consumer as consumer_module
from outboxer.consumer import Consumer, Delivery
from outboxer.consumer_db import Session
from tests.conftest import mysql_connect
from tests.integration.test_consumer_handler_errors import (
    FAST,
    KINDS,
    database,
    is_async,
    key_column,
    mysql_db,  # noqa: F401 -- fixtures database() asks for
    pg_db,  # noqa: F401
    query,
    sqlite_db,  # noqa: F401
    table,
)

KIND_NAMES = ["sqlite", "postgres-psycopg", "postgres-asyncpg", "mysql"]
#: The payload n whose handler always fails (its replay fails again).
BROKEN = -1


def insert_letters(db: str, letters: list[tuple[str, uuid.UUID, str | None, int]]) -> None:
    """Dead letters (group, message id, key, n) in this order (their seq order)."""
    rows = [
        (group, str(message_id), "t", key, "{}", "application/json", json.dumps({"n": n}).encode())
        for group, message_id, key, n in letters
    ]
    columns = (
        f"consumer, message_id, topic, {key_column(db)}, headers, content_type, payload, "
        "error, attempts, held"
    )
    if db.startswith("sqlite"):
        with sqlite3.connect(db.removeprefix("sqlite:///")) as lite:
            lite.executemany(
                f"INSERT INTO dead_letters ({columns}) VALUES (?, ?, ?, ?, ?, ?, ?, 'e', 1, 0)",
                rows,
            )
        return
    sql = (
        f"INSERT INTO {table(db, 'dead_letters')} ({columns}) "
        "VALUES (%s, %s, %s, %s, %s, %s, %s, 'e', 1, false)"
    )
    if db.startswith("postgres"):
        with psycopg.connect(db) as conn, conn.cursor() as cursor:
            cursor.executemany(sql, rows)
        return
    conn = mysql_connect(db, autocommit=True)
    try:
        with conn.cursor() as cursor:
            cursor.executemany(sql, rows)
    finally:
        conn.close()


def mark_applied(db: str, group: str, message_id: uuid.UUID) -> None:
    """The inbox row of a message applied earlier: its replay is a duplicate."""
    if db.startswith("sqlite"):
        with sqlite3.connect(db.removeprefix("sqlite:///")) as lite:
            lite.execute(
                "INSERT INTO inbox (consumer, message_id) VALUES (?, ?)", (group, str(message_id))
            )
        return
    sql = f"INSERT INTO {table(db, 'inbox')} (consumer, message_id) VALUES (%s, %s)"
    if db.startswith("postgres"):
        with psycopg.connect(db) as conn:
            conn.execute(sql, (group, message_id))
        return
    conn = mysql_connect(db, autocommit=True)
    try:
        with conn.cursor() as cursor:
            cursor.execute(sql, (group, str(message_id)))
    finally:
        conn.close()


def remaining(db: str, group: str) -> list[tuple[str, int]]:
    placeholder = "?" if db.startswith("sqlite") else "%s"
    rows = query(
        db,
        f"SELECT message_id, attempts FROM {table(db, 'dead_letters')} "
        f"WHERE consumer = {placeholder} ORDER BY seq",
        group,
    )
    return [(str(message_id), attempts) for message_id, attempts in rows]


def applied_ns(db: str) -> list[int]:
    return [row[0] for row in query(db, "SELECT n FROM applied ORDER BY position")]


def handler_for(kind: str) -> Callable[..., Any]:
    record = KINDS[kind][2]
    if is_async(kind):

        async def handle_async(message: Delivery, conn: Any) -> None:
            if message.payload["n"] == BROKEN:
                raise RuntimeError("still broken")
            await record(message, conn)

        return handle_async

    def handle(message: Delivery, conn: Any) -> None:
        if message.payload["n"] == BROKEN:
            raise RuntimeError("still broken")
        record(message, conn)

    return handle


def replayer(db: str, kind: str, abandoned_blocks_key: bool) -> tuple[Consumer, list[int]]:
    """A replaying consumer, and the sizes of the dead-letter reads it makes (rows that carry
    a payload, per statement)."""
    consumer = Consumer(
        db=db,
        broker=None,
        group="g",
        handler=handler_for(kind),
        async_driver=KINDS[kind][1],
        backoff=FAST,
        abandoned_blocks_key=abandoned_blocks_key,
    )
    reads: list[int] = []
    make_session = consumer._make_session

    def counting_session(executor: ThreadPoolExecutor) -> Session:
        session: Session = make_session(executor)
        fetch = session.fetch

        async def counting_fetch(name: str, params: Any) -> list[dict[str, Any]]:
            rows = await fetch(name, params)
            letters = sum("payload" in row for row in rows)
            if letters:
                reads.append(letters)
            return rows

        session.fetch = counting_fetch  # type: ignore[method-assign]
        return session

    consumer._make_session = counting_session
    return consumer, reads


def ids(count: int) -> Iterator[uuid.UUID]:
    return (uuid.uuid4() for _ in range(count))


FILLER = 300


@pytest.mark.parametrize("abandoned_blocks_key", [True, False], ids=["blocks", "no-blocks"])
@pytest.mark.parametrize("kind", KIND_NAMES)
def test_replaying_ids_reads_only_their_rows_and_keeps_the_key_rule(
    request: pytest.FixtureRequest, kind: str, abandoned_blocks_key: bool
) -> None:
    db = database(request, kind)
    a, b, c, d, e, f, g, h, p_padded, p, other = ids(11)
    before = [("g", message_id, f"early{i}", 100 + i) for i, message_id in enumerate(ids(FILLER))]
    after = [("g", message_id, f"late{i}", 500 + i) for i, message_id in enumerate(ids(FILLER))]
    insert_letters(
        db,
        [
            ("other", other, "k1", 0),  # another group's: blocks nothing of g
            *before,
            ("g", a, "k1", 1),  # not chosen: B stays behind it (abandoned_blocks_key)
            ("g", b, "k1", 2),
            ("g", c, "k2", BROKEN),  # fails again: D stays behind it
            ("g", d, "k2", 4),
            ("g", e, "k3", 5),  # replayed, then F of its key
            ("g", f, "k3", 6),
            ("g", g, None, 7),
            ("g", h, "k4", 8),  # already applied: a duplicate
            ("g", p_padded, "p ", 9),  # not chosen, and not the key 'p' (MariaDB's PAD SPACE)
            ("g", p, "p", 10),
            *after,
        ],
    )
    mark_applied(db, "g", h)
    chosen = [b, c, d, e, f, g, h, p]
    consumer, reads = replayer(db, kind, abandoned_blocks_key)

    counts = asyncio.run(consumer.replay_dead_letters([str(i) for i in reversed(chosen)]))

    assert sum(reads) <= len(chosen), f"read {sum(reads)} dead letters to replay {len(chosen)}"
    kept = {(str(i), 1) for i in (a, p_padded)} | {(str(c), 2)}
    if abandoned_blocks_key:
        assert counts == {"replayed": 4, "duplicates": 1, "failed": 1, "skipped": 2}
        assert applied_ns(db) == [5, 6, 7, 10]
        kept |= {(str(b), 1), (str(d), 1)}
    else:
        assert counts == {"replayed": 6, "duplicates": 1, "failed": 1, "skipped": 0}
        assert applied_ns(db) == [2, 4, 5, 6, 7, 10]
    left = remaining(db, "g")
    assert len(left) == 2 * FILLER + len(kept)
    assert set(left) - {(str(i), 1) for _, i, _, _ in before + after} == kept
    assert remaining(db, "other") == [(str(other), 1)]


PAGE = 7


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_replaying_a_group_reads_it_in_pages_with_the_same_outcome(
    request: pytest.FixtureRequest, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Page boundaries change nothing: a key failed in one page holds its dead letters in the
    later pages; one replayed in a page leaves the later ones free."""
    db = database(request, kind)
    monkeypatch.setattr(consumer_module, "REPLAY_PAGE_SIZE", PAGE, raising=False)
    letters: list[tuple[str, uuid.UUID, str | None, int]] = []
    for n in range(40):
        key = ("broken", "fine", None, f"own{n}")[n % 4]
        payload = BROKEN if key == "broken" and n == 4 else n
        letters.append(("g", uuid.uuid4(), key, payload))
        if n % 5 == 0:
            letters.append(("other", uuid.uuid4(), "fine", 1000 + n))
    insert_letters(db, letters)
    group = [letter for letter in letters if letter[0] == "g"]
    mark_applied(db, "g", group[2][1])
    consumer, reads = replayer(db, kind, abandoned_blocks_key=True)

    counts = asyncio.run(consumer.replay_dead_letters())

    assert reads and max(reads) <= PAGE, f"reads of {reads} dead letters, pages of {PAGE}"
    broken_at = next(i for i, letter in enumerate(group) if letter[3] == BROKEN)
    behind = [letter for i, letter in enumerate(group) if letter[2] == "broken" and i > broken_at]
    assert counts == {
        "replayed": len(group) - len(behind) - 2,
        "duplicates": 1,
        "failed": 1,
        "skipped": len(behind),
    }
    others = [letter for letter in letters if letter[0] == "other"]
    assert len(remaining(db, "other")) == len(others)
    assert remaining(db, "g") == [(str(group[broken_at][1]), 2)] + [
        (str(letter[1]), 1) for letter in behind
    ]
    replayed = [letter[3] for letter in group if letter not in behind]
    assert applied_ns(db) == [n for n in replayed if n not in (BROKEN, group[2][3])]


@pytest.mark.parametrize("kind", ["sqlite", "postgres-psycopg", "mysql"])
def test_a_group_larger_than_a_page_is_never_read_at_once(
    request: pytest.FixtureRequest, kind: str
) -> None:
    db = database(request, kind)
    count = 2_100
    insert_letters(db, [("g", uuid.uuid4(), None, n) for n in range(count)])
    consumer, reads = replayer(db, kind, abandoned_blocks_key=True)

    counts = asyncio.run(consumer.replay_dead_letters())

    assert counts == {"replayed": count, "duplicates": 0, "failed": 0, "skipped": 0}
    assert sum(reads) == count and max(reads) <= 1_000, reads
    assert remaining(db, "g") == []
