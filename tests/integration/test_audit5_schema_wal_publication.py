"""Audit 5, schema lifecycle: the WAL outbox's `apply_schema` (``stream-relay
--apply-schema``) while another one creates the publication. It looked for the publication,
then created it: two started at once (a stream relay per destination, deployed together)
both found none, and the second failed with a duplicate key of pg_publication."""

from __future__ import annotations

import asyncio

import psycopg

from outboxer.stores.pgwal import PUBLICATION, PgWal


async def _until_a_session_waits_for_a_lock(url: str, task: asyncio.Task[list[str]]) -> None:
    """Until another session of the database waits for a lock (the apply's CREATE)."""
    with psycopg.connect(url, autocommit=True) as watcher:
        for _ in range(500):
            assert not task.done(), "the apply ended without waiting"
            waiting = watcher.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND wait_event_type = 'Lock'"
            ).fetchone()
            if waiting and waiting[0]:
                return
            await asyncio.sleep(0.01)
    raise AssertionError("the apply never waited for the other's commit")


def test_publication_created_meanwhile_by_another_apply(pg_url: str) -> None:
    with psycopg.connect(pg_url) as other:
        # The other apply created it and has not committed yet: this apply's look finds
        # nothing, its CREATE waits for the other's commit.
        other.execute(f"CREATE PUBLICATION {PUBLICATION}")

        async def run() -> list[str]:
            wal = PgWal(pg_url)
            try:
                applying = asyncio.create_task(wal.apply_schema())
                await _until_a_session_waits_for_a_lock(pg_url, applying)
                other.commit()
                return await applying
            finally:
                await wal.close()

        applied = asyncio.run(run())
    assert applied == ["0001_stream"]
    with psycopg.connect(pg_url) as conn:
        found = conn.execute(
            "SELECT count(*) FROM pg_publication WHERE pubname = %s", (PUBLICATION,)
        ).fetchone()
    assert found == (1,)
