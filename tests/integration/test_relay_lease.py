"""The relay keeps the lease of a batch it is still publishing, and stops publishing it once
the lease is lost: a key's messages never reach the broker interleaved. Real databases,
a real local HTTP receiver, relays in this process."""

from __future__ import annotations

import asyncio
import json

from outboxer.testing import TcpProxy, eventually
from tests.receiver import Delivery, Receiver
from tests.relaying import all_published, db, enqueue, relay

__all__ = ["db"]  # the fixture, imported: every test taking ``db`` runs on each database


def numbers(deliveries: list[Delivery]) -> list[int]:
    """The payloads' ``n`` in the order the requests arrived."""
    return [json.loads(d.body)["n"] for d in sorted(deliveries, key=lambda d: d.arrived)]


async def test_a_batch_that_outlasts_the_lock_timeout_is_not_claimed_again(db: str) -> None:
    """40 messages on one key take 4 s to a slow receiver, the lock timeout is 2.5 s, two
    relays of two loops each: the holder renews its lease, nobody else claims the batch, and
    the key's messages arrive once each, in order (they arrived twice, interleaved as 9,
    10, 0, 11, 1, ... when a lease expired under a batch still being published)."""
    receiver = Receiver(delay=0.1).start()
    try:
        enqueue(db, *[("order.placed", "k")] * 40)
        fleet = [
            relay(
                db,
                receiver.url,
                relay_id=f"relay-{n}",
                # Renewals must get through within 1.4 s: on SQLite under load (one
                # connection, an fsync per commit) they were seen to take 0.6 s.
                lock_timeout=2.5,
                batch_size=100,
                concurrency=2,
            )
            for n in range(2)
        ]
        tasks = [asyncio.create_task(r.run()) for r in fleet]
        try:
            await eventually(lambda: all_published(db, 40), timeout=30)
        finally:
            for r in fleet:
                r.stop()
            await asyncio.wait_for(asyncio.gather(*tasks), 30)
    finally:
        receiver.stop()
    assert numbers(receiver.received()) == list(range(40)), "once each, in order"
    assert sum(r.stats.renewals for r in fleet) >= 3, "4 s of publishing, a renewal per 0.83 s"
    assert sum(r.stats.leases_lost + r.stats.lost + r.stats.recovered for r in fleet) == 0


async def test_a_relay_cut_off_from_the_database_stops_publishing_before_its_lease_ends(
    pg_url: str,
) -> None:
    """Relay A publishes a slow batch and loses the database: it cannot renew, so it stops
    publishing before its lease runs out. Relay B, still connected, takes the rows over
    once the lease expired and publishes them from the first: a run of A's deliveries, then
    B's, never the two interleaved; every message published at last."""
    proxy = await TcpProxy("127.0.0.1", 5432).start()
    via_proxy = f"postgresql://postgres@127.0.0.1:{proxy.port}/{pg_url.rsplit('/', 1)[1]}"
    receiver = Receiver(delay=0.1).start()
    enqueue(pg_url, *[("order.placed", "k")] * 40)  # 4 s to publish, the lease is 2 s
    cut_off = relay(via_proxy, receiver.url, relay_id="relay-a", lock_timeout=2.0)
    healthy = relay(pg_url, receiver.url, relay_id="relay-b", lock_timeout=2.0)
    tasks = [asyncio.create_task(cut_off.run())]
    try:
        await eventually(lambda: _true(cut_off.stats.renewals >= 1), timeout=20)
        tasks.append(asyncio.create_task(healthy.run()))
        await proxy.cut()
        await eventually(lambda: _true(cut_off.stats.leases_lost == 1), timeout=10)
        await eventually(lambda: all_published(pg_url, 40), timeout=30)
        await proxy.restore()
    finally:
        for r in (cut_off, healthy):
            r.stop()
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
        await proxy.stop()
        receiver.stop()
    arrived = numbers(receiver.received())
    first_run = arrived[: arrived.index(0, 1)]
    assert first_run == list(range(len(first_run))) and len(first_run) >= 3, arrived
    assert arrived[len(first_run) :] == list(range(40)), f"B republished in order: {arrived}"
    assert healthy.stats.recovered >= 1


async def _true(value: bool) -> bool:
    return value
