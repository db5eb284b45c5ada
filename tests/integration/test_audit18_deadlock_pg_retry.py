"""PostgreSQL: a settle, a lease renewal or a claim that the server chose as a deadlock's
victim (40P01) is tried again by the store, as MySQL's are (1213).

The relay's own statements no longer form a lock cycle (migration 0014; see
test_audit18_deadlock_pg_claim_renew), but someone else's transaction that locks in another
order still can: an operator's session holding a row of a batch in flight, then asking for a
row the settle (or renewal) has locked meanwhile. The victim's statement is one transaction,
rolled back whole, and nothing outside the database happened inside it: trying it again is
safe. Raised to the relay, it was taken for an outage and backed off; a settle's rows stayed
leased meanwhile, and a back-off longer than the lease had them recovered and published
again (duplicates), each charged an attempt.

Each deadlock is made for real: the store's statement waits first, so its deadlock check
(deadlock_timeout after its wait began) is the one that finds the cycle and fails it; the
operator's statement then gets its lock, which shows the store's statement was the victim.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg

import outboxer
from outboxer.stores.base import Failure, Lease
from outboxer.stores.postgres import PostgresStore
from tests.integration.test_audit18_deadlock_pg_claim_renew import (
    insert_row,
    lock_waiters,
    wait_until,
)

RELAY = "stalled-relay"  # insert_row's locked_by for leased rows


async def _deadlock(
    url: str,
    first: tuple[str, tuple[Any, ...]],
    then: tuple[str, tuple[Any, ...]],
    store_call: Callable[[PostgresStore], Awaitable[Any]],
) -> Any:
    """Run ``store_call`` while an operator's transaction holds what ``first`` locks, then,
    once the store's statement waits for it, let the operator run ``then`` (waiting for what
    the store's statement holds): a deadlock. The store's answer, once the operator's
    transaction, granted its lock (the store's statement was the victim), rolled back."""
    # The operator's deadlock check runs deadlock_timeout after its wait began: a long one
    # leaves the check to the store's statement, whatever the box's load (with both at 1 s
    # a store statement descheduled for a second had the operator's check find the cycle
    # first: CI, once, 4 workers).
    operator = await asyncpg.connect(url, server_settings={"deadlock_timeout": "60s"})
    watcher = await asyncpg.connect(url)
    store = outboxer.create_store(url)
    assert isinstance(store, PostgresStore)
    call: asyncio.Task[Any] | None = None
    transaction = operator.transaction()
    try:
        await store.connect()
        await transaction.start()
        await operator.execute(first[0], *first[1])
        call = asyncio.create_task(store_call(store))

        async def store_waits() -> bool:
            assert call is not None
            assert not call.done(), call
            return await lock_waiters(watcher) >= 1

        await wait_until(store_waits, "the store's statement never waited for the operator")
        try:
            await asyncio.wait_for(operator.execute(then[0], *then[1]), 5)
        except asyncpg.DeadlockDetectedError as exc:  # pragma: no cover - a stalled box
            raise AssertionError(
                "the operator's statement, not the store's, was the deadlock's victim: it "
                "began to wait more than deadlock_timeout after the store's"
            ) from exc
        await transaction.rollback()
        return await asyncio.wait_for(call, 5)
    finally:
        if not operator.is_closed():
            await operator.close()  # rolls back whatever it still holds
        if call is not None:
            await asyncio.gather(call, return_exceptions=True)
        await store.close()
        await watcher.close()


async def _rows(url: str) -> dict[int, tuple[str, int]]:
    conn = await asyncpg.connect(url)
    try:
        return {
            row["seq"]: (row["status"], row["attempts"])
            for row in await conn.fetch("SELECT seq, status, attempts FROM outboxer.outbox")
        }
    finally:
        await conn.close()


async def _leased_batch(url: str, rows: int) -> tuple[Lease, list[int]]:
    """``rows`` rows in flight under one live lease of RELAY, in seq order."""
    lease = uuid.uuid4()
    conn = await asyncpg.connect(url)
    try:
        seqs = [
            await insert_row(conn, key=None, status="PROCESSING", lease=lease, expired=False)
            for _ in range(rows)
        ]
    finally:
        await conn.close()
    return Lease(RELAY, str(lease)), seqs


async def test_a_settle_chosen_as_a_deadlocks_victim_is_tried_again(pg_url: str) -> None:
    lease, (published, failed) = await _leased_batch(pg_url, 2)
    lock_row = "SELECT 1 FROM outboxer.outbox WHERE seq = $1 FOR UPDATE"
    # The settle marks `published` first (it locks it), then waits for `failed`, which the
    # operator holds; the operator then asks for `published`.
    result = await _deadlock(
        pg_url,
        (lock_row, (failed,)),
        (lock_row, (published,)),
        lambda store: store.settle(
            "default", lease, [published], [Failure(failed, "refused", 0.0, False)], [], 3
        ),
    )
    assert (result.published, result.failed, result.released, result.lost) == (1, 1, 0, 0)
    rows = await _rows(pg_url)
    assert rows[published] == ("PUBLISHED", 0)
    assert rows[failed] == ("FAILED", 1)


async def test_a_renewal_chosen_as_a_deadlocks_victim_is_tried_again(pg_url: str) -> None:
    lease, (first, second) = await _leased_batch(pg_url, 2)
    lock_row = "SELECT 1 FROM outboxer.outbox WHERE seq = $1 FOR UPDATE"
    # The renewal locks its rows in seq order: `first`, then it waits for `second`.
    renewed = await _deadlock(
        pg_url,
        (lock_row, (second,)),
        (lock_row, (first,)),
        lambda store: store.renew("default", lease, [first, second], 60),
    )
    assert renewed == 2


async def test_a_claim_chosen_as_a_deadlocks_victim_is_tried_again(pg_url: str) -> None:
    conn = await asyncpg.connect(pg_url)
    try:
        pending = await insert_row(conn, key="k", status="PENDING")
    finally:
        await conn.close()
    key = outboxer.create_store(pg_url).lock_key("default")
    # Every outboxer session takes a destination lock before any lock on the table; this
    # one takes them in the other order: the claim holds the destination lock and waits
    # for the table, then the operator waits for the destination lock.
    claim = await _deadlock(
        pg_url,
        ("LOCK TABLE outboxer.outbox IN SHARE MODE", ()),
        ("SELECT pg_advisory_xact_lock_shared($1)", (key,)),
        lambda store: store.claim("default", "live-relay", 10, 60, True),
    )
    assert [message.seq for message in claim] == [pending]
