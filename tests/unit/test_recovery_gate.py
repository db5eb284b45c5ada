"""RecoveryGate: a relay that holds a row recovered from an expired lease holds nothing else."""

from __future__ import annotations

import asyncio

from outboxer.relay import RecoveryGate
from outboxer.stores import Claim, Lease
from outboxer.testing import make_message

LEASE = Lease("relay", "token")


def batch(*, recovered: bool = False, waiting: bool = False, empty: bool = False) -> Claim:
    messages = [] if empty else [make_message("t")]
    return Claim(messages, lease=LEASE, recovered=recovered, recovery_waiting=waiting)


async def settles_soon(task: asyncio.Task[object]) -> bool:
    await asyncio.sleep(0.01)
    return task.done()


async def test_only_a_claim_made_while_nothing_is_held_may_recover() -> None:
    gate = RecoveryGate(asyncio.Event())
    assert await gate.enter_claim() is True, "nothing held"
    assert await gate.enter_claim() is False, "a claim under way holds its slot"
    gate.claimed(batch(), recover=True)
    gate.claimed(batch(empty=True), recover=False)  # found nothing: holds nothing
    assert gate.held == 1
    assert await gate.enter_claim() is False
    gate.claimed(batch(), recover=False)
    gate.settled(recovered=False)
    gate.settled(recovered=False)
    assert gate.held == 0 and await gate.enter_claim() is True


async def test_a_waiting_recovery_drains_the_relay_then_the_next_claim_recovers() -> None:
    gate = RecoveryGate(asyncio.Event())
    await gate.enter_claim()
    gate.claimed(batch(), recover=True)  # an ordinary batch in flight
    assert await gate.enter_claim() is False
    gate.claimed(batch(waiting=True, empty=True), recover=False)  # a row waits to be recovered
    next_claim = asyncio.create_task(gate.enter_claim())
    assert not await settles_soon(next_claim), "no claim while the relay drains"
    gate.settled(recovered=False)
    assert await next_claim is True, "drained: this claim recovers"
    gate.claimed(batch(recovered=True), recover=True)
    assert not gate.draining and gate.recovering


async def test_while_a_recovered_row_is_held_nobody_claims_and_it_publishes_alone() -> None:
    gate = RecoveryGate(asyncio.Event())
    assert await gate.enter_claim() is True
    assert await gate.enter_claim() is False  # a claim of another loop, under way meanwhile
    gate.claimed(batch(recovered=True), recover=True)
    alone = asyncio.create_task(gate.alone())
    blocked = asyncio.create_task(gate.enter_claim())
    assert not await settles_soon(alone), "the other loop's claim is still held"
    gate.claimed(batch(), recover=False)
    assert not await settles_soon(alone) and not blocked.done()
    gate.settled(recovered=False)  # the other loop's batch is settled
    await asyncio.wait_for(alone, 1)
    assert not await settles_soon(blocked), "no claim until the recovered row is settled"
    gate.settled(recovered=True)
    assert await blocked is True


async def test_a_stopping_relay_stops_waiting_to_claim() -> None:
    stopping = asyncio.Event()
    gate = RecoveryGate(stopping)
    await gate.enter_claim()
    gate.claimed(batch(recovered=True), recover=True)
    waiting = asyncio.create_task(gate.enter_claim())
    assert not await settles_soon(waiting)
    stopping.set()
    assert await asyncio.wait_for(waiting, 1) is None
