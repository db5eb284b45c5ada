"""RecoveryGate: a relay that holds a row recovered from an expired lease holds nothing else."""

from __future__ import annotations

import asyncio

from outboxer.relay import HeldBatch, RecoveryGate
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


# ----- one gate for the relays of several databases (outboxer.relay_group) ------------------


async def test_a_recovery_waits_for_its_own_databases_batches_only_then_holds_the_process() -> None:
    gate = RecoveryGate(asyncio.Event())
    assert await gate.enter_claim("orders") is True
    gate.claimed(batch(), recover=True, database="orders")  # a batch of orders in flight
    assert await gate.enter_claim("billing") is True, "billing holds nothing: it may recover"
    gate.claimed(batch(recovered=True), recover=True, database="billing")
    assert gate.recovering
    blocked = asyncio.create_task(gate.enter_claim("orders"))
    alone = asyncio.create_task(gate.alone())
    assert not await settles_soon(blocked), "no database claims while a recovered row is held"
    assert not await settles_soon(alone), "the orders batch claimed before is still in flight"
    gate.settled(recovered=False, database="orders")
    await asyncio.wait_for(alone, 1)
    gate.settled(recovered=True, database="billing")
    assert await asyncio.wait_for(blocked, 1) is True


async def test_a_database_draining_for_a_recovery_does_not_stop_the_others() -> None:
    gate = RecoveryGate(asyncio.Event())
    await gate.enter_claim("billing")
    gate.claimed(batch(), recover=True, database="billing")
    await gate.enter_claim("billing")
    gate.claimed(batch(waiting=True, empty=True), recover=False, database="billing")
    assert gate.draining
    billing = asyncio.create_task(gate.enter_claim("billing"))
    assert not await settles_soon(billing), "billing drains its own batch first"
    assert await asyncio.wait_for(gate.enter_claim("orders"), 1) is True, "orders claims on"
    gate.claimed(batch(), recover=True, database="orders")
    gate.settled(recovered=False, database="billing")
    assert await asyncio.wait_for(billing, 1) is True, "billing holds nothing: it recovers"


async def test_a_batch_whose_settle_waits_for_its_database_is_parked() -> None:
    gate = RecoveryGate(asyncio.Event(), parks=True)
    await gate.enter_claim("down")
    gate.claimed(batch(), recover=True, database="down")
    held = HeldBatch("down", recovered=False)
    await gate.enter_claim("up")
    gate.claimed(batch(recovered=True), recover=True, database="up")
    alone = asyncio.create_task(gate.alone())
    assert not await settles_soon(alone)
    gate.park(held)  # its database went away before the settle
    gate.park(held)  # once only
    await asyncio.wait_for(alone, 1)
    gate.settled(recovered=True, database="up")
    gate.settled(recovered=False, database="down", parked=held.parked)
    assert gate.held == 0 and gate.active() == 0


async def test_a_recovered_row_parked_lets_every_database_claim_again() -> None:
    gate = RecoveryGate(asyncio.Event(), parks=True)
    await gate.enter_claim("down")
    gate.claimed(batch(recovered=True), recover=True, database="down")
    other = asyncio.create_task(gate.enter_claim("up"))
    assert not await settles_soon(other)
    held = HeldBatch("down", recovered=True)
    gate.park(held)  # published; its settle waits for the database
    assert await asyncio.wait_for(other, 1) is True
    gate.claimed(batch(), recover=True, database="up")
    gate.settled(recovered=True, database="down", parked=True)
    assert gate.held == 1 and not gate.recovering


async def test_a_relay_alone_parks_nothing() -> None:
    gate = RecoveryGate(asyncio.Event())  # one relay's own gate
    await gate.enter_claim()
    gate.claimed(batch(recovered=True), recover=True)
    held = HeldBatch("default", recovered=True)
    gate.park(held)
    assert not held.parked and gate.recovering, "as ever: held until settled"
