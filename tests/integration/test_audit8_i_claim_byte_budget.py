"""A claim's byte budget (``claim_max_bytes``): a backlog of large payloads is claimed in
batches that stop once the payloads taken reach the budget (plus one row), a payload
larger than the budget is claimed alone, and every key keeps its order. A claim used to
take ``batch_size`` rows whatever their size: 500 payloads of 20 MB in one claim, per
loop, and the relay was killed for its memory. PostgreSQL (both layouts), MariaDB and
SQLite, through the stores' claim."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Sequence

import pytest

import outboxer
from outboxer import Relay, load_settings
from outboxer.brokers.memory import memory_broker
from outboxer.message import Message
from outboxer.testing import eventually
from tests.relaying import connect_sync

BUDGET = 100_000
LARGE = 40_000


def enqueue_sized(url: str, *items: tuple[int, str | None]) -> list[Message]:
    """Commit one message per (payload size, key), in order; random bytes, so PostgreSQL
    stores the large ones out of line (TOAST) rather than compressed in the row."""
    conn = connect_sync(url)
    try:
        sent = [outboxer.enqueue(conn, "t", os.urandom(size), key=key) for size, key in items]
        conn.commit()
    finally:
        conn.close()
    return sent


async def claim_all(url: str, budget: int) -> list[list[Message]]:
    """Claim (and settle as published) until nothing is left; the batches, in order."""
    batches: list[list[Message]] = []
    async with outboxer.create_store(url) as store:
        while claim := await store.claim("default", "relay-a", 500, 60.0, False, max_bytes=budget):
            batches.append(list(claim))
            await store.settle("default", claim.lease, [m.seq for m in claim], [], [], 5)
            assert len(batches) < 50, "the claims never ended"
    return batches


def check_batches(batches: Sequence[Sequence[Message]], sent: Sequence[Message]) -> None:
    taken = [m for batch in batches for m in batch]
    # Each batch a seq-order prefix of what was left: all of them, in commit order.
    assert [m.id for m in taken] == [m.id for m in sent]
    for batch in batches:
        sizes = [len(m.payload) for m in batch]
        assert sizes and sum(sizes[:-1]) < BUDGET, f"over the budget before its last row: {sizes}"


@pytest.fixture(params=["pg_url", "pg_partitioned_url", "mysql_url", "sqlite_url"])
def url(request: pytest.FixtureRequest) -> str:
    """Each database's outbox (a sync fixture: the templates are built outside the loop)."""
    found: str = request.getfixturevalue(request.param)
    return found


async def test_a_backlog_of_large_payloads_is_claimed_within_the_budget(url: str) -> None:
    keys = ["a", "b", None, "a", "b", None, "a", "b", "a", None]
    sent = enqueue_sized(url, *((LARGE, key) for key in keys))
    batches = await claim_all(url, BUDGET)
    check_batches(batches, sent)
    # 0 + 40k + 80k < 100k: three rows a claim (120 KB, the budget plus one row).
    assert [len(batch) for batch in batches] == [3, 3, 3, 1]


async def test_a_payload_over_the_budget_is_claimed_alone(url: str) -> None:
    sent = enqueue_sized(url, (10, "k"), (3 * BUDGET, "k"), (10, "k"), (10, None), (10, "k"))
    batches = await claim_all(url, BUDGET)
    check_batches(batches, sent)
    # The small first row, then the large one, alone; then the small rest together.
    assert [[m.id for m in batch] for batch in batches] == [
        [sent[0].id, sent[1].id],
        [sent[2].id, sent[3].id, sent[4].id],
    ]


async def test_the_budget_never_lets_a_key_overtake_its_earlier_row(url: str) -> None:
    """A cut batch's rows stay in flight while the next claim runs: the rows past the cut
    of a key in flight wait for it, and unkeyed or other keys' rows go on."""
    sent = enqueue_sized(url, (LARGE, "a"), (LARGE, "b"), (LARGE, "a"), (LARGE, "a"), (10, "c"))
    async with outboxer.create_store(url) as store:
        first = await store.claim("default", "relay-a", 500, 60.0, False, max_bytes=BUDGET)
        assert [m.id for m in first] == [m.id for m in sent[:3]]
        # a's third row must wait for a's rows in flight; c's row is free.
        second = await store.claim("default", "relay-b", 500, 60.0, False, max_bytes=BUDGET)
        assert [m.id for m in second] == [sent[4].id]
        await store.settle("default", first.lease, [m.seq for m in first], [], [], 5)
        third = await store.claim("default", "relay-b", 500, 60.0, False, max_bytes=BUDGET)
        assert [m.id for m in third] == [sent[3].id]


async def test_small_messages_fill_the_batch_as_before(url: str) -> None:
    sent = enqueue_sized(url, *((100, None) for _ in range(30)))
    async with outboxer.create_store(url) as store:
        claim = await store.claim("default", "relay-a", 20, 60.0, False)  # the default budget
        assert [m.id for m in claim] == [m.id for m in sent[:20]]


async def test_the_relay_claims_again_at_once_after_a_batch_cut_by_the_budget(
    pg_url: str,
) -> None:
    """A batch the budget cut is a full batch: more is due, so the relay claims again at
    once. Taken as a short batch, it waited a poll_interval (5 s here) after each one."""
    broker = memory_broker(f"byte-budget-{uuid.uuid4().hex[:8]}")
    sent = enqueue_sized(pg_url, *((LARGE, None) for _ in range(7)))
    relay = Relay.from_settings(
        load_settings(
            {
                "db": pg_url,
                "broker": f"memory://{broker.name}",
                "poll_interval": 5.0,
                "wake_on_commit_below": 1_000_000.0,  # never "busy": waits are NOTIFY or poll
                "claim_max_bytes": BUDGET,
                "concurrency": 1,
            },
            environ={},
        )
    )
    task = asyncio.create_task(relay.run())
    try:
        await eventually(lambda: _true(len(broker.messages) == len(sent)), timeout=3)
    finally:
        relay.stop()
        await asyncio.wait_for(task, 30)
    assert [m.id for m in broker.messages] == [m.id for m in sent]


async def _true(value: bool) -> bool:
    return value
