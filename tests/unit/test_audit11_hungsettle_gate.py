"""A settle of one of several databases that gets no answer (its database hangs: no error
before the driver's timeout, a minute, or ever) stops counting in the RecoveryGate after
HUNG_SETTLE, and is counted off once when it answers; a relay alone arms nothing for it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from outboxer import relay as relay_module
from outboxer.brokers.memory import MemoryPublisher
from outboxer.relay import HeldBatch, RecoveryGate, Relay, Settlement
from outboxer.stores import Claim, Lease
from outboxer.stores.base import SettleResult
from outboxer.testing import make_message

LEASE = Lease("relay", "token")


class HangingStore:
    """A store whose settle waits until ``answer`` is set (a database that hangs)."""

    def __init__(self) -> None:
        self.answer = asyncio.Event()
        self.sent = asyncio.Event()

    def configure_wakeups(self, **_: Any) -> None:
        pass

    async def settle(self, *_: Any) -> SettleResult:
        self.sent.set()
        await self.answer.wait()
        return SettleResult(published=1)


def relay_with(store: HangingStore, gate: RecoveryGate) -> Relay:
    return Relay(store, {"d": MemoryPublisher("memory://hung-settle-unit")}, gate=gate)  # type: ignore[arg-type]


async def parked(held: HeldBatch) -> None:
    while not held.parked:
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("recovered", [False, True])
async def test_a_hung_settle_of_several_databases_is_parked_then_counted_off_once(
    monkeypatch: pytest.MonkeyPatch, recovered: bool
) -> None:
    monkeypatch.setattr(relay_module, "HUNG_SETTLE", 0.05, raising=False)
    gate = RecoveryGate(asyncio.Event(), parks=True)
    store = HangingStore()
    relay = relay_with(store, gate)
    assert await gate.enter_claim(relay.database) is True
    batch = Claim([make_message("t")], lease=LEASE, recovered=recovered)
    assert gate.claimed(batch, recover=True, database=relay.database) is True
    assert gate.recovering is recovered
    held = HeldBatch(relay.database, recovered)
    settling = asyncio.create_task(relay._record("d", LEASE, Settlement(published=[1]), {}, held))
    await asyncio.wait_for(store.sent.wait(), 1)
    await asyncio.wait_for(parked(held), 5)  # the old code waited for a failure: never
    assert gate.active() == 0 and not gate.recovering and gate.held == 1
    await asyncio.wait_for(gate.alone(), 1)  # another database's recovered row goes on
    store.answer.set()
    assert (await asyncio.wait_for(settling, 1)) == SettleResult(published=1)
    gate.settled(recovered, relay.database, parked=held.parked)
    assert gate.held == 0 and gate.active() == 0 and not gate.recovering


async def test_a_relay_alone_arms_no_timer_per_settle(monkeypatch: pytest.MonkeyPatch) -> None:
    gate = RecoveryGate(asyncio.Event())
    store = HangingStore()
    relay = relay_with(store, gate)
    loop = asyncio.get_running_loop()
    timers: list[float] = []
    call_later = loop.call_later

    def counting(delay: float, *args: Any, **kwargs: Any) -> asyncio.TimerHandle:
        timers.append(delay)
        return call_later(delay, *args, **kwargs)

    monkeypatch.setattr(loop, "call_later", counting)
    assert await gate.enter_claim(relay.database) is True
    gate.claimed(None, recover=True, database=relay.database)
    assert await gate.enter_claim(relay.database) is True
    held = HeldBatch(relay.database, recovered=False)
    store.answer.set()
    assert await relay._record("d", LEASE, Settlement(published=[1]), {}, held) == SettleResult(
        published=1
    )
    assert timers == [] and not held.parked
