"""The relay end to end on the real PostgreSQL and RabbitMQ."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import psycopg
import pytest

import outboxer
from outboxer import Relay, load_settings
from outboxer.brokers.memory import memory_broker
from outboxer.testing import TcpProxy, eventually
from tests.rabbit import RabbitConsumer


def settings(pg_url: str, broker: str, **overrides: Any) -> outboxer.Settings:
    base: dict[str, Any] = {
        "db": pg_url,
        "broker": broker,
        "poll_interval": 0.2,
        "backoff_base": 0.2,
        "backoff_max": 1.0,
        "publish_timeout": 2.0,
    }
    return load_settings(base | overrides, environ={})


def rows(pg_url: str) -> list[dict[str, Any]]:
    from psycopg.rows import dict_row

    with psycopg.connect(pg_url, row_factory=dict_row) as conn:
        return conn.execute("SELECT * FROM outboxer.outbox ORDER BY seq").fetchall()


async def start(relay: Relay) -> asyncio.Task[outboxer.RelayStats]:
    return asyncio.create_task(relay.run())


async def stop(relay: Relay, task: asyncio.Task[outboxer.RelayStats]) -> outboxer.RelayStats:
    relay.stop()
    return await asyncio.wait_for(task, 30)


async def test_commit_delivers_exactly_what_was_stored(
    pg_url: str, rabbit_consumer: RabbitConsumer
) -> None:
    with psycopg.connect(pg_url) as conn:
        message = outboxer.enqueue(
            conn,
            "order.placed",
            {"order": 42, "items": ["a", "b"]},
            key="customer-7",
            headers={"traceparent": "00-abc-01"},
        )
    stats = await Relay.from_settings(settings(pg_url, rabbit_consumer.broker_url)).drain()
    assert stats.published == 1
    [got] = await rabbit_consumer.wait_for(1)
    assert got.message_id == str(message.id)
    assert got.routing_key == "order.placed"
    assert json.loads(got.body) == {"order": 42, "items": ["a", "b"]}
    assert got.headers["traceparent"] == "00-abc-01"
    assert got.headers["outboxer-key"] == "customer-7"
    assert got.content_type == "application/json" and got.persistent
    [row] = rows(pg_url)
    assert (
        row["status"] == "PUBLISHED"
        and row["published_at"] is not None
        and row["locked_by"] is None
    )


async def test_rollback_delivers_nothing(pg_url: str, rabbit_consumer: RabbitConsumer) -> None:
    with psycopg.connect(pg_url) as conn:
        outboxer.enqueue(conn, "order.placed", {"rolled": "back"})
        conn.rollback()
        marker = outboxer.enqueue(conn, "order.placed", {"committed": True})
    await Relay.from_settings(settings(pg_url, rabbit_consumer.broker_url)).drain()
    await asyncio.sleep(0.3)  # anything else would have arrived by now
    assert [d.message_id for d in await rabbit_consumer.wait_for(1)] == [str(marker.id)]


async def test_broker_outage_fails_with_backoff_then_delivers(
    pg_url: str, rabbit_consumer: RabbitConsumer
) -> None:
    proxy = await TcpProxy("127.0.0.1", 5672).start()
    broker = f"amqp://guest:guest@127.0.0.1:{proxy.port}/?exchange={rabbit_consumer.exchange}"
    relay = Relay.from_settings(settings(pg_url, broker, max_attempts=50, concurrency=1))
    task = await start(relay)
    try:
        await eventually(lambda: _true(relay.publishers["default"].connected))
        await proxy.blackhole()
        with psycopg.connect(pg_url) as conn:
            sent = [outboxer.enqueue(conn, "order.placed", {"n": n}, key="k") for n in range(3)]

        async def failed_with_backoff() -> bool:
            head = rows(pg_url)[0]
            return head["status"] == "FAILED" and head["attempts"] >= 1

        await eventually(failed_with_backoff, timeout=20)
        head = rows(pg_url)[0]
        assert head["last_error"] and head["next_attempt_at"] > head["updated_at"]
        assert rabbit_consumer.received == []
        await proxy.restore()
        delivered = await rabbit_consumer.wait_for(3, timeout=30)
        assert [d.message_id for d in delivered] == [str(m.id) for m in sent]
        await eventually(lambda: _true(all(r["status"] == "PUBLISHED" for r in rows(pg_url))))
    finally:
        await stop(relay, task)
        await proxy.stop()


async def test_max_attempts_abandons(pg_url: str, rabbit_consumer: RabbitConsumer) -> None:
    with psycopg.connect(pg_url) as conn:
        # No queue is bound for this routing key in an exchange nobody reads: mandatory
        # publishing makes RabbitMQ return it, a retryable failure every time.
        outboxer.enqueue(conn, "nobody.listens", {"n": 1})
    lonely = RabbitConsumer(binding="only.this")
    await lonely.start()
    try:
        relay = Relay.from_settings(
            settings(pg_url, lonely.broker_url, max_attempts=3, backoff_base=0.05, backoff_max=0.1)
        )
        task = await start(relay)
        await eventually(lambda: _true(rows(pg_url)[0]["status"] == "ABANDONED"), timeout=20)
        await stop(relay, task)
    finally:
        await lonely.stop()
    [row] = rows(pg_url)
    assert row["attempts"] == 3 and row["last_error"]
    assert lonely.received == []


async def test_stale_lock_is_recovered(pg_url: str, rabbit_consumer: RabbitConsumer) -> None:
    with psycopg.connect(pg_url) as conn:
        sent = outboxer.enqueue(conn, "order.placed", {"n": 1}, key="k")
    async with outboxer.create_store(pg_url) as store:
        claimed = await store.claim("default", "relay-that-died", 10, 0.5, False)
    assert [m.id for m in claimed] == [sent.id]
    relay_settings = settings(pg_url, rabbit_consumer.broker_url)
    assert (await Relay.from_settings(relay_settings).drain()).published == 0, "still locked"
    await asyncio.sleep(0.6)
    assert (await Relay.from_settings(relay_settings).drain()).published == 1
    [row] = rows(pg_url)
    assert row["status"] == "PUBLISHED" and row["attempts"] == 1
    assert "relay-that-died" in row["last_error"]
    assert [d.message_id for d in await rabbit_consumer.wait_for(1)] == [str(sent.id)]


async def test_notify_wakes_an_idle_relay_at_once(
    pg_url: str, rabbit_consumer: RabbitConsumer, caplog: pytest.LogCaptureFixture
) -> None:
    relay = Relay.from_settings(
        settings(pg_url, rabbit_consumer.broker_url, poll_interval=30, concurrency=4)
    )
    task = await start(relay)
    try:
        await asyncio.sleep(1.0)  # idle, listening
        started = time.monotonic()
        with psycopg.connect(pg_url) as conn:
            outboxer.enqueue(conn, "order.placed", {"n": 1})
        await rabbit_consumer.wait_for(1, timeout=10)
        assert rabbit_consumer.received and time.monotonic() - started < 5, (
            "woken by NOTIFY, not the 30 s poll"
        )
    finally:
        await stop(relay, task)
    ours = [r for r in caplog.records if r.name in ("outboxer.relay", "outboxer.store")]
    assert not [r for r in ours if r.levelno >= logging.WARNING], caplog.text


def count_notifications(pg_url: str) -> int:
    with psycopg.connect(pg_url, autocommit=True) as listener:
        listener.execute('LISTEN "outboxer_outboxer_outbox"')
        with psycopg.connect(pg_url) as conn:
            outboxer.enqueue_many(conn, [{"topic": "t", "payload": {"n": n}} for n in range(100)])
            for n in range(5):
                outboxer.enqueue(conn, "t", {"n": n})
        return len(list(listener.notifies(timeout=1.0)))


def test_one_notify_per_transaction_while_a_relay_waits(pg_url: str) -> None:
    assert count_notifications(pg_url) == 0, "nobody waits: writers skip the NOTIFY"
    with psycopg.connect(pg_url) as conn:
        conn.execute(
            "INSERT INTO outboxer.outbox_listeners VALUES ('idle-relay', now() + interval '1 minute')"
        )
    assert count_notifications(pg_url) == 1
    with psycopg.connect(pg_url) as conn:
        conn.execute("UPDATE outboxer.outbox_listeners SET until = now() - interval '1 second'")
    assert count_notifications(pg_url) == 0, (
        "a registration that expired (its relay got busy or died)"
    )


def live_registrations(pg_url: str) -> int:
    with psycopg.connect(pg_url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM outboxer.outbox_listeners WHERE until > now()"
        ).fetchone()
    return int(row[0]) if row else 0


async def test_a_busy_relay_polls_and_a_quiet_one_registers_for_notifies(pg_url: str) -> None:
    """Store level: right after a claim found work, waiting means looking again within a few
    ms, with no registration (writers skip the NOTIFY); after a quiet spell the store
    registers; a claim that finds work withdraws the registration."""
    async with outboxer.create_store(pg_url) as store:
        store.configure_wakeups(wake_on_commit_below=0)  # any work is load
        with psycopg.connect(pg_url) as conn:
            outboxer.enqueue(conn, "t", {"n": 1})
        assert len(await store.claim("default", "r", 10, 30, False)) == 1
        started = time.monotonic()
        assert await store.wait_for_wakeup("default", 30) is True
        assert time.monotonic() - started < 1.0, "busy: a short poll, not the 30 s wait"
        assert live_registrations(pg_url) == 0
        await asyncio.sleep(0.1)  # a quiet spell
        assert await store.wait_for_wakeup("default", 30) is True, (
            "fresh registration: look once more"
        )
        assert live_registrations(pg_url) == 1
        with psycopg.connect(pg_url) as conn:
            outboxer.enqueue(conn, "t", {"n": 2})
        assert await store.wait_for_wakeup("default", 30) is True, "woken by the writer's NOTIFY"
        assert len(await store.claim("default", "r", 10, 30, False)) == 1
        await eventually(lambda: _true(live_registrations(pg_url) == 0), timeout=5)


async def test_writers_do_not_notify_a_relay_that_keeps_up(pg_url: str) -> None:
    """A steady stream of commits above wake_on_commit_below reaches the relay by its
    polling: apart from the first ones, which wake it from idle, no writer pays for a
    NOTIFY. (The threshold is low here so that a test's writer is load on any box.)"""
    relay = Relay.from_settings(
        settings(pg_url, "memory://steady", poll_interval=30, wake_on_commit_below=20)
    )
    task = await start(relay)
    with psycopg.connect(pg_url, autocommit=True) as listener:
        listener.execute('LISTEN "outboxer_outboxer_outbox"')
        try:
            await asyncio.sleep(0.5)  # idle and registered
            with psycopg.connect(pg_url, autocommit=True) as conn:
                for n in range(300):
                    with conn.transaction():
                        outboxer.enqueue(conn, "t", {"n": n})
                    await asyncio.sleep(0.002)
            await eventually(
                lambda: _true({r["status"] for r in rows(pg_url)} == {"PUBLISHED"}), timeout=10
            )
        finally:
            await stop(relay, task)
        notifies = len(list(listener.notifies(timeout=0.5)))
    assert notifies <= 5, f"{notifies} of 300 writers sent a NOTIFY"


async def test_under_load_the_relay_polls_every_busy_poll_interval(pg_url: str) -> None:
    """Above wake_on_commit_below the relay looks again every busy_poll_interval: a long one
    gathers a steady stream into few, large batches; a short one publishes it in many."""
    batches, streamed = {}, {}
    for busy_poll in (0.001, 0.15):
        relay = Relay.from_settings(
            settings(
                pg_url,
                f"memory://busy-{busy_poll}",
                poll_interval=30,
                wake_on_commit_below=0,  # any work is load
                busy_poll_interval=busy_poll,
                concurrency=1,
            )
        )
        task = await start(relay)
        try:
            await asyncio.sleep(0.3)  # idle and registered
            began = time.monotonic()
            with psycopg.connect(pg_url, autocommit=True) as conn:
                for n in range(100):
                    with conn.transaction():
                        outboxer.enqueue(conn, "t", {"n": n})
                    await asyncio.sleep(0.005)
            streamed[busy_poll] = time.monotonic() - began
            await eventually(
                lambda b=busy_poll: _true(len(memory_broker(f"busy-{b}").messages) == 100),
                timeout=10,
            )
        finally:
            await stop(relay, task)
        batches[busy_poll] = relay.stats.batches
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute("DELETE FROM outboxer.outbox")
    # At most one batch per 0.15 s of the stream (plus the one the first commit woke and
    # the last one after it), against about one a commit (5 ms apart) with a 1 ms poll.
    assert batches[0.15] <= streamed[0.15] / 0.15 + 3, (batches, streamed)
    assert batches[0.001] >= 3 * batches[0.15], (batches, streamed)


async def test_below_the_threshold_each_commit_wakes_the_relay(pg_url: str) -> None:
    """A moderate stream of commits (below wake_on_commit_below): the relay stays
    registered while it works, so each writer notifies and each commit wakes it, instead
    of waiting for the relay's next poll."""
    relay = Relay.from_settings(
        settings(pg_url, "memory://moderate", poll_interval=30, wake_on_commit_below=100_000)
    )
    task = await start(relay)
    with psycopg.connect(pg_url, autocommit=True) as listener:
        listener.execute('LISTEN "outboxer_outboxer_outbox"')
        registered = []
        try:
            await asyncio.sleep(0.5)  # idle and registered
            with psycopg.connect(pg_url, autocommit=True) as conn:
                for n in range(20):
                    with conn.transaction():
                        outboxer.enqueue(conn, "t", {"n": n})
                    await eventually(
                        lambda n=n: _true(len(memory_broker("moderate").messages) == n + 1),
                        timeout=5,
                    )
                    registered.append(live_registrations(pg_url))
        finally:
            await stop(relay, task)
        notifies = len(list(listener.notifies(timeout=0.5)))
    assert registered == [1] * 20, "registered all along: a claim that found work kept it"
    assert notifies == 20, f"{notifies} of 20 writers sent a NOTIFY"


@pytest.mark.parametrize("relays", [2, 4])
async def test_many_relays_share_a_table(
    pg_url: str, rabbit_consumer: RabbitConsumer, relays: int
) -> None:
    keys = [f"key-{k}" for k in range(12)]
    with psycopg.connect(pg_url) as conn:
        sent = outboxer.enqueue_many(
            conn,
            [
                {"topic": "order.placed", "payload": {"key": key, "n": n}, "key": key}
                for n in range(60)
                for key in keys
            ]
            + [{"topic": "order.placed", "payload": {"key": None, "n": n}} for n in range(200)],
        )
    fleet = [
        Relay.from_settings(
            settings(
                pg_url,
                rabbit_consumer.broker_url,
                batch_size=25,
                concurrency=2,
                relay_id=f"relay-{n}",
            )
        )
        for n in range(relays)
    ]
    stats = await asyncio.gather(*(relay.drain() for relay in fleet))
    assert sum(s.claimed for s in stats) == len(sent), (
        "each row claimed once: never owned by two relays"
    )
    assert all(s.claimed > 0 for s in stats), "every relay took part"
    delivered = await rabbit_consumer.wait_for(len(sent))
    assert sorted(d.message_id for d in delivered) == sorted(str(m.id) for m in sent)
    by_key: dict[str, list[int]] = {}
    for item in delivered:
        body = json.loads(item.body)
        if body["key"] is not None:
            by_key.setdefault(body["key"], []).append(body["n"])
    assert all(order == list(range(60)) for order in by_key.values()), by_key
    assert {r["status"] for r in rows(pg_url)} == {"PUBLISHED"}


async def _true(value: bool) -> bool:
    return value


async def test_below_the_threshold_a_claim_that_finds_work_keeps_the_registration(
    pg_url: str,
) -> None:
    """Store level, at the default wake_on_commit_below: a claim that took a message keeps
    the registration; waiting then means waiting for the next writer's NOTIFY."""
    async with outboxer.create_store(pg_url) as store:
        assert await store.wait_for_wakeup("default", 30) is True, "fresh registration"
        for n in range(3):
            store.reset_wakeup("default")
            with psycopg.connect(pg_url) as conn:
                outboxer.enqueue(conn, "t", {"n": n})
            started = time.monotonic()
            assert await store.wait_for_wakeup("default", 30) is True, "woken by the NOTIFY"
            assert time.monotonic() - started < 5
            assert len(await store.claim("default", "r", 10, 30, False)) == 1
            await asyncio.sleep(0.1)  # a withdrawal would have run by now
            assert live_registrations(pg_url) == 1


async def test_a_keys_commit_made_while_its_previous_one_is_published_goes_out_at_once(
    pg_url: str,
) -> None:
    """A key's second commit, made while its first message is still being published: the
    NOTIFY wakes a second loop, whose claim must pass the row over (its key is in flight)
    and finds nothing. Once the first is settled the second is due at once, and goes out
    then, not at the next commit or the fallback poll (30 s here)."""
    broker = memory_broker("key-in-flight")
    broker.latency = 0.3  # the first message is in flight for 0.3 s
    relay = Relay.from_settings(
        settings(pg_url, "memory://key-in-flight", poll_interval=30, concurrency=4)
    )
    task = await start(relay)
    try:
        await asyncio.sleep(0.5)  # idle, listening
        with psycopg.connect(pg_url) as conn:
            outboxer.enqueue(conn, "order.placed", {"n": 1}, key="k")
        await asyncio.sleep(0.1)  # claimed, being published
        started = time.monotonic()
        with psycopg.connect(pg_url) as conn:
            outboxer.enqueue(conn, "order.placed", {"n": 2}, key="k")
        await eventually(lambda: _true(len(broker.messages) == 2), timeout=10)
        assert time.monotonic() - started < 3, "published once its key was free, not polled"
        assert [json.loads(m.payload)["n"] for m in broker.messages] == [1, 2]
    finally:
        await stop(relay, task)
