"""PostgreSQL, both layouts: a claim never waits for a row lock, so it cannot deadlock with a
stalled relay's lease renewal.

Until migration 0014, step 1b of the claim function (a dead relay's rows behind an ABANDONED
row of their key -> FAILED) was a plain UPDATE, which waits for a row another transaction
holds, while the claim already held the rows step 1 had just locked (used-up rows of the
same expired lease, being abandoned). A renewal of that lease by its stalled holder (it takes
no destination lock, and may renew a lease that ran out as long as nobody took it over)
locks the batch's rows one by one: it held a row step 1b wanted and waited for one step 1
held. PostgreSQL broke the cycle after deadlock_timeout by failing one of them (40P01): the
claim (the relay backed off, an outage on /health) or the renewal.

The interleaving is forced, not timed: a third session holds a row of the batch that the
renewal reaches between the two, so the renewal stops there holding the first; the claim then
runs. It must finish while that row is still held (the old claim waited on the renewal
instead), and once the row is released, the renewal must finish too, without an error.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import asyncpg

import outboxer
from outboxer.stores.base import Lease

MAX_ATTEMPTS = 3
STALLED = "stalled-relay"


async def insert_row(
    conn: Any,
    *,
    key: str | None,
    status: str,
    attempts: int = 0,
    lease: uuid.UUID | None = None,
    expired: bool = True,
) -> int:
    """One outbox row of destination 'default' as the test needs it; its seq. Rows inserted
    in seq order lie in the table in that order too (the renewal's scan meets them so)."""
    return int(
        await conn.fetchval(
            """
            INSERT INTO outboxer.outbox (id, destination, topic, key, payload, content_type,
                                         status, attempts, locked_by, locked_until, lease)
            VALUES ($1, 'default', 't', $2, '\\x00', 'application/octet-stream', $3, $4,
                    CASE WHEN $5::uuid IS NOT NULL THEN $6 END,
                    CASE WHEN $5::uuid IS NOT NULL
                         THEN now() + CASE WHEN $7 THEN interval '-1 minute'
                                           ELSE interval '1 minute' END END,
                    $5)
            RETURNING seq
            """,
            uuid.uuid4(),
            key,
            status,
            attempts,
            lease,
            STALLED,
            expired,
        )
    )


async def lock_waiters(conn: Any) -> int:
    """Sessions of this database waiting for a lock."""
    return int(
        await conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
    )


async def wait_until(condition: Any, what: str, timeout: float = 5.0) -> None:
    """Poll ``condition()`` (a coroutine function) until true; fail after ``timeout``."""
    async with asyncio.timeout(timeout):
        while not await condition():
            await asyncio.sleep(0.01)
    assert await condition(), what


async def check_no_deadlock_with_a_stalled_renewal(url: str) -> None:
    setup = await asyncpg.connect(url)
    holder = await asyncpg.connect(url)
    renewer = outboxer.create_store(url)
    claimer = outboxer.create_store(url)
    renew: asyncio.Task[int] | None = None
    claim: asyncio.Task[Any] | None = None
    holding = holder.transaction()
    held = False
    try:
        lease = uuid.uuid4()
        # Key k's first row was abandoned; the stalled relay's batch (lease expired): b behind
        # it (step 1b fails it), d keyless, a of another key at its last attempt (step 1
        # abandons it).
        await insert_row(setup, key="k", status="ABANDONED", attempts=MAX_ATTEMPTS)
        b = await insert_row(setup, key="k", status="PROCESSING", lease=lease)
        d = await insert_row(setup, key=None, status="PROCESSING", lease=lease)
        a = await insert_row(
            setup, key="k2", status="PROCESSING", attempts=MAX_ATTEMPTS - 1, lease=lease
        )
        await holding.start()
        held = True
        await holder.execute("SELECT 1 FROM outboxer.outbox WHERE seq = $1 FOR UPDATE", d)
        await renewer.connect()
        await claimer.connect()

        # The stalled relay renews its whole batch: it locks b, then waits for d.
        renew = asyncio.create_task(
            renewer.renew("default", Lease(STALLED, str(lease)), [b, d, a], 60)
        )
        await wait_until(lambda: _waiting(setup, 1), "the renewal never waited for the held row")
        assert not renew.done(), renew

        claim = asyncio.create_task(
            claimer.claim("default", "live-relay", 10, 60, True, max_attempts=MAX_ATTEMPTS)
        )
        await wait_until(
            lambda: _done_or_waiting(claim, setup), "the claim neither ended nor waited"
        )
        assert claim.done(), (
            "the claim waits for a row lock the stalled relay's renewal holds (step 1b), "
            "holding the rows step 1 locked, which the renewal waits for next: a deadlock"
        )
        taken = claim.result()
        assert list(taken) == []  # b is held back by the abandoned row, d by the holder
        assert [row.seq for row in taken.abandoned] == [a]

        await holding.rollback()
        held = False
        # The renewal goes on: d, then a, which the claim abandoned (not renewed).
        assert await asyncio.wait_for(renew, 5) == 2
        rows = {
            row["seq"]: (row["status"], row["attempts"], row["lease"], row["live"])
            for row in await setup.fetch(
                "SELECT seq, status, attempts, lease, locked_until > now() AS live "
                "FROM outboxer.outbox"
            )
        }
        # b was locked by the renewal when the claim passed it over: still the stalled
        # relay's, renewed; the next claim's step 1b finds it once it expires again.
        assert rows[b] == ("PROCESSING", 0, lease, True)
        assert rows[d] == ("PROCESSING", 0, lease, True)
        assert rows[a] == ("ABANDONED", MAX_ATTEMPTS, None, None)
    finally:
        if held:
            await holding.rollback()
        for task in (renew, claim):
            if task is not None:
                await asyncio.gather(task, return_exceptions=True)
        await renewer.close()
        await claimer.close()
        await holder.close()
        await setup.close()


async def _waiting(conn: Any, sessions: int) -> bool:
    return await lock_waiters(conn) >= sessions


async def _done_or_waiting(task: asyncio.Task[Any], conn: Any) -> bool:
    # Two waiters: the renewal (for the held row) and the claim (for the renewal's row).
    return task.done() or await lock_waiters(conn) >= 2


async def test_a_claim_never_waits_for_a_stalled_relays_renewal(pg_url: str) -> None:
    await check_no_deadlock_with_a_stalled_renewal(pg_url)


async def test_partitioned_claim_never_waits_for_a_stalled_relays_renewal(
    pg_partitioned_url: str,
) -> None:
    await check_no_deadlock_with_a_stalled_renewal(pg_partitioned_url)
