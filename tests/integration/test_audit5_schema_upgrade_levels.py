"""Audit 5, schema lifecycle: an outbox made by an earlier version (migrations 0001..k
applied, k every level there is), holding rows in every status, upgraded by `schema apply`:
every row kept, claim works, nothing republished, nothing lost, a key's order kept, and a
row an old relay still holds left to it until its lease ends."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import threading
import time
import uuid
from typing import Any

import psycopg
import pytest

from outboxer.enqueue import Outbox
from outboxer.errors import SchemaError
from outboxer.stores import create_store
from outboxer.stores.base import Store
from outboxer.stores.mysql import MySQLStore
from outboxer.stores.pgpartitions import PARTITIONED
from outboxer.stores.postgres import PostgresStore
from outboxer.stores.sqlfiles import migrations, render, statements
from outboxer.stores.sqlite import SqliteStore
from tests.conftest import mysql_connect

DEST = "d"

#: (name, key, status, attempts, due seconds from now, lease seconds from now or None,
#: published) -- every status an earlier version's relay left behind.
ROWS = [
    ("pending-a1", "a", "PENDING", 0, -1, None, False),
    ("pending-a2", "a", "PENDING", 0, -1, None, False),
    ("failed-due", "b", "FAILED", 1, -1, None, False),
    ("failed-later", "c", "FAILED", 1, 3600, None, False),
    ("dead-relay", "e", "PROCESSING", 0, -1, -60, False),
    ("behind-dead", "e", "PENDING", 0, -1, None, False),
    ("old-relay-holds", "f", "PROCESSING", 0, -1, 3600, False),
    ("behind-held", "f", "PENDING", 0, -1, None, False),
    ("published", "g", "PUBLISHED", 1, -1, None, True),
    ("abandoned", None, "ABANDONED", 5, -1, None, False),
    ("keyless", None, "PENDING", 0, -1, None, False),
]
#: Published after the upgrade, in this order for each key; the others stay as they were.
TO_PUBLISH = {"pending-a1", "pending-a2", "failed-due", "dead-relay", "behind-dead", "keyless"}
UNCHANGED = {"failed-later", "old-relay-holds", "behind-held", "published", "abandoned"}


def _levels(dialect: str, layout: str | None = None) -> list[int]:
    return [m.version for m in migrations(dialect, layout)][:-1]


def _ids() -> dict[str, str]:
    return {name: str(uuid.uuid4()) for name, *_ in ROWS}


# ----- an earlier version's schema, by dialect ----------------------------------------------


def _old_schema_postgres(
    store: PostgresStore, level: int, ids: dict[str, str], layout: str | None = None
) -> None:
    tokens = store.tokens()
    with psycopg.connect(store.url) as conn:
        conn.execute(render(store.migrations_table_sql, tokens))
        for migration in migrations("postgres", layout):
            if migration.version <= level:
                conn.execute(render(migration.sql, tokens))
                conn.execute(
                    f"INSERT INTO {tokens['migrations']} (version, name) VALUES (%s, %s)",
                    (migration.version, migration.name),
                )
        for name, key, status, attempts, due, lease, published in ROWS:
            conn.execute(
                f"INSERT INTO {tokens['outbox']} (id, destination, topic, key, payload, "
                "content_type, status, attempts, next_attempt_at, locked_by, locked_until, "
                "published_at) VALUES (%s, %s, 't', %s, %s, 'text/plain', %s, %s, "
                "now() + make_interval(secs => %s), %s, "
                "now() + make_interval(secs => %s), CASE WHEN %s THEN now() END)",
                (
                    ids[name],
                    DEST,
                    key,
                    name.encode(),
                    status,
                    attempts,
                    due,
                    "old-relay" if lease is not None else None,
                    lease,
                    published,
                ),
            )


def _old_schema_mysql(store: MySQLStore, level: int, ids: dict[str, str]) -> None:
    tokens = store.tokens()
    conn = mysql_connect(store.url, autocommit=True)
    try:
        cursor = conn.cursor()
        for statement in statements(render(store.migrations_table_sql, tokens)):
            cursor.execute(statement)
        for migration in migrations("mysql"):
            if migration.version <= level:
                for statement in statements(render(migration.sql, tokens)):
                    cursor.execute(statement)
                cursor.execute(
                    f"INSERT INTO {tokens['migrations']} (version, name) VALUES (%s, %s)",
                    (migration.version, migration.name),
                )
        for name, key, status, attempts, due, lease, published in ROWS:
            cursor.execute(
                f"INSERT INTO {tokens['outbox']} (id, destination, topic, `key`, payload, "
                "content_type, status, attempts, next_attempt_at, locked_by, locked_until, "
                "published_at) VALUES (%s, %s, 't', %s, %s, 'text/plain', %s, %s, "
                "UTC_TIMESTAMP(6) + INTERVAL %s SECOND, %s, "
                "UTC_TIMESTAMP(6) + INTERVAL %s SECOND, IF(%s, UTC_TIMESTAMP(6), NULL))",
                (
                    ids[name],
                    DEST,
                    key,
                    name.encode(),
                    status,
                    attempts,
                    due,
                    "old-relay" if lease is not None else None,
                    lease,
                    published,
                ),
            )
    finally:
        conn.close()


def _old_schema_sqlite(store: SqliteStore, level: int, ids: dict[str, str]) -> None:
    tokens = store.tokens()
    conn = sqlite3.connect(store.path, isolation_level=None)
    try:
        for statement in statements(render(store.migrations_table_sql, tokens)):
            conn.execute(statement)
        for migration in migrations("sqlite"):
            if migration.version <= level:
                for statement in statements(render(migration.sql, tokens)):
                    conn.execute(statement)
                conn.execute(
                    f"INSERT INTO {tokens['migrations']} (version, name) VALUES (?, ?)",
                    (migration.version, migration.name),
                )
        now = time.time()
        for name, key, status, attempts, due, lease, published in ROWS:
            conn.execute(
                f"INSERT INTO {tokens['outbox']} (id, destination, topic, key, payload, "
                "content_type, status, attempts, next_attempt_at, locked_by, locked_until, "
                "published_at) VALUES (?, ?, 't', ?, ?, 'text/plain', ?, ?, ?, ?, ?, ?)",
                (
                    ids[name],
                    DEST,
                    key,
                    name.encode(),
                    status,
                    attempts,
                    now + due,
                    "old-relay" if lease is not None else None,
                    now + lease if lease is not None else None,
                    now if published else None,
                ),
            )
    finally:
        conn.close()


# ----- after the upgrade ----------------------------------------------------------------------


async def _drain(store: Store) -> list[str]:
    """Claim and publish until nothing is due; the payloads (row names) in publish order."""
    published: list[str] = []
    for _ in range(20):
        claim = await store.claim(DEST, "new-relay", 100, 30.0, False, max_attempts=5)
        if not claim:
            return published
        published += [m.payload.decode() for m in claim]
        result = await store.settle(
            DEST, claim.lease, [m.seq for m in claim if m.seq is not None], [], [], 5
        )
        assert result.published == len(claim)
    raise AssertionError(f"still claiming after 20 claims: {published}")


async def _upgrade_and_drain(store: Store, ids: dict[str, str]) -> None:
    before = await store.list_messages(
        ["PENDING", "FAILED", "PROCESSING", "PUBLISHED", "ABANDONED"], 100
    )
    await store.apply_schema()
    await store.check_schema()
    published = await _drain(store)
    assert sorted(published) == sorted(TO_PUBLISH), published
    for first, later in (("pending-a1", "pending-a2"), ("dead-relay", "behind-dead")):
        assert published.index(first) < published.index(later), published
    after = {
        str(row["id"]): row
        for row in await store.list_messages(
            ["PENDING", "FAILED", "PROCESSING", "PUBLISHED", "ABANDONED"], 100
        )
    }
    assert len(after) == len(ROWS)
    old = {str(row["id"]): row for row in before}
    for name in UNCHANGED:
        row, was = after[ids[name]], old[ids[name]]
        assert (row["status"], row["attempts"]) == (was["status"], was["attempts"]), name
    for name in TO_PUBLISH:
        assert after[ids[name]]["status"] == "PUBLISHED", name


@pytest.mark.parametrize("level", _levels("postgres"))
def test_postgres_upgrade_from_every_level(pg_url: str, level: int) -> None:
    ids = _ids()
    store = PostgresStore(pg_url, schema=f"level{level}", table="outbox")
    _old_schema_postgres(store, level, ids)

    async def run() -> None:
        async with store:
            await _upgrade_and_drain(store, ids)

    asyncio.run(run())


@pytest.mark.parametrize("level", _levels("postgres", PARTITIONED))
def test_postgres_partitioned_upgrade_from_every_level(pg_url: str, level: int) -> None:
    ids = _ids()
    store = PostgresStore(pg_url, schema=f"level{level}", table="outbox")
    _old_schema_postgres(store, level, ids, PARTITIONED)

    async def run() -> None:
        async with store:
            await _upgrade_and_drain(store, ids)
            assert await store.layout() == PARTITIONED

    asyncio.run(run())


@pytest.mark.parametrize("level", _levels("mysql"))
def test_mysql_upgrade_from_every_level(mysql_empty_url: str, level: int) -> None:
    ids = _ids()
    store = create_store(mysql_empty_url, table=f"level{level}")
    assert isinstance(store, MySQLStore)
    _old_schema_mysql(store, level, ids)

    async def run() -> None:
        async with store:
            await _upgrade_and_drain(store, ids)

    asyncio.run(run())


@pytest.mark.parametrize("level", _levels("sqlite"))
def test_sqlite_upgrade_from_every_level(tmp_path: Any, level: int) -> None:
    ids = _ids()
    store = create_store(f"sqlite:///{tmp_path / 'old.db'}")
    assert isinstance(store, SqliteStore)
    _old_schema_sqlite(store, level, ids)

    async def run() -> None:
        async with store:
            await _upgrade_and_drain(store, ids)

    asyncio.run(run())


def _half_applied_cases() -> list[tuple[int, int]]:
    """(version, statements of it that ran) where a MySQL migration can stop half way
    (its DDL committed statement by statement, its version not recorded): after its first
    statement, and before its last."""
    return [
        (migration.version, done)
        for migration in migrations("mysql")
        for done in sorted({1, len(statements(migration.sql)) - 1} - {0})
    ]


@pytest.mark.parametrize(("version", "done"), _half_applied_cases())
def test_mysql_apply_completes_a_migration_stopped_half_way(
    mysql_empty_url: str, version: int, done: int
) -> None:
    """README: a run that stopped half way is completed by the next `schema apply`."""
    ids = _ids()
    store = create_store(mysql_empty_url, table=f"half{version}_{done}")
    assert isinstance(store, MySQLStore)
    if version > 1:
        _old_schema_mysql(store, version - 1, ids)
    tokens = store.tokens()
    conn = mysql_connect(store.url, autocommit=True)
    try:
        if version == 1:
            for statement in statements(render(store.migrations_table_sql, tokens)):
                conn.cursor().execute(statement)
        [migration] = [m for m in migrations("mysql") if m.version == version]
        for statement in statements(render(migration.sql, tokens))[:done]:
            conn.cursor().execute(statement)
    finally:
        conn.close()

    async def run() -> None:
        async with store:
            applied = await store.apply_schema()
            assert applied[0] == migration.name
            await store.check_schema()
            if version > 1:
                published = await _drain(store)
                assert sorted(published) == sorted(TO_PUBLISH)

    asyncio.run(run())


def test_postgres_upgrade_while_writers_enqueue(pg_url: str) -> None:
    """`schema apply` from level 5 (its ALTER TABLE and index builds wait for the writers'
    transactions, and they for it) while writers enqueue: no writer fails, every message
    is kept and claimed in its key's order."""
    store = PostgresStore(pg_url, schema="live", table="outbox")
    _old_schema_postgres(store, 5, _ids())
    outbox = Outbox(schema="live", table="outbox", destinations=(DEST,))
    written: dict[str, list[uuid.UUID]] = {}
    errors: list[BaseException] = []
    stop = threading.Event()
    started = threading.Barrier(5)

    def write(key: str) -> None:
        ids = written.setdefault(key, [])
        with psycopg.connect(pg_url) as conn:
            started.wait()
            while not stop.is_set() or len(ids) < 20:
                try:
                    with conn.transaction():
                        ids.append(outbox.enqueue(conn, "t", b"w", key=key).id)
                except Exception as exc:  # every failure is the finding
                    errors.append(exc)
                    return

    writers = [threading.Thread(target=write, args=(f"w{n}",)) for n in range(4)]
    for writer in writers:
        writer.start()

    async def run() -> None:
        async with store:
            started.wait()
            await store.apply_schema()
            stop.set()
            for writer in writers:
                await asyncio.to_thread(writer.join)
            assert not errors, errors
            claimed: list[uuid.UUID] = []
            while claim := await store.claim(DEST, "new-relay", 1000, 30.0, False):
                claimed += [m.id for m in claim]
                await store.settle(DEST, claim.lease, [m.seq for m in claim if m.seq], [], [], 5)
            for key, ids in written.items():
                assert [i for i in claimed if i in set(ids)] == ids, key

    asyncio.run(run())


def _record_future_version(store: Store) -> None:
    """What a newer outboxer's `schema apply` leaves: a version this one does not know."""
    table = store.tokens()["migrations"]
    insert = f"INSERT INTO {table} (version, name) VALUES (9999, '9999_from_the_future')"
    if isinstance(store, PostgresStore):
        with psycopg.connect(store.url) as conn:
            conn.execute(insert)
    elif isinstance(store, MySQLStore):
        conn = mysql_connect(store.url, autocommit=True)
        try:
            conn.cursor().execute(insert)
        finally:
            conn.close()
    else:
        assert isinstance(store, SqliteStore)
        with contextlib.closing(sqlite3.connect(store.path)) as lite, lite:
            lite.execute(insert)


@pytest.mark.parametrize("dialect", ["postgres", "mysql", "sqlite"])
def test_relay_check_refuses_an_older_schema_and_accepts_a_newer_one(
    dialect: str, request: pytest.FixtureRequest, tmp_path: Any
) -> None:
    ids = _ids()
    if dialect == "postgres":
        store: Store = PostgresStore(request.getfixturevalue("pg_url"), schema="checked")
        assert isinstance(store, PostgresStore)
        _old_schema_postgres(store, _levels("postgres")[-1], ids)
    elif dialect == "mysql":
        store = create_store(request.getfixturevalue("mysql_empty_url"), table="checked")
        assert isinstance(store, MySQLStore)
        _old_schema_mysql(store, _levels("mysql")[-1], ids)
    else:
        store = create_store(f"sqlite:///{tmp_path / 'checked.db'}")
        assert isinstance(store, SqliteStore)
        _old_schema_sqlite(store, _levels("sqlite")[-1], ids)
    last = migrations(dialect)[-1].name

    async def run() -> None:
        async with store:
            with pytest.raises(
                SchemaError, match=rf"lacks migration\(s\) {last}: run `outboxer schema apply`"
            ):
                await store.check_schema()
            await store.apply_schema()
            _record_future_version(store)
            await store.check_schema()
            assert await store.apply_schema() == []

    asyncio.run(run())
