"""Two relays on one MariaDB outbox while writers commit: each row published once, keys in order."""

from __future__ import annotations

import asyncio
import json
import random
import uuid
from collections import defaultdict

import outboxer
from outboxer import Relay, load_settings
from outboxer.brokers.memory import memory_broker
from tests.conftest import mysql_connect


def write_transactions(url: str, seed: int, transactions: int) -> None:
    """Commit small transactions of keyed and keyless messages, some rolled back."""
    chance = random.Random(seed)
    conn = mysql_connect(url)
    try:
        for _ in range(transactions):
            keys = [chance.choice(["a", "b", "c", "d", None]) for _ in range(chance.randint(1, 4))]
            outboxer.enqueue_many(
                conn, [{"topic": "t", "payload": {"seed": seed}, "key": key} for key in keys]
            )
            if chance.random() < 0.1:
                conn.rollback()
            else:
                conn.commit()
    finally:
        conn.close()


def published_in_seq_order(url: str) -> list[tuple[str, str | None]]:
    conn = mysql_connect(url)
    try:
        with conn.cursor() as cursor:
            cursor.execute("SELECT id, `key`, status FROM outbox ORDER BY seq")
            rows = cursor.fetchall()
    finally:
        conn.close()
    assert {status for _, _, status in rows} <= {"PUBLISHED"}, "every committed row published"
    return [(row_id, key) for row_id, key, _ in rows]


async def test_two_relays_publish_each_row_once_in_key_order(mysql_url: str) -> None:
    broker = memory_broker(f"two-relays-{uuid.uuid4().hex[:8]}")
    broker.latency = 0.002  # keeps batches in flight, so the relays overlap
    relays = [
        Relay.from_settings(
            load_settings(
                {
                    "db": mysql_url,
                    "broker": f"memory://{broker.name}",
                    "relay_id": f"relay-{n}",
                    "batch_size": 7,
                    "concurrency": 2,
                    "poll_interval": 0.02,
                },
                environ={},
            )
        )
        for n in range(2)
    ]
    running = [asyncio.create_task(relay.run()) for relay in relays]
    try:
        await asyncio.gather(
            *(asyncio.to_thread(write_transactions, mysql_url, seed, 40) for seed in range(3))
        )
        expected = 0
        for _ in range(300):
            rows = await asyncio.to_thread(mysql_connect, mysql_url)
            with rows.cursor() as cursor:
                cursor.execute("SELECT COUNT(*), SUM(status = 'PUBLISHED') FROM outbox")
                total, published = cursor.fetchone()
            rows.close()
            expected = int(total)
            if published == total:
                break
            await asyncio.sleep(0.05)
    finally:
        for relay in relays:
            relay.stop()
        stats = await asyncio.gather(*running)
    in_seq = published_in_seq_order(mysql_url)
    assert len(in_seq) == expected > 100
    sent_ids = [str(message.id) for message in broker.messages]
    assert sorted(sent_ids) == sorted(row_id for row_id, _ in in_seq), (
        "each row published exactly once"
    )
    assert sum(s.lost for s in stats) == 0 and all(s.published for s in stats), "both relays worked"
    by_key_sent: dict[str, list[str]] = defaultdict(list)
    for message in broker.messages:
        if message.key is not None:
            by_key_sent[message.key].append(str(message.id))
    by_key_committed: dict[str, list[str]] = defaultdict(list)
    for row_id, key in in_seq:
        if key is not None:
            by_key_committed[key].append(row_id)
    assert by_key_sent == by_key_committed, "per key, publish order = seq order = commit order"
    assert all(json.loads(message.payload)["seed"] in range(3) for message in broker.messages)


def _commit_one(url: str, key: str | None = "k") -> None:
    conn = mysql_connect(url)
    try:
        outboxer.enqueue(conn, "t", {"n": 1}, key=key)
        conn.commit()
    finally:
        conn.close()


async def test_idle_relay_wakes_on_a_commit_well_before_its_poll_interval(mysql_url: str) -> None:
    """No LISTEN/NOTIFY on MySQL: the idle relay's probe sees the commit within ~50 ms."""
    import time

    broker = memory_broker(f"wake-{uuid.uuid4().hex[:8]}")
    relay = Relay.from_settings(
        load_settings(
            {"db": mysql_url, "broker": f"memory://{broker.name}", "poll_interval": 30}, environ={}
        )
    )
    running = asyncio.create_task(relay.run())
    try:
        latencies = []
        for _ in range(5):
            await asyncio.sleep(0.3)  # every loop idle, waiting
            # Counted before the commit: the relay runs on this event loop while the commit's
            # thread finishes, and may publish the row before this coroutine resumes.
            sent = len(broker.messages)
            committed = time.monotonic()
            await asyncio.to_thread(_commit_one, mysql_url)
            while len(broker.messages) == sent:
                assert time.monotonic() - committed < 5, "not published: the relay slept through it"
                await asyncio.sleep(0.005)
            latencies.append(time.monotonic() - committed)
    finally:
        relay.stop()
        await running
    assert max(latencies) < 1.0, latencies  # the poll interval is 30 s


async def test_wait_for_wakeup_sees_commits_made_while_it_was_not_waiting(mysql_url: str) -> None:
    """A commit between a claim and the wait is news; one change wakes one waiter; a quiet
    outbox times out."""
    from outboxer.stores import create_store

    async with create_store(mysql_url) as store:
        assert await store.wait_for_wakeup("default", 0.2) is False, (
            "an empty outbox: nothing to wake for"
        )
        await asyncio.to_thread(_commit_one, mysql_url)  # between a claim and the next wait
        assert await store.wait_for_wakeup("default", 5) is True
        first, second = (
            asyncio.create_task(store.wait_for_wakeup("default", 0.5)) for _ in range(2)
        )
        await asyncio.sleep(0.1)
        await asyncio.to_thread(_commit_one, mysql_url, None)
        assert sorted(await asyncio.gather(first, second)) == [False, True], "one waiter per change"
        await store.claim("default", "r", 10, 30.0, False)  # the mark shrinks: not news
        assert (
            await store.wait_for_wakeup("default", 0.2) is True
        )  # a change all the same: one extra look
        assert await store.wait_for_wakeup("default", 0.2) is False


async def test_retention_never_waits_for_a_row_a_claim_holds(mysql_url: str) -> None:
    """Retention deletes finished rows only, and must not lock, nor wait for, any other. On
    a small table ``DELETE … ORDER BY updated_at LIMIT`` read (and locked) rows it did not
    delete, so it waited for the rows a claim held, and could deadlock with the claim."""
    conn = mysql_connect(mysql_url)
    holder = mysql_connect(mysql_url)
    try:
        outboxer.enqueue_many(conn, [{"topic": "t", "payload": {"n": n}} for n in range(6)])
        conn.commit()
        with conn.cursor() as cursor:
            cursor.execute(
                "UPDATE outbox SET status = 'PUBLISHED',"
                " updated_at = UTC_TIMESTAMP(6) - INTERVAL 1 DAY ORDER BY seq LIMIT 4"
            )
        conn.commit()
        with holder.cursor() as cursor:  # a claim in progress: its rows locked until it ends
            cursor.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")  # a relay's
            cursor.execute("SELECT seq FROM outbox WHERE status = 'PENDING'")
            pending = [row[0] for row in cursor.fetchall()]
            assert len(pending) == 2
            # Exactly these rows, as a claim locks the rows it takes.
            cursor.execute(
                "SELECT seq FROM outbox FORCE INDEX (PRIMARY) WHERE seq IN (%s, %s) FOR UPDATE",
                pending,
            )
        async with outboxer.create_store(mysql_url) as store:
            deleted = await asyncio.wait_for(store.cleanup("PUBLISHED", 3600.0, 1000), 10)
        assert deleted == 4
    finally:
        holder.rollback()
        holder.close()
        conn.close()
