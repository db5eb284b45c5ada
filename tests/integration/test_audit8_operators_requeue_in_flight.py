"""A requeue never puts two rows of one key in flight, on the real PostgreSQL, MariaDB and
SQLite. With ``abandoned_blocks_key`` off a key moves on past an ABANDONED row, so a later
row of its key may be in flight when an operator requeues it. Made PENDING then, the claim
took it at once (nothing of its key before it blocks it): two rows of the key in flight
together, reaching the broker interleaved or reversed. Requeue leaves such a row as it is
until the key's later rows are settled (docs/design/ordering.md)."""

from __future__ import annotations

from typing import Any

import outboxer
from outboxer import admin
from outboxer.admin import MessageFilter
from outboxer.stores.base import Failure
from tests.relaying import db, enqueue, rows  # noqa: F401 -- db is a fixture


async def _abandon_first_then_hold_second(store: Any) -> tuple[Any, Any]:
    """Key k: its first row ABANDONED, its second in flight (claimed, not settled)."""
    first = await store.claim("default", "relay-a", 1, 60.0, False)
    [head] = list(first)
    await store.settle(
        "default", first.lease, [], [Failure(head.stored_seq, "refused", 0.0, True)], [], 5
    )
    second = await store.claim("default", "relay-b", 1, 60.0, False)
    assert len(list(second)) == 1, "the key moved on past its abandoned row"
    return head, second


async def _status(url: str, message: outboxer.Message) -> object:
    return {str(row["id"]): row["status"] for row in await rows(url)}[str(message.id)]


async def test_requeue_by_filter_waits_while_a_later_row_of_its_key_is_in_flight(
    db: str,  # noqa: F811 -- the fixture
) -> None:
    sent = enqueue(db, ("t", "k"), ("t", "k"), ("t", "k"), ("t", "other"))
    async with outboxer.create_store(db) as store:
        head, second = await _abandon_first_then_hold_second(store)
        await store.settle("default", second.lease, [], [], [], 5)  # nothing yet: still held
        where = MessageFilter(keys=("k",))
        dry = await admin.requeue(store, where, destinations=["default"], dry_run=True)
        result = await admin.requeue(store, where, destinations=["default"])
        assert result.count == 0, "a later row of its key is in flight"
        assert result.deferred == 1 and dry.deferred == 1
        assert any("in flight" in line for line in result.lines())
        assert result.as_json()["deferred"] == 1
        assert await _status(db, head) == "ABANDONED"

        # No claim may take the abandoned row while the second one is in flight.
        again = await store.claim("default", "relay-c", 10, 60.0, False)
        assert [m.key for m in again] == ["other"], [m.key for m in again]

        # Once the key's in-flight row is settled, the requeue goes through, and the claim
        # then takes the requeued row before the key's waiting third row.
        [held] = list(second)
        await store.settle("default", second.lease, [held.stored_seq], [], [], 5)
        requeued = await admin.requeue(store, where, destinations=["default"])
        assert (requeued.count, requeued.deferred) == (1, 0)
        after = await store.claim("default", "relay-c", 10, 60.0, False)
        assert [m.id for m in after] == [head.id, sent[2].id]


async def test_store_requeue_by_id_waits_while_a_later_row_of_its_key_is_in_flight(
    db: str,  # noqa: F811 -- the fixture
) -> None:
    """The Django admin's "Requeue" action (Store.requeue) keeps the same rule."""
    enqueue(db, ("t", "k"), ("t", "k"))
    async with outboxer.create_store(db) as store:
        head, second = await _abandon_first_then_hold_second(store)
        assert await store.requeue(["default"], ["ABANDONED"], [str(head.id)]) == 0
        assert await _status(db, head) == "ABANDONED"
        assert list(await store.claim("default", "relay-c", 10, 60.0, False)) == []
        [held] = list(second)
        await store.settle("default", second.lease, [held.stored_seq], [], [], 5)
        assert await store.requeue(["default"], ["ABANDONED"], [str(head.id)]) == 1


async def test_requeue_of_a_key_whose_later_rows_only_wait_keeps_its_place(
    db: str,  # noqa: F811 -- the fixture
) -> None:
    """Nothing of its key in flight: the requeued row goes first, in its own place (as
    abandoned_blocks_key keeps it), and an earlier row in flight still holds it back."""
    sent = enqueue(db, ("t", "k"), ("t", "k"), ("t", "k"))
    async with outboxer.create_store(db) as store:
        first = await store.claim("default", "relay-a", 1, 60.0, True)
        [head] = list(first)
        await store.settle(
            "default", first.lease, [], [Failure(head.stored_seq, "refused", 0.0, True)], [], 5
        )
        result = await admin.requeue(store, MessageFilter(keys=("k",)), destinations=["default"])
        assert (result.count, result.deferred) == (1, 0)
        assert "deferred" not in result.as_json()
        claimed = await store.claim("default", "relay-b", 10, 60.0, True)
        assert [m.id for m in claimed] == [m.id for m in sent]


async def test_requeue_waits_on_the_partitioned_layout_too(pg_partitioned_url: str) -> None:
    enqueue(pg_partitioned_url, ("t", "k"), ("t", "k"))
    async with outboxer.create_store(pg_partitioned_url) as store:
        head, second = await _abandon_first_then_hold_second(store)
        where = MessageFilter(ids=(head.id,))
        result = await admin.requeue(store, where, destinations=["default"])
        assert (result.count, result.deferred) == (0, 1)
        assert await store.requeue(["default"], ["ABANDONED"], None) == 0
        [held] = list(second)
        await store.settle("default", second.lease, [held.stored_seq], [], [], 5)
        assert (await admin.requeue(store, where, destinations=["default"])).count == 1
