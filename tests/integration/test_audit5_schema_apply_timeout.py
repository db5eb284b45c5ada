"""Audit 5, schema lifecycle: a PostgreSQL `schema apply` whose statement runs longer than
the relay's per-statement timeout (asyncpg's command_timeout, 60 s): an index built over a
big table (migrations 0006, 0008), or a wait for a long transaction that reads the outbox.
It ran on the relay's pool, and asyncpg cancelled it at 60 s: the upgrade rolled back with
"TimeoutError: " and no more, every time, so a big outbox could never be upgraded. Here the
pool's timeout is cut to 0.5 s to show it without waiting a minute."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import psycopg
import pytest

from outboxer.stores.postgres import PostgresStore
from outboxer.stores.sqlfiles import migrations
from tests.integration.test_audit5_schema_upgrade_levels import ROWS, _old_schema_postgres

#: The relay's per-statement timeout in this test, seconds.
SHORT = 0.5


@pytest.fixture
def short_pool_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncpg

    create_pool = asyncpg.create_pool

    def with_short_timeout(*args: Any, **kwargs: Any) -> Any:
        return create_pool(*args, **{**kwargs, "command_timeout": SHORT})

    monkeypatch.setattr(asyncpg, "create_pool", with_short_timeout)


async def _until_waiting_for_a_lock(conn: psycopg.Connection[Any], task: asyncio.Task[Any]) -> None:
    for _ in range(500):
        assert not task.done(), task
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock'"
        ).fetchone()
        if row and row[0]:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the apply never waited")


@pytest.mark.usefixtures("short_pool_timeout")
def test_upgrade_outlasting_the_relays_statement_timeout(pg_url: str) -> None:
    store = PostgresStore(pg_url, schema="big", table="outbox")
    _old_schema_postgres(store, 5, {row[0]: str(uuid.uuid4()) for row in ROWS})

    async def run() -> list[str]:
        with (
            psycopg.connect(pg_url) as reader,
            psycopg.connect(pg_url, autocommit=True) as watcher,
        ):
            # A long report reading the outbox: migration 0006's ALTER TABLE waits for it.
            reader.execute("SELECT count(*) FROM big.outbox").fetchone()
            async with store:
                applying = asyncio.create_task(store.apply_schema())
                await _until_waiting_for_a_lock(watcher, applying)
                await asyncio.sleep(SHORT * 2)  # the time it takes, past the timeout
                reader.commit()
                applied = await applying
                await store.check_schema()
                return applied

    applied = asyncio.run(run())
    assert applied == [m.name for m in migrations("postgres") if m.version > 5]
