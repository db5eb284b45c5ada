"""The store's ``requeue`` (the Django admin's "Requeue" action runs it) makes ABANDONED or
FAILED rows PENDING and nothing else, whatever statuses its caller passes, on the real
PostgreSQL, MariaDB and SQLite: a PROCESSING row a relay holds must stay held (made
PENDING, a second relay would publish it while the first still is), and a PUBLISHED row
must not be sent again."""

from __future__ import annotations

import outboxer
from tests.relaying import db, enqueue, rows  # noqa: F401 -- db is a fixture


async def test_requeue_changes_only_abandoned_or_failed_rows_whatever_it_is_asked(
    db: str,  # noqa: F811 -- the fixture
) -> None:
    enqueue(db, ("t", "k"), ("t", "k2"))
    async with outboxer.create_store(db) as store:
        held = await store.claim("default", "relay-a", 1, 60.0, False)
        [in_flight] = list(held)
        done = await store.claim("default", "relay-a", 1, 60.0, False)
        await store.settle("default", done.lease, [m.stored_seq for m in done], [], [], 5)

        asked = ["PENDING", "PROCESSING", "PUBLISHED", "FAILED", "ABANDONED"]
        assert await store.requeue(["default"], asked, None) == 0

        statuses = {str(row["id"]): row["status"] for row in await rows(db)}
        assert statuses[str(in_flight.id)] == "PROCESSING", "the relay still holds it"
        assert sorted(statuses.values()) == ["PROCESSING", "PUBLISHED"]
        # The holder's settle still lands: its lease was left alone.
        settled = await store.settle("default", held.lease, [in_flight.stored_seq], [], [], 5)
        assert settled.published == 1


async def test_requeue_takes_the_destination_locks_in_name_order(pg_url: str) -> None:
    """Shared destination locks taken in the caller's order could deadlock two requeues that
    name them in opposite orders (with claims queued for the exclusive locks between them).
    In name order, a requeue waiting for destination "a" holds no lock of "b" yet."""
    import asyncio

    import psycopg

    async with outboxer.create_store(pg_url) as store:
        with psycopg.connect(pg_url, autocommit=True) as holder:
            # A claim of "a" in progress: its exclusive destination lock.
            holder.execute("SELECT pg_advisory_lock(%s)", (store.lock_key("a"),))
            requeue = asyncio.create_task(store.requeue(["b", "a"], ["ABANDONED"], None))
            try:

                def waiting_backends() -> list[tuple[int, bool]]:
                    return holder.execute(
                        "SELECT objid::bigint, granted FROM pg_locks WHERE locktype = 'advisory'"
                        " AND pid <> pg_backend_pid() AND database = (SELECT oid FROM"
                        " pg_database WHERE datname = current_database())"
                    ).fetchall()

                for _ in range(200):
                    if any(not granted for _, granted in waiting_backends()):
                        break
                    await asyncio.sleep(0.01)
                locks = waiting_backends()
                assert (store.lock_key("a"), False) in locks, locks
                assert all(objid != store.lock_key("b") for objid, _ in locks), locks
            finally:
                holder.execute("SELECT pg_advisory_unlock_all()")
            assert await asyncio.wait_for(requeue, 10) == 0
