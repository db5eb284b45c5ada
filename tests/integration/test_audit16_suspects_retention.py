"""The inbox's retention and a suspect whose deaths come slower than it (real SQLite,
PostgreSQL with psycopg and asyncpg, MariaDB).

The retention deletes inbox_suspects rows whose first_seen is older than inbox_retention.
first_seen was set by a message's first recorded attempt only: a message whose consumer
died on it less often than once a retention (restarted by hand, a supervisor's long
backoff) had its row deleted between two deaths, its count started again each time, and it
was never dead-lettered. Each recorded attempt now sets first_seen (the latest attempt's
time): a row survives as long as attempts keep coming within a retention of each other, and
only a row no attempt touched for a whole retention goes.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest

from outboxer.consumer_db import DaemonThreadPool, session_factory
from outboxer.stores import create_store
from tests.integration.test_audit15_suspfollow_retention import OLD, _run, _table

DAY = 86400.0
RETENTION = 7 * DAY
GROUP = "billing"
#: kind -> (database fixture, async driver)
KINDS: dict[str, tuple[str, str | None]] = {
    "sqlite": ("sqlite_url", None),
    "postgres-psycopg": ("pg_url", None),
    "postgres-asyncpg": ("pg_url", "asyncpg"),
    "mysql": ("mysql_url", None),
}


def _dialect(kind: str) -> str:
    return kind.partition("-")[0]


def _age(kind: str, db: str, message_id: uuid.UUID) -> None:
    """The row's timestamp set 40 days back: its last attempt that long ago."""
    dialect = _dialect(kind)
    _run(
        dialect,
        db,
        f"UPDATE {_table(dialect)} SET first_seen = {OLD[dialect]} "
        f"WHERE consumer = %s AND message_id = %s",
        [(GROUP, str(message_id))],
    )


def _deaths(kind: str, db: str) -> dict[str, int]:
    dialect = _dialect(kind)
    rows = _run(dialect, db, f"SELECT message_id, deaths FROM {_table(dialect)}")
    return {str(message_id): int(deaths) for message_id, deaths in rows}


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_suspect_attempted_again_within_the_retention_keeps_its_deaths(
    kind: str, request: pytest.FixtureRequest
) -> None:
    fixture, driver = KINDS[kind]
    db: str = request.getfixturevalue(fixture)
    slow, gone = uuid.uuid4(), uuid.uuid4()

    async def cleanup() -> int:
        async with create_store(db) as store:
            return await store.cleanup_inbox(RETENTION, 100)

    async def scenario() -> None:
        pool = DaemonThreadPool(1)
        session = session_factory(db, "outboxer", is_async=driver is not None, async_driver=driver)(
            pool
        )
        await session.open()
        try:
            # Both messages' first recorded attempts, 40 days ago (the consumer died under
            # them); only ``slow`` comes again now, a death counted.
            assert await session.suspect_attempt(GROUP, slow) == 0
            assert await session.suspect_attempt(GROUP, gone) == 0
            _age(kind, db, slow)
            _age(kind, db, gone)
            assert await session.suspect_attempt(GROUP, slow) == 1
            # The retention: the row whose latest attempt is recent stays; the one no attempt
            # touched for a whole retention goes. Before: both went (first_seen kept the first
            # attempt's time), and ``slow`` started counting again from 0.
            assert await cleanup() == 1
            assert _deaths(kind, db) == {str(slow): 1}
            # Its deaths go on counting: this attempt finds 2.
            assert await session.suspect_attempt(GROUP, slow) == 2
        finally:
            await session.close()
            pool.shutdown()

    asyncio.run(asyncio.wait_for(scenario(), timeout=8))
