"""PostgreSQL: the rows of a claim whose answer was lost are released before the next claim
even once its lease has run out. ``command_timeout`` (60 s) cuts a claim that got no
answer after at least as long as the default lease (60 s), so the lease had always run out:
the release was skipped, and each row went to recovery alone, charged an attempt it never
made. The answer's loss is recorded as the store records it when its connection breaks
(``_unanswered``), after a claim that did commit."""

from __future__ import annotations

import asyncio

from outboxer import create_store
from outboxer.stores.postgres import PostgresStore
from tests.relaying import enqueue

LEASE = 0.2


async def test_a_lost_claims_rows_are_released_after_its_lease_ran_out(pg_url: str) -> None:
    enqueue(pg_url, ("order.placed", "k"), ("order.placed", "k"))
    store = create_store(pg_url)
    assert isinstance(store, PostgresStore)
    await store.connect()
    try:
        lost = await store.claim("default", "relay-1", 10, LEASE, False)
        assert [m.attempts for m in lost] == [0, 0]
        # Its answer lost, as _claim records it when the connection breaks mid-claim.
        store._unanswered.setdefault("default", []).append((lost.lease, False))
        await asyncio.sleep(LEASE * 2)  # the lease runs out meanwhile
        again = await store.claim("default", "relay-1", 10, 30.0, False)
        # Before: the first row recovered alone from the expired lease, an attempt counted.
        assert not again.recovered
        assert [(m.seq, m.attempts) for m in again] == [(m.seq, 0) for m in lost]
        assert store._unanswered == {}
    finally:
        await store.close()
