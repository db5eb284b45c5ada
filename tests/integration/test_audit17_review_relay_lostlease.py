"""After a lost lease, a key's confirmation behind an earlier row of its key is given
back on every path, not only on the one where the publish ends by the lease's cancellation.

``Relay._process`` applies ``after_lost_lease`` (a confirmed row that follows another of
its key in the batch goes back instead of PUBLISHED: the earlier row may have been taken
over, and its new holder may still give it back or abandon it) only where the publish was
cancelled by the lost lease alone. Two other ways out of a publish whose lease was lost
recorded every confirmation as PUBLISHED, a key's later row included, while its earlier
row was another relay's:

- the lease is lost and the relay is forced to stop in the same turn of the event loop (a
  stall made both timers, the lease's and shutdown_timeout's, overdue): the forced stop's
  settle recorded what the waves had answered, unfenced by key;
- the publisher swallowed the cancellation and returned its outcomes (``_process`` allows
  for it: "the publish swallowed the cancellation: its outcomes stand").

Real relays on the real SQLite and PostgreSQL; the broker double and the store that loses
its renewals are those of test_audit17_forcedstop_known_outcomes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import cast

import pytest

from outboxer import relay as relay_module
from outboxer.message import Message
from outboxer.relay import Relay
from outboxer.stores import Store, create_store
from tests.integration.test_audit17_forcedstop_known_outcomes import (
    CUT_SHORT,
    DESTINATION,
    LeaseLosingStore,
    Rows,
    WaveBroker,
    enqueue_batch,
    settings,
)
from tests.peek import Row
from tests.relaying import until


@pytest.fixture(params=["sqlite_url", "pg_url"])
def url(request: pytest.FixtureRequest) -> str:
    found: str = request.getfixturevalue(request.param)
    return found


class SwallowingBroker(WaveBroker):
    """As WaveBroker, but the held wave swallows its cancellation and confirms its messages
    (an adapter that catches CancelledError to finish its wave)."""

    async def _publish_wave(self, messages: Sequence[Message]) -> list[BaseException | None]:
        if self.waves == self.hold_wave:
            self.holding.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.set()  # and the wave goes on
            self.hold_wave = None
        return await super()._publish_wave(messages)


async def take_over_first_row(url: str, names: dict[str, str]) -> None:
    """Another relay takes the expired lease's first row (a0, heading its key) over."""
    other = create_store(url)
    await other.connect()
    try:
        taken: list[Message] = []

        async def took_over() -> bool:
            claim = await other.claim(DESTINATION, "fs-other", 10, 30.0, False)
            taken.extend(claim)
            return bool(claim)

        await until(took_over, "the expired lease was taken over", 5)
        assert [names[str(m.id)] for m in taken] == ["a0"]
    finally:
        await other.close()


def check_fenced(found: dict[str, Row], confirmed_later: Sequence[str]) -> None:
    """a0 stays with the relay that took it over; ``confirmed_later`` (rows the broker
    confirmed behind an earlier row of their key) went back, untried; the rest is recorded."""
    assert (found["a0"].status, found["a0"].locked_by) == ("PROCESSING", "fs-other")
    states = {name: (row.status, row.attempts) for name, row in found.items() if name != "a0"}
    expected = {name: state for name, state in CUT_SHORT.items() if name != "a0"}
    for name in confirmed_later:
        expected[name] = ("PENDING", 0)
    assert states == expected, states


async def test_a_lease_lost_as_the_relay_is_forced_to_stop(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    names = enqueue_batch(url)
    rows = Rows(url, names)
    deliveries: list[str] = []
    try:
        broker = WaveBroker(names, deliveries, hold_wave=2)  # waves 0 and 1 confirmed
        store = LeaseLosingStore(create_store(url))
        relay = Relay(cast(Store, store), {DESTINATION: broker}, settings(url, "fs-both"))
        lose = relay_module.LeaseKeeper._lose

        def lose_then_force_stop(keeper: relay_module.LeaseKeeper, reason: str) -> None:
            # Both timers overdue after a stall: the lease's, then shutdown_timeout's.
            lose(keeper, reason)
            relay.force_stop()

        monkeypatch.setattr(relay_module.LeaseKeeper, "_lose", lose_then_force_stop)
        running = asyncio.create_task(relay.run())
        try:
            await asyncio.wait_for(broker.cancelled.wait(), 5)
            await asyncio.wait_for(store.settling.wait(), 5)
            await take_over_first_row(url, names)
            store.release_settle.set()
            await asyncio.wait_for(running, 5)
        finally:
            store.release_settle.set()
            relay.force_stop()
            await asyncio.wait_for(running, 5)
        assert deliveries == ["a0", "n0", "d0", "a1", "d1"], deliveries
        check_fenced(rows.read(), ["a1", "d1"])
    finally:
        rows.close()


async def test_a_lost_lease_whose_publish_swallowed_the_cancellation(url: str) -> None:
    names = enqueue_batch(url)
    rows = Rows(url, names)
    deliveries: list[str] = []
    try:
        broker = SwallowingBroker(names, deliveries, hold_wave=2)  # waves 0 and 1 confirmed
        store = LeaseLosingStore(create_store(url))
        relay = Relay(cast(Store, store), {DESTINATION: broker}, settings(url, "fs-swallow"))
        running = asyncio.create_task(relay.run())
        try:
            await asyncio.wait_for(broker.cancelled.wait(), 5)
            await asyncio.wait_for(store.settling.wait(), 5)
            await take_over_first_row(url, names)
            store.release_settle.set()
            await until(lambda: store.claims > 1, "the batch was settled", 5)
            found = rows.read()
        finally:
            store.release_settle.set()
            relay.force_stop()
            await asyncio.wait_for(running, 5)
        # The held wave went on after the lost lease: d2 was confirmed too.
        assert deliveries == ["a0", "n0", "d0", "a1", "d1", "d2"], deliveries
        check_fenced(found, ["a1", "d1", "d2"])
    finally:
        rows.close()
