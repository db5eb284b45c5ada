"""PostgreSQL: a write of more keys than ``Outbox.max_key_locks`` locks the table instead of
each key (queries.sql: table_lock), on the real server, plain and partitioned.

One advisory lock per key fills the cluster's shared lock table: 15,000 distinct keys in
one ``enqueue_many`` failed with "out of shared memory" on a default server, and while the
table was nearly full every other session's locks could fail too.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
import uuid
from typing import Any

import asyncpg
import psycopg
import pytest

import outboxer
from outboxer.admin import MessageFilter, ReplayCopier
from outboxer.admin import replay as admin_replay
from outboxer.enqueue import Outbox
from outboxer.stores import create_store

LOCKS = (
    "SELECT locktype, mode FROM pg_locks WHERE pid = pg_backend_pid() "
    "AND (locktype = 'advisory' OR mode = 'ShareRowExclusiveLock')"
)


def _locks_held(conn: psycopg.Connection[Any]) -> dict[str, int]:
    held: dict[str, int] = {}
    for locktype, mode in conn.execute(LOCKS).fetchall():
        held[f"{locktype}:{mode}"] = held.get(f"{locktype}:{mode}", 0) + 1
    return held


def _messages(keys: int, writer: str) -> list[dict[str, Any]]:
    return [{"topic": "t", "payload": {"writer": writer}, "key": f"key-{n}"} for n in range(keys)]


def _waiting(url: str) -> int:
    """Sessions of the test database waiting for a lock of any kind now."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
            "WHERE NOT l.granted AND a.datname = current_database()"
        ).fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.parametrize("layout", ["plain", "partitioned"])
def test_a_write_of_more_keys_than_the_limit_locks_the_table_and_keeps_key_order(
    request: pytest.FixtureRequest, layout: str
) -> None:
    url = request.getfixturevalue("pg_url" if layout == "plain" else "pg_partitioned_url")
    bulk = psycopg.connect(url)
    outboxer.enqueue_many(bulk, _messages(15_000, "bulk"))  # "out of shared memory" before
    held = _locks_held(bulk)
    # The partitioned layout's lock covers its partitions: one entry each.
    assert set(held) == {"relation:ShareRowExclusiveLock"}, f"no key lock at all: {held}"

    errors: list[BaseException] = []

    def write(key: str | None, writer: str) -> None:
        try:
            with psycopg.connect(url) as conn:
                outboxer.enqueue(conn, "t", {"writer": writer}, key=key)
                conn.commit()
        except BaseException as exc:  # reported below
            errors.append(exc)

    later = [
        threading.Thread(target=write, args=("key-7", "same key")),
        threading.Thread(target=write, args=(None, "no key")),
    ]
    for thread in later:
        thread.start()
    deadline = time.monotonic() + 10
    while _waiting(url) < 2:
        assert time.monotonic() < deadline, f"the writers never waited for the bulk: {errors}"
        time.sleep(0.02)
    bulk.commit()
    bulk.close()
    for thread in later:
        thread.join(15)
        assert not thread.is_alive()
    assert errors == []
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT key, convert_from(payload, 'UTF8') FROM outboxer.outbox ORDER BY seq"
        ).fetchall()
    assert len(rows) == 15_002
    writers = [json.loads(payload)["writer"] for _, payload in rows]
    assert writers[-2:] in (["same key", "no key"], ["no key", "same key"]), (
        "the writers that waited took their seqs after every row of the bulk"
    )
    of_key_7 = [writer for (key, _), writer in zip(rows, writers, strict=True) if key == "key-7"]
    assert of_key_7 == ["bulk", "same key"]


@pytest.mark.parametrize("driver", ["psycopg", "asyncpg"])
def test_key_locks_up_to_the_limit_then_the_table_lock(pg_url: str, driver: str) -> None:
    outbox = Outbox(max_key_locks=5)
    seen: dict[int, dict[str, int]] = {}

    async def on_asyncpg(keys: int) -> dict[str, int]:
        conn = await asyncpg.connect(pg_url)
        try:
            async with conn.transaction():
                await outbox.enqueue_many_async(conn, _messages(keys, "asyncpg"))
                held: dict[str, int] = {}
                for row in await conn.fetch(LOCKS):
                    name = f"{row['locktype']}:{row['mode']}"
                    held[name] = held.get(name, 0) + 1
                return held
        finally:
            await conn.close()

    for keys in (5, 6):
        if driver == "psycopg":
            with psycopg.connect(pg_url) as conn:
                # 8 rows of 5 or 6 keys: the limit counts distinct keys, not rows.
                outbox.enqueue_many(conn, [*_messages(keys, "psycopg"), *_messages(3, "again")])
                seen[keys] = _locks_held(conn)
                conn.commit()
        else:
            seen[keys] = asyncio.run(on_asyncpg(keys))
    assert seen == {
        5: {"advisory:ExclusiveLock": 5},
        6: {"relation:ShareRowExclusiveLock": 1},
    }
    with psycopg.connect(pg_url) as conn:
        row = conn.execute("SELECT count(*) FROM outboxer.outbox").fetchone()
    assert row is not None and row[0] == (5 + 3 + 6 + 3 if driver == "psycopg" else 5 + 6)


@pytest.mark.parametrize("limit", [0, -1, True, 2.5, "10"])
def test_max_key_locks_is_a_whole_number_of_at_least_one(limit: object) -> None:
    with pytest.raises(outboxer.ConfigError, match="max_key_locks"):
        Outbox(max_key_locks=limit)  # type: ignore[arg-type]


async def test_a_replay_of_more_keys_than_the_limit_locks_the_table_and_no_key(
    pg_url: str,
) -> None:
    """Replay's copies of 1,500 keys (over the default limit of 1,000) hold the table lock
    and no key lock; a writer of a copied key waits, and its row comes after the copies."""
    with psycopg.connect(pg_url) as conn:
        outboxer.enqueue_many(conn, _messages(1_500, "original"))
        conn.execute("UPDATE outboxer.outbox SET status = 'PUBLISHED', published_at = now()")
        conn.commit()
    store = create_store(pg_url)
    await store.connect()
    copied: list[int] = []
    writer_done = threading.Event()

    class Watching(ReplayCopier):
        """Records, while the replay's transaction is open, what a writer sees."""

        def copy(self, original: outboxer.Message) -> outboxer.Message:
            if not copied:
                copied.extend(_granted(pg_url))
                copied.append(_waiting_writer(pg_url, writer_done))
            return super().copy(original)

    try:
        result = await admin_replay(store, MessageFilter(), everything=True, copier=Watching())
    finally:
        await store.close()
    assert result.count == 1_500
    assert copied == [0, 1, 1], "the replay held the table lock, no key lock; a writer waited"
    # The writer commits once the replay did, in its own thread: its row is there after that.
    assert writer_done.wait(20), "the writer never committed after the replay"
    with psycopg.connect(pg_url) as conn:
        rows = conn.execute(
            "SELECT convert_from(payload, 'UTF8'), headers ? 'replay-of' FROM outboxer.outbox "
            "WHERE key = 'key-7' ORDER BY seq"
        ).fetchall()
    assert [(json.loads(p)["writer"], copy) for p, copy in rows] == [
        ("original", False),
        ("original", True),
        ("writer", False),
    ]


def _granted(url: str) -> list[int]:
    """Advisory locks, and SHARE ROW EXCLUSIVE locks on the outbox, held in the test database."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FILTER (WHERE l.locktype = 'advisory'), "
            "count(*) FILTER (WHERE l.mode = 'ShareRowExclusiveLock' "
            "AND l.relation = 'outboxer.outbox'::regclass) "
            "FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
            "WHERE l.granted AND a.datname = current_database()"
        ).fetchone()
    assert row is not None
    return [int(row[0]), int(row[1])]


def _waiting_writer(url: str, done: threading.Event) -> int:
    """Start a writer of key-7 in a thread and return 1 once it waits for a lock (the
    replay's), 0 if it went through; the thread commits once the replay does, then sets
    ``done`` (the caller waits for it before reading the rows)."""

    def write() -> None:
        with psycopg.connect(url) as conn:
            outboxer.enqueue(conn, "t", {"writer": "writer"}, key="key-7", message_id=uuid.uuid4())
            conn.commit()
        done.set()

    threading.Thread(target=write, daemon=True).start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if done.is_set():
            return 0
        if _waiting(url) >= 1:
            return 1
        time.sleep(0.02)
    return 0


def test_configure_sets_the_limit_of_the_module_level_functions(pg_url: str) -> None:
    outboxer.configure(max_key_locks=2)
    try:
        with psycopg.connect(pg_url) as conn:
            outboxer.enqueue_many(conn, _messages(3, "configured"))
            assert _locks_held(conn) == {"relation:ShareRowExclusiveLock": 1}
    finally:
        outboxer.configure()
    # outboxer.enqueue is the function: the module is reached through sys.modules.
    assert sys.modules["outboxer.enqueue"].DEFAULT_OUTBOX.max_key_locks == 1000
