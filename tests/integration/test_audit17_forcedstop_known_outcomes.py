"""A batch cut short mid-publish records the outcomes its finished waves already had.

A batch is published in waves (outboxer.brokers.base, "Ordering"): wave ``n`` holds the
``n``-th message of every key. When a forced shutdown (``Relay.force_stop``: a second
SIGTERM, or ``shutdown_timeout`` running out) or a lost lease cancels the publish while a
later wave is in flight, the relay gave every row of the batch back unpublished, no attempt
counted: the messages the broker had confirmed were published again after the restart
(duplicates), and a refusal, for good or for now, was forgotten (no attempt, no
last_error). Now the confirmed rows are PUBLISHED, the refused ones FAILED or ABANDONED as a
settle records them (a message that fails to decrypt, in the payload layer, too), and only
the unknown ones (the wave in flight, the later ones) go back with no attempt counted.

After a lost lease the settle is fenced by the claim's lease token: a row another relay
took over meanwhile is left to it (here: recovered by a claim of "another relay" before the
cut-short relay's settle reaches the database). There a confirmation that follows an
earlier message of its key in the batch is given back all the same: that earlier row may be
the other relay's, which may give it back or abandon it.

Real relays on the real SQLite and PostgreSQL, a broker double that confirms, refuses or
holds each delivery as the test says.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, cast

import pytest

from outboxer import Outbox
from outboxer.brokers.base import Publisher
from outboxer.config import Settings
from outboxer.crypto import KeyRing, generate_key
from outboxer.errors import PublishError
from outboxer.message import Message
from outboxer.relay import Relay
from outboxer.stores import Store, create_store
from tests.integration.test_http_api import connect_sync
from tests.peek import Peek, Row
from tests.relaying import until

DESTINATION = "default"

#: The batch, in enqueue (seq) order: (name, key). Its waves: wave 0 holds a0 b0 c0 n0 d0
#: e0 (e0 fails in the payload layer, before any wave: the relay has no keys for it);
#: wave 1 a1 d1 (b1, c1 and e1 are skipped: their key's first message failed); wave 2 d2.
BATCH: tuple[tuple[str, str | None], ...] = (
    ("a0", "a"),
    ("b0", "b"),
    ("c0", "c"),
    ("n0", None),
    ("d0", "d"),
    ("e0", "e"),
    ("a1", "a"),
    ("b1", "b"),
    ("c1", "c"),
    ("d1", "d"),
    ("d2", "d"),
    ("e1", "e"),
)
ENCRYPTED = {"e0"}
#: What the broker answers at a message's first delivery (any later one: confirmed).
FIRST = {"b0": "permanent", "c0": "retry"}
#: Each message's state once the batch was cut short while its wave 1 was in flight.
CUT_SHORT = {
    "a0": ("PUBLISHED", 0),
    "n0": ("PUBLISHED", 0),
    "d0": ("PUBLISHED", 0),
    "b0": ("ABANDONED", 1),
    "c0": ("FAILED", 1),
    "e0": ("ABANDONED", 1),
    # Unknown (in flight, not yet sent) or skipped behind a failure: given back untried.
    "a1": ("PENDING", 0),
    "d1": ("PENDING", 0),
    "d2": ("PENDING", 0),
    "b1": ("PENDING", 0),
    "c1": ("PENDING", 0),
    "e1": ("PENDING", 0),
}


@pytest.fixture(params=["sqlite_url", "pg_url"])
def url(request: pytest.FixtureRequest) -> str:
    found: str = request.getfixturevalue(request.param)
    return found


class Rows(Peek):
    def __init__(self, url: str, names: dict[str, str]) -> None:
        super().__init__(url)
        self.names = names  # message id -> name
        self.table = '"outbox"' if self.dialect == "sqlite" else '"outboxer"."outbox"'

    def read(self) -> dict[str, Row]:
        found = self._run(f"SELECT id, status, attempts, locked_by, last_error FROM {self.table}")
        return {
            self.names[str(r[0])]: Row(str(r[1]), int(r[2]), r[3], r[4])
            for r in found
            if str(r[0]) in self.names
        }


def enqueue_batch(url: str) -> dict[str, str]:
    """Commit BATCH in one transaction; message id -> name."""
    plain, sealed = Outbox(), Outbox(encryption=KeyRing({"k1": generate_key()}))
    conn = connect_sync(url)
    try:
        names = {}
        for name, key in BATCH:
            outbox = sealed if name in ENCRYPTED else plain
            message = outbox.enqueue(conn, "t", {"name": name}, key=key)
            names[str(message.id)] = name
        conn.commit()
    finally:
        conn.close()
    return names


class WaveBroker(Publisher):
    """Confirms, or refuses as FIRST says; holds the wave ``hold_wave`` (counted from 0
    over this publisher's life) until the publish is cancelled."""

    schemes = ("forcedstop",)

    def __init__(self, names: dict[str, str], deliveries: list[str], hold_wave: int | None):
        super().__init__("forcedstop://test", publish_timeout=30.0)
        self.names = names
        #: Every delivery the broker confirmed, by name, in order (shared by the relays).
        self.deliveries = deliveries
        self.hold_wave = hold_wave
        self.waves = 0
        self.seen: set[str] = set()
        self.holding = asyncio.Event()
        self.cancelled = asyncio.Event()

    async def _connect(self) -> None:
        return None

    async def _close(self) -> None:
        return None

    async def _publish_wave(self, messages: Sequence[Message]) -> list[BaseException | None]:
        wave, self.waves = self.waves, self.waves + 1
        if wave == self.hold_wave:
            self.holding.set()
            try:
                await asyncio.Event().wait()  # no answer: until the publish is cancelled
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        results: list[BaseException | None] = []
        for message in messages:
            name = self.names[str(message.id)]
            first = name not in self.seen
            self.seen.add(name)
            plan = FIRST.get(name) if first else None
            if plan == "permanent":
                results.append(PublishError(f"refused for good: {name}", retryable=False))
            elif plan == "retry":
                results.append(PublishError(f"refused for now: {name}", retryable=True))
            else:
                self.deliveries.append(name)
                results.append(None)
        return results


def settings(url: str, relay_id: str, **changes: Any) -> Settings:
    values: dict[str, Any] = {
        "db": url,
        "batch_size": 100,
        "concurrency": 1,
        "lock_timeout": 0.5,
        "poll_interval": 0.05,
        "backoff_base": 0.01,
        "backoff_max": 0.05,
        "backoff_jitter": 0.0,
        "cleanup_interval": 3600.0,
        "relay_id": relay_id,
    }
    return Settings(**(values | changes))


def check_cut_short(found: dict[str, Row]) -> None:
    states = {name: (row.status, row.attempts) for name, row in found.items()}
    assert states == CUT_SHORT, states
    assert "refused for good: b0" in (found["b0"].last_error or ""), found["b0"]
    assert "refused for now: c0" in (found["c0"].last_error or ""), found["c0"]
    assert "no encryption keys" in (found["e0"].last_error or ""), found["e0"]


async def test_a_forced_stop_records_the_waves_the_broker_answered(url: str) -> None:
    names = enqueue_batch(url)
    rows = Rows(url, names)
    deliveries: list[str] = []
    try:
        broker = WaveBroker(names, deliveries, hold_wave=1)
        relay = Relay(create_store(url), {DESTINATION: broker}, settings(url, "fs-first"))
        running = asyncio.create_task(relay.run())
        await asyncio.wait_for(broker.holding.wait(), 5)
        relay.force_stop()
        await asyncio.wait_for(running, 5)
        assert broker.cancelled.is_set()
        check_cut_short(rows.read())
        assert deliveries == ["a0", "n0", "d0"], deliveries

        # After the restart: each confirmed message once, the rest in key order.
        broker = WaveBroker(names, deliveries, hold_wave=None)
        broker.seen = {"b0", "c0"}  # their refusals are behind them
        relay = Relay(create_store(url), {DESTINATION: broker}, settings(url, "fs-second"))
        running = asyncio.create_task(relay.run())
        try:

            def done() -> bool:
                found = rows.read()
                return all(
                    row.status == ("ABANDONED" if name in ("b0", "e0") else "PUBLISHED")
                    for name, row in found.items()
                )

            await until(done, "the restarted relay published what was given back", 5)
        finally:
            relay.stop()
            await asyncio.wait_for(running, 5)
        sent = {name for name, _ in BATCH} - {"b0", "e0"}
        assert sorted(deliveries) == sorted(sent), deliveries  # each once
        for key in "acde":
            mine = [name for name in deliveries if name.startswith(key) and name in sent]
            assert mine == sorted(mine), deliveries  # in key order
        assert rows.read()["c0"].attempts == 1
    finally:
        rows.close()


class LeaseLosingStore:
    """The relay's store: renewals fail (the database is unreachable for them), so the
    lease runs out mid-publish; the first settle waits for ``release_settle``; claims after
    the first hang (the relay publishes nothing more)."""

    def __init__(self, inner: Store) -> None:
        self._inner = inner
        self.release_settle = asyncio.Event()
        self.settling = asyncio.Event()
        self.claims = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def renew(self, *args: Any, **kwargs: Any) -> int:
        raise ConnectionError("renewals do not get through")

    async def claim(self, *args: Any, **kwargs: Any) -> Any:
        self.claims += 1
        if self.claims > 1:
            await asyncio.Event().wait()
        return await self._inner.claim(*args, **kwargs)

    async def settle(self, *args: Any, **kwargs: Any) -> Any:
        if not self.settling.is_set():
            self.settling.set()
            await self.release_settle.wait()
        return await self._inner.settle(*args, **kwargs)


async def test_a_lost_lease_records_what_nobody_took_over(url: str) -> None:
    names = enqueue_batch(url)
    rows = Rows(url, names)
    deliveries: list[str] = []
    other = create_store(url)
    try:
        broker = WaveBroker(names, deliveries, hold_wave=2)  # waves 0 and 1 confirmed
        store = LeaseLosingStore(create_store(url))
        relay = Relay(cast(Store, store), {DESTINATION: broker}, settings(url, "fs-lease"))
        running = asyncio.create_task(relay.run())
        try:
            # The lease runs out (0.9 of 0.5 s without a renewal): the publish is cancelled.
            await asyncio.wait_for(broker.cancelled.wait(), 5)
            await asyncio.wait_for(store.settling.wait(), 5)
            # Meanwhile another relay takes the lease's first row over (expired, it heads
            # its key: recovered alone), before the cut-short relay's settle gets through.
            await other.connect()
            taken: list[Message] = []

            async def took_over() -> bool:
                claim = await other.claim(DESTINATION, "fs-other", 10, 30.0, False)
                taken.extend(claim)
                return bool(claim)

            await until(took_over, "the expired lease was taken over", 5)
            assert [names[str(m.id)] for m in taken] == ["a0"]
            store.release_settle.set()
            await until(lambda: relay.stats.lost == 1, "the settle went through", 5)
            found = rows.read()
        finally:
            relay.force_stop()
            await asyncio.wait_for(running, 5)
        assert deliveries == ["a0", "n0", "d0", "a1", "d1"], deliveries
        # a0 stays with the relay that took it over: a settle never changes its claim.
        assert (found["a0"].status, found["a0"].locked_by) == ("PROCESSING", "fs-other")
        del found["a0"]
        # Confirmed in wave 1, a1 and d1 are given back all the same: after a lost lease,
        # an earlier row of their key may be another relay's (a0 is), and a key's later
        # message must not be PUBLISHED while its new holder may still give that one back.
        expected = {name: state for name, state in CUT_SHORT.items() if name != "a0"}
        assert {name: (row.status, row.attempts) for name, row in found.items()} == expected
        assert relay.stats.leases_lost == 1
        assert relay.stats.published == 2  # n0, d0
    finally:
        await other.close()
        rows.close()
