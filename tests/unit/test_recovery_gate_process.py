"""RecoveryGate across databases: one claim of the process may recover at a time, and a
recovered row waiting to be alone gives up when its relay stops."""

from __future__ import annotations

import asyncio

from outboxer.relay import RecoveryGate
from outboxer.stores import Claim, Lease
from outboxer.testing import make_message

LEASE = Lease("relay", "token")


def batch(*, recovered: bool = False, waiting: bool = False, empty: bool = False) -> Claim:
    messages = [] if empty else [make_message("t")]
    return Claim(messages, lease=LEASE, recovered=recovered, recovery_waiting=waiting)


async def test_one_settle_waking_two_draining_databases_lets_only_one_recover() -> None:
    """The deadlock of the review: db1's recovered row settles; a loop of db1 and of db2,
    both draining for a recovery, wake in one turn. Only one of them may recover."""
    gate = RecoveryGate(asyncio.Event(), parks=True)
    assert await gate.enter_claim("db1") is True
    gate.claimed(batch(recovered=True), recover=True, database="db1")
    # db2 found a row to recover while db1's recovered row was held: it drains.
    gate._waiting.add("db2")
    gate._waiting.add("db1")  # and db1 has another one waiting
    db1 = asyncio.create_task(gate.enter_claim("db1"))
    db2 = asyncio.create_task(gate.enter_claim("db2"))
    await asyncio.sleep(0.01)
    assert not db1.done() and not db2.done()
    gate.settled(recovered=True, database="db1")
    await asyncio.wait({db1, db2}, timeout=1, return_when=asyncio.FIRST_COMPLETED)
    await asyncio.sleep(0.01)
    results = [task.result() for task in (db1, db2) if task.done()]
    assert results.count(True) == 1, f"exactly one claim may recover, got {results}"
    # The recovering claim recovers its row: it is published alone, once the other
    # database's claim (if it ran) has reported back and holds nothing.
    winner, other = ("db1", "db2") if db1.done() and db1.result() else ("db2", "db1")
    gate.claimed(batch(recovered=True), recover=True, database=winner)
    other_task = db1 if other == "db1" else db2
    if other_task.done():
        assert other_task.result() is False
        gate.claimed(batch(waiting=True, empty=True), recover=False, database=other)
    await asyncio.wait_for(gate.alone(), 1)
    gate.settled(recovered=True, database=winner)
    # Now the other database recovers in turn.
    if not other_task.done():
        assert await asyncio.wait_for(other_task, 1) is True
    else:
        assert await asyncio.wait_for(gate.enter_claim(other), 1) is True
    gate.claimed(batch(recovered=True), recover=True, database=other)
    await asyncio.wait_for(gate.alone(), 1)
    gate.settled(recovered=True, database=other)
    assert gate.held == 0 and not gate.recovering and not gate.recovery_claim


async def test_two_databases_holding_nothing_may_not_both_claim_to_recover() -> None:
    gate = RecoveryGate(asyncio.Event(), parks=True)
    assert await gate.enter_claim("db1") is True
    assert await gate.enter_claim("db2") is False, "db1's claim may recover: db2's may not"
    gate.claimed(batch(), recover=False, database="db2")  # an ordinary batch of db2
    gate.claimed(batch(empty=True), recover=True, database="db1")  # nothing to recover
    assert not gate.recovery_claim
    assert await gate.enter_claim("db1") is True, "db1 holds nothing: it may recover again"


async def test_a_draining_database_waits_for_the_claim_that_may_recover_to_report() -> None:
    gate = RecoveryGate(asyncio.Event(), parks=True)
    assert await gate.enter_claim("db1") is True
    gate._waiting.add("db2")  # db2 holds nothing and waits to recover
    db2 = asyncio.create_task(gate.enter_claim("db2"))
    await asyncio.sleep(0.01)
    assert not db2.done(), "no claim of db2 until db1's recovering claim reported back"
    gate.claimed(batch(empty=True), recover=True, database="db1")  # it found nothing
    assert await asyncio.wait_for(db2, 1) is True


async def test_a_failed_recovering_claim_gives_its_slot_back() -> None:
    gate = RecoveryGate(asyncio.Event(), parks=True)
    assert await gate.enter_claim("db1") is True
    gate.claimed(None, recover=True, database="db1")
    assert not gate.recovery_claim and gate.held == 0
    assert await gate.enter_claim("db2") is True


async def test_a_recovered_row_waiting_to_be_alone_gives_up_when_its_relay_stops() -> None:
    gate = RecoveryGate(asyncio.Event(), parks=True)
    await gate.enter_claim("db1")
    gate.claimed(batch(), recover=True, database="db1")  # a batch that never settles
    assert await gate.enter_claim("db2") is True
    gate.claimed(batch(recovered=True), recover=True, database="db2")
    stopping = asyncio.Event()
    alone = asyncio.create_task(gate.alone(stopping))
    await asyncio.sleep(0.01)
    assert not alone.done()
    stopping.set()
    assert await asyncio.wait_for(alone, 1) is False
