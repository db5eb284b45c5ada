"""PostgreSQL, both layouts: an operator's requeue and purge over the same rows, each chosen as
the deadlock's victim in turn, are tried again whole and complete, each row counted once.

Each statement locks its rows in its plan's order: a requeue of every ABANDONED row walks
status_idx (status, updated_at, seq), a purge by ids the heap. A row abandoned late that was
written early lies before, in the heap, a row written later but abandoned earlier: the two
commands lock the pair in opposite orders, and PostgreSQL broke the cycle by failing one of
them (40P01). The operator saw `outboxer: DeadlockDetectedError: deadlock detected ...`
(exit 1), or a 503 from the HTTP API, and nothing of that command was done.

The interleaving is forced, not timed: a third session holds a row that the first command
reaches between the two it shares with the second, so the first stops there holding one of
them; the second then locks the other and waits for the first. Released, the first asks for
the second's row: the second, which waited first, is the one the server fails. Each test
checks that it was (the store's retry logged it), and that it then completed.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg
import pytest

from outboxer import admin
from outboxer.admin import MessageFilter
from outboxer.stores import Store, create_store
from tests.integration.test_audit18_deadlock_pg_claim_renew import lock_waiters, wait_until

#: PUBLISHED rows of a first attempt (not in status_idx): with them, and the statistics,
#: the planner walks status_idx for a requeue of the ABANDONED rows, as on a real outbox.
FILLERS = 200


@pytest.fixture(params=["pg_url", "pg_partitioned_url"])
def url(request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue(request.param))


async def outbox_rows(url: str, rows: list[tuple[str, str, int]]) -> dict[str, uuid.UUID]:
    """FILLERS rows, then ``rows`` (key, status, hours since its last change) in this order
    in the heap, their ids ascending in that order too (an index scan of the primary key
    meets them as the heap does); the statistics brought up to date. Each key's id."""
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(
            """
            INSERT INTO outboxer.outbox (id, destination, topic, key, payload, content_type,
                                         status)
            SELECT gen_random_uuid(), 'default', 'filler', 'f' || n, '\\x00',
                   'application/octet-stream', 'PUBLISHED'
            FROM generate_series(1, $1) AS n
            """,
            FILLERS,
        )
        ids = sorted(uuid.uuid4() for _ in rows)
        for (key, status, hours), row_id in zip(rows, ids, strict=True):
            await conn.execute(
                """
                INSERT INTO outboxer.outbox (id, destination, topic, key, payload, content_type,
                                             status, attempts, updated_at)
                VALUES ($1, 'default', 't', $2, '\\x00', 'application/octet-stream', $3, 3,
                        now() - make_interval(hours => $4))
                """,
                row_id,
                key,
                status,
                hours,
            )
        await conn.execute("ANALYZE outboxer.outbox")
        return {key: row_id for (key, _, _), row_id in zip(rows, ids, strict=True)}
    finally:
        await conn.close()


async def statuses(url: str) -> dict[str, str]:
    """The status of every row but the fillers, by key."""
    conn = await asyncpg.connect(url)
    try:
        rows = await conn.fetch("SELECT key, status FROM outboxer.outbox WHERE topic = 't'")
    finally:
        await conn.close()
    return {row["key"]: row["status"] for row in rows}


async def crossed(
    url: str,
    held: uuid.UUID,
    first: Callable[[Store], Awaitable[Any]],
    second: Callable[[Store], Awaitable[Any]],
) -> tuple[Any, Any]:
    """Run ``first`` (on a store of its own) while a third session holds row ``held``; once
    it waits for it, ``second`` (on another store), until it waits for ``first``; then let
    the held row go. Both answers."""
    watcher = await asyncpg.connect(url)
    holder = await asyncpg.connect(url)
    stores = [create_store(url), create_store(url)]
    tasks: list[asyncio.Task[Any]] = []
    holding = holder.transaction()
    try:
        for store in stores:
            await store.connect()
        await holding.start()
        await holder.execute("SELECT 1 FROM outboxer.outbox WHERE id = $1 FOR UPDATE", held)
        for waiters, call, store in ((1, first, stores[0]), (2, second, stores[1])):
            tasks.append(asyncio.create_task(call(store)))

            async def waiting(waiters: int = waiters) -> bool:
                for task in tasks:
                    assert not task.done(), task  # a failure now: its traceback
                return await lock_waiters(watcher) >= waiters

            await wait_until(waiting, f"{len(tasks)} command(s) never waited")
        await holding.rollback()
        done = await asyncio.wait_for(asyncio.gather(*tasks), 8)
        return done[0], done[1]
    finally:
        if not holder.is_closed():
            await holder.close()  # rolls back whatever it still holds
        await asyncio.gather(*tasks, return_exceptions=True)
        for store in stores:
            await store.close()
        await watcher.close()


def retried(caplog: pytest.LogCaptureFixture, name: str) -> int:
    """How many times the store said ``name`` was a deadlock's victim."""
    return sum(
        f"PostgreSQL: {name} chosen as a deadlock's victim" in record.getMessage()
        for record in caplog.records
    )


async def test_a_purge_chosen_as_the_victim_of_a_requeue_is_tried_again(
    url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="outboxer.store")
    # Heap: y, z, x. The requeue's order (last change): x, z, y; the purge's (heap): y, x.
    ids = await outbox_rows(
        url, [("y", "ABANDONED", 1), ("z", "ABANDONED", 2), ("x", "ABANDONED", 3)]
    )
    # The requeue locks x and waits for z (held); the purge deletes y and waits for x; z
    # released, the requeue asks for y: a deadlock, and the purge waited first.
    requeued, purged = await crossed(
        url,
        ids["z"],
        lambda store: admin.requeue(store, MessageFilter(), destinations=["default"]),
        lambda store: admin.purge(store, MessageFilter(ids=(ids["y"], ids["x"]))),
    )
    assert retried(caplog, "a purge") == 1, "the purge was the deadlock's victim"
    assert (requeued.count, requeued.deferred) == (3, 0)
    # Tried again after the requeue committed: it deletes y and x, PENDING now, once each.
    assert purged.count == 2
    assert await statuses(url) == {"z": "PENDING"}


async def test_a_requeue_chosen_as_the_victim_of_a_purge_is_tried_again(
    url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="outboxer.store")
    # Heap: y, w, x, v. The purge's order (heap): y, w, x; the requeue's (last change): x, y, v.
    ids = await outbox_rows(
        url,
        [
            ("y", "ABANDONED", 2),
            ("w", "PUBLISHED", 4),
            ("x", "ABANDONED", 3),
            ("v", "ABANDONED", 1),
        ],
    )
    # The purge deletes y and waits for w (held); the requeue locks x and waits for y; w
    # released, the purge asks for x: a deadlock, and the requeue waited first.
    purged, requeued = await crossed(
        url,
        ids["w"],
        lambda store: admin.purge(store, MessageFilter(ids=(ids["y"], ids["w"], ids["x"]))),
        lambda store: admin.requeue(store, MessageFilter(), destinations=["default"]),
    )
    assert retried(caplog, "a requeue") == 1, "the requeue was the deadlock's victim"
    assert purged.count == 3
    # Tried again after the purge committed: only v is left to requeue.
    assert (requeued.count, requeued.deferred) == (1, 0)
    assert await statuses(url) == {"v": "PENDING"}


async def test_a_requeue_by_destination_chosen_as_a_deadlocks_victim_is_tried_again(
    pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Store.requeue (the older call: destinations, statuses, ids), as admin's requeue."""
    caplog.set_level(logging.INFO, logger="outboxer.store")
    ids = await outbox_rows(
        pg_url,
        [
            ("y", "ABANDONED", 2),
            ("w", "PUBLISHED", 4),
            ("x", "ABANDONED", 3),
            ("v", "ABANDONED", 1),
        ],
    )
    purged, requeued = await crossed(
        pg_url,
        ids["w"],
        lambda store: admin.purge(store, MessageFilter(ids=(ids["y"], ids["w"], ids["x"]))),
        lambda store: store.requeue(["default"], ["ABANDONED"], None),
    )
    assert retried(caplog, "a requeue") == 1, "the requeue was the deadlock's victim"
    assert (purged.count, requeued) == (3, 1)
    assert await statuses(pg_url) == {"v": "PENDING"}
