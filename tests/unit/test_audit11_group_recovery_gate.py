"""RecoveryGate of several databases: a claim of one database that hangs (its database
stopped answering) holds up no other database's recovery, and what it brings back late is
never held beside a recovered row."""

from __future__ import annotations

import asyncio

from outboxer.relay import HeldBatch, RecoveryGate
from outboxer.stores import Claim, Lease
from outboxer.testing import make_message

LEASE = Lease("relay", "token")


def batch(*, recovered: bool = False, waiting: bool = False, empty: bool = False) -> Claim:
    messages = [] if empty else [make_message("t")]
    return Claim(messages, lease=LEASE, recovered=recovered, recovery_waiting=waiting)


async def test_a_hung_claim_holding_the_recovery_slot_gives_it_up() -> None:
    gate = RecoveryGate(asyncio.Event(), parks=True)
    hung = HeldBatch("hung", recovered=False)
    assert await gate.enter_claim("hung") is True  # holds the slot; its database hangs
    assert await gate.enter_claim("up") is False
    gate.claimed(batch(waiting=True, empty=True), recover=False, database="up")
    draining = asyncio.create_task(gate.enter_claim("up"))
    await asyncio.sleep(0)
    assert not draining.done(), "up waits for the recovery slot"
    gate.park_claim(hung, recover=True)
    assert await asyncio.wait_for(draining, 1) is True, "up recovers its row"
    assert gate.claimed(batch(recovered=True), recover=True, database="up") is True
    await asyncio.wait_for(gate.alone(), 1)
    # The hung claim answers at last, a recovered row of its own: never held beside up's.
    assert gate.claimed(batch(recovered=True), recover=True, database="hung", claim=hung) is False
    gate.settled(recovered=False, database="hung")
    assert gate.recovering, "up's recovered row is still held"
    gate.settled(recovered=True, database="up")
    assert not gate.recovering and gate.held == 0 and gate.active() == 0
    assert await asyncio.wait_for(gate.enter_claim("hung"), 1) is True


async def test_a_recovered_row_waits_for_no_hung_claim_of_another_database() -> None:
    gate = RecoveryGate(asyncio.Event(), parks=True)
    assert await gate.enter_claim("up") is True
    hung = HeldBatch("hung", recovered=False)
    assert await gate.enter_claim("hung") is False  # under way; its database hangs
    assert gate.claimed(batch(recovered=True), recover=True, database="up") is True
    alone = asyncio.create_task(gate.alone())
    await asyncio.sleep(0)
    assert not alone.done(), "a claim under way is waited for until taken for hung"
    gate.park_claim(hung, recover=False)
    await asyncio.wait_for(alone, 1)
    assert gate.claimed(batch(), recover=False, database="hung", claim=hung) is False
    gate.settled(recovered=False, database="hung")
    gate.settled(recovered=True, database="up")
    assert gate.held == 0 and gate.active() == 0


async def test_a_hung_claim_answering_when_no_recovery_is_under_way_publishes() -> None:
    gate = RecoveryGate(asyncio.Event(), parks=True)
    hung = HeldBatch("slow", recovered=False)
    assert await gate.enter_claim("slow") is True
    gate.park_claim(hung, recover=True)
    gate.park_claim(hung, recover=True)  # once only
    assert gate.claimed(batch(recovered=True), recover=True, database="slow", claim=hung) is True
    assert gate.recovering and not hung.parked and gate.active() == 1
    gate.settled(recovered=True, database="slow")
    assert gate.held == 0 and not gate.recovering


async def test_a_relay_alone_takes_no_claim_for_hung() -> None:
    gate = RecoveryGate(asyncio.Event())
    hung = HeldBatch("default", recovered=False)
    assert await gate.enter_claim() is True
    gate.park_claim(hung, recover=True)
    assert not hung.parked and await gate.enter_claim() is False, "its slot is kept"
