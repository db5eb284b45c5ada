"""The relay's decisions, on a real SQLite file and the in-process memory broker."""

from __future__ import annotations

import asyncio
import sqlite3
import time
import uuid
from typing import Any

import pytest

import outboxer
from outboxer import PublishError, Relay, load_settings
from outboxer.brokers.memory import MemoryBroker, memory_broker
from outboxer.relay import LeaseKeeper, _cancel
from outboxer.stores.base import Claim, Lease
from outboxer.stores.sqlite import sqlite_path


@pytest.fixture
def broker() -> MemoryBroker:
    return memory_broker(f"relay-{uuid.uuid4().hex[:8]}")


def make_relay(sqlite_url: str, broker: MemoryBroker, **overrides: Any) -> Relay:
    base: dict[str, Any] = {
        "db": sqlite_url,
        "broker": f"memory://{broker.name}",
        "poll_interval": 0.05,
        "backoff_base": 0.05,
        "backoff_max": 0.1,
    }
    return Relay.from_settings(load_settings(base | overrides, environ={}))


def enqueue(sqlite_url: str, *keys: str | None) -> list[outboxer.Message]:
    conn = sqlite3.connect(sqlite_path(sqlite_url))
    with conn:
        sent = [outboxer.enqueue(conn, "t", {"n": n}, key=key) for n, key in enumerate(keys)]
    conn.close()
    return sent


def statuses(sqlite_url: str) -> list[tuple[str, int]]:
    conn = sqlite3.connect(sqlite_path(sqlite_url))
    rows = conn.execute("SELECT status, attempts FROM outbox ORDER BY seq").fetchall()
    conn.close()
    return rows


async def test_retryable_failure_then_success(sqlite_url: str, broker: MemoryBroker) -> None:
    sent = enqueue(sqlite_url, "k", "k")
    failures = {"left": 2}

    def flaky(message: outboxer.Message) -> BaseException | None:
        if message.id == sent[0].id and failures["left"]:
            failures["left"] -= 1
            return PublishError("try later")
        return None

    broker.fail = flaky
    await make_relay(sqlite_url, broker).drain()
    for _ in range(40):  # drain returns at idle; rows backing off become due again
        if [s for s, _ in statuses(sqlite_url)] == ["PUBLISHED", "PUBLISHED"]:
            break
        await asyncio.sleep(0.05)
        await make_relay(sqlite_url, broker).drain()
    assert statuses(sqlite_url) == [("PUBLISHED", 2), ("PUBLISHED", 0)]
    assert [m.id for m in broker.messages] == [m.id for m in sent], "k's second message waited"


async def test_permanent_failure_abandons_at_once(sqlite_url: str, broker: MemoryBroker) -> None:
    enqueue(sqlite_url, None)
    broker.fail = lambda m: PublishError("forbidden", retryable=False)
    stats = await make_relay(sqlite_url, broker).drain()
    assert stats.abandoned_now == 1
    assert statuses(sqlite_url) == [("ABANDONED", 1)]


async def test_stop_ends_a_running_relay(sqlite_url: str, broker: MemoryBroker) -> None:
    relay = make_relay(sqlite_url, broker)
    task = asyncio.create_task(relay.run())
    await asyncio.sleep(0.2)
    enqueue(sqlite_url, "a")
    for _ in range(100):
        if broker.messages:
            break
        await asyncio.sleep(0.02)
    relay.stop()
    stats = await asyncio.wait_for(task, 5)
    assert stats.published == 1


async def test_broker_down_at_start_is_waited_for(sqlite_url: str, broker: MemoryBroker) -> None:
    enqueue(sqlite_url, "a")
    broker.available = False
    relay = make_relay(sqlite_url, broker)
    task = asyncio.create_task(relay.drain())
    await asyncio.sleep(0.5)
    assert not task.done() and statuses(sqlite_url) == [("PENDING", 0)], (
        "nothing claimed while down"
    )
    broker.available = True
    stats = await asyncio.wait_for(task, 20)
    assert stats.published == 1


async def test_stripped_envelope_drops_internal_headers(
    sqlite_url: str, broker: MemoryBroker, tmp_path: Any
) -> None:
    conn = sqlite3.connect(sqlite_path(sqlite_url))
    with conn:
        outboxer.enqueue(conn, "t", {"a": 1}, headers={"internal-tenant": "7", "trace": "x"})
    conn.close()
    config = tmp_path / "o.toml"
    config.write_text(
        f'[destinations.default]\nbroker = "memory://{broker.name}"\nenvelope = "stripped"\n'
    )
    settings = load_settings(
        {"db": sqlite_url, "poll_interval": 0.05}, config_file=config, environ={}
    )
    await Relay.from_settings(settings).drain()
    assert dict(broker.messages[0].headers) == {"trace": "x"}


async def test_a_broker_refusing_the_configuration_stops_the_relay(
    sqlite_url: str, broker: MemoryBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    from outboxer import ConfigError

    relay = make_relay(sqlite_url, broker)

    async def refuse() -> None:
        raise PublishError("exchange exists with another type", retryable=False)

    monkeypatch.setattr(relay.publishers["default"], "_connect", refuse)
    with pytest.raises(ConfigError, match="another type"):
        await asyncio.wait_for(relay.run(), 10)


async def test_retention_runs_on_a_schedule_inside_the_relay(
    sqlite_url: str, broker: MemoryBroker
) -> None:
    enqueue(sqlite_url, "a", None)
    relay = make_relay(sqlite_url, broker, published_retention="0", cleanup_interval="0.1")
    task = asyncio.create_task(relay.run())
    try:
        for _ in range(100):
            # The counter too: rows are gone once a DELETE commits, but the round adds its
            # count only when it returns, and stopping now would cancel it first.
            if len(broker.messages) == 2 and statuses(sqlite_url) == [] and relay.stats.cleaned:
                break
            await asyncio.sleep(0.05)
    finally:
        relay.stop()
        await asyncio.wait_for(task, 5)
    assert len(broker.messages) == 2
    assert statuses(sqlite_url) == [], "published rows past their retention were deleted"
    assert relay.stats.cleaned == 2


async def test_a_retry_after_from_the_broker_sets_the_least_wait_up_to_the_backoff_cap(
    sqlite_url: str, broker: MemoryBroker
) -> None:
    """A broker's Retry-After (webhooks: 429/503) outlasts a shorter backoff, up to backoff_max."""
    slow, capped, plain = enqueue(sqlite_url, "a", "b", "c")
    asked = {slow.id: 30.0, capped.id: 3600.0, plain.id: None}
    broker.fail = lambda message: PublishError("slow down", retry_after=asked[message.id])
    started = time.time()
    await make_relay(sqlite_url, broker, backoff_base=1, backoff_max=60, backoff_jitter=0).drain()
    conn = sqlite3.connect(sqlite_path(sqlite_url))
    waits = [
        at - started for (at,) in conn.execute("SELECT next_attempt_at FROM outbox ORDER BY seq")
    ]
    conn.close()
    assert 29 <= waits[0] <= 31, waits  # Retry-After: 30 beats the 1 s backoff
    assert 59 <= waits[1] <= 61, waits  # an hour asked for, capped at backoff_max
    assert 0.9 <= waits[2] <= 2, waits  # no Retry-After: the backoff alone


@pytest.mark.parametrize("gathers", [True, False])
async def test_after_a_partial_batch_a_gathering_store_waits_before_claiming_again(
    sqlite_url: str, broker: MemoryBroker, monkeypatch: pytest.MonkeyPatch, gathers: bool
) -> None:
    enqueue(sqlite_url, "a", "b", "c")
    relay = make_relay(sqlite_url, broker, batch_size=10, concurrency=1)
    monkeypatch.setattr(relay.store, "gathers_batches", gathers)
    calls: list[str] = []
    claim, wait = relay.store.claim, relay.store.wait_for_wakeup

    async def logged_claim(*args: Any, **kwargs: Any) -> list[outboxer.Message]:
        batch = await claim(*args, **kwargs)
        calls.append(f"claim {len(batch)}")
        return batch

    async def logged_wait(destination: str, timeout: float) -> bool:
        calls.append("wait")
        return await wait(destination, timeout)

    monkeypatch.setattr(relay.store, "claim", logged_claim)
    monkeypatch.setattr(relay.store, "wait_for_wakeup", logged_wait)
    task = asyncio.create_task(relay.run())
    for _ in range(100):
        if len(calls) >= 3:
            break
        await asyncio.sleep(0.02)
    relay.stop()
    await asyncio.wait_for(task, 10)
    assert len(broker.messages) == 3
    expected = ["claim 3", "wait", "claim 0"] if gathers else ["claim 3", "claim 0", "wait"]
    assert calls[:3] == expected


async def test_a_batch_whose_rows_were_taken_over_stops_publishing_at_the_next_renewal(
    sqlite_url: str, broker: MemoryBroker
) -> None:
    """As if this relay had stalled past its lease: another claim takes the batch's first
    row over. The next renewal finds it gone and the publish stops there; the rows still
    held go back to the queue, behind the row the new holder has."""
    enqueue(sqlite_url, *["k"] * 20)
    broker.latency = 0.1  # one wave per message of the key: 2 s for the batch
    relay = make_relay(sqlite_url, broker, lock_timeout="0.9", concurrency=1)
    task = asyncio.create_task(relay.run())
    try:
        for _ in range(200):
            if len(broker.messages) >= 3:
                break
            await asyncio.sleep(0.01)
        conn = sqlite3.connect(sqlite_path(sqlite_url))
        with conn:
            conn.execute("UPDATE outbox SET locked_until = locked_until - 60")
        conn.close()
        async with outboxer.create_store(sqlite_url) as thief:
            taken = await thief.claim("default", "relay-thief", 100, 60.0, False)
        assert taken.recovered and len(taken) == 1
        for _ in range(200):
            if relay.stats.leases_lost:
                break
            await asyncio.sleep(0.01)
        stopped_at = len(broker.messages)
        await asyncio.sleep(0.5)
        assert len(broker.messages) == stopped_at, "no wave after the lease was lost"
    finally:
        relay.stop()
        await asyncio.wait_for(task, 10)
    assert relay.stats.leases_lost == 1 and relay.stats.lost == 1 and relay.stats.released == 19
    assert stopped_at < 20, "stopped before the end of the batch"
    assert statuses(sqlite_url) == [("PROCESSING", 1)] + [("PENDING", 0)] * 19


async def test_a_renewal_answered_as_the_publish_ends_does_not_keep_renewing(
    sqlite_url: str, broker: MemoryBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The renewal's answer and the end of the publish in the same turn of the event loop:
    Python 3.11's ``asyncio.wait_for`` then returns the answer and drops the cancellation,
    and the keeper renewed on and on while its relay loop waited for it to end (a relay
    stuck for good in a CI run). The keeper must end all the same."""
    relay = make_relay(sqlite_url, broker, lock_timeout="0.9")
    answer: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    renewals: list[float] = []

    async def renew(*args: Any) -> int:
        renewals.append(time.monotonic())
        return await answer

    monkeypatch.setattr(relay.store, "renew", renew)
    message = outboxer.Message(id=uuid.uuid4(), topic="t", payload=b"{}", seq=1)
    batch = Claim([message], lease=Lease.new(relay.relay_id))
    publish = asyncio.create_task(asyncio.sleep(30))
    # Claimed a third of the lock timeout ago: the first renewal is due at once.
    lease = LeaseKeeper(relay, "default", batch, time.monotonic() - 0.3, publish)
    lease.start()
    try:
        for _ in range(200):
            if renewals:
                break
            await asyncio.sleep(0.005)
        assert renewals, "the first renewal was sent"
        # The answer, the stop and the cancel in one turn of the loop, as in Relay._process.
        answer.set_result(1)
        renewing = lease.stop()
        assert renewing is not None
        async with asyncio.timeout(2):
            await _cancel(renewing)
        assert len(renewals) == 1, "no renewal after the publish ended"
    finally:
        publish.cancel()
