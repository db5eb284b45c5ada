"""A claim whose connection is cut after its transaction committed: the relay never got its
rows, but they are in flight under its lease. They must go back to the queue at its next
claim, not wait for the lease to expire (the lock timeout) and then be recovered one at a
time, each charged an attempt it never made."""

from __future__ import annotations

import asyncio
import uuid

import psycopg

import outboxer
from outboxer import Relay, load_settings
from outboxer.brokers.memory import memory_broker
from outboxer.message import DEFAULT_DESTINATION
from outboxer.testing import TcpProxy, eventually


async def test_rows_of_a_claim_whose_answer_was_lost_go_back_at_the_next_claim(
    pg_url: str,
) -> None:
    proxy = await TcpProxy("127.0.0.1", 5432).start()
    database = pg_url.rsplit("/", 1)[1]
    via_proxy = f"postgresql://postgres@127.0.0.1:{proxy.port}/{database}"
    broker = memory_broker(f"claim-lost-{uuid.uuid4().hex[:8]}")
    relay = Relay.from_settings(
        load_settings(
            {
                "db": via_proxy,
                "broker": f"memory://{broker.name}",
                "poll_interval": 0.1,
                "lock_timeout": 60.0,  # far beyond the test's patience
            },
            environ={},
        )
    )
    lock_key = relay.store.lock_key(DEFAULT_DESTINATION)
    with psycopg.connect(pg_url, autocommit=True) as conn:
        sent = [outboxer.enqueue(conn, "t", {"n": n}, key=f"k{n % 2}") for n in range(4)]
    holder = psycopg.connect(pg_url, autocommit=True)
    # The destination's claim lock, held: the relay's claim waits for it in the database.
    holder.execute("SELECT pg_advisory_lock(%s)", (lock_key,))
    task = asyncio.create_task(relay.run())
    try:

        async def claim_waiting() -> bool:
            row = holder.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = %s "
                "AND application_name = 'outboxer-relay' AND wait_event = 'advisory'",
                (database,),
            ).fetchone()
            return row is not None and row[0] >= 1

        await eventually(claim_waiting, timeout=20)
        await proxy.cut()  # the claim's answer can no longer reach the relay
        await eventually(lambda: _true(relay.stats.store_errors > 0), timeout=20)
        await proxy.restore()
        holder.execute("SELECT pg_advisory_unlock(%s)", (lock_key,))

        async def orphaned_claim_committed() -> bool:
            row = holder.execute(
                "SELECT count(*) FROM outboxer.outbox WHERE status <> 'PENDING'"
            ).fetchone()
            return row is not None and row[0] >= 1

        await eventually(orphaned_claim_committed, timeout=20)

        async def delivered() -> bool:
            return len({m.id for m in broker.messages}) == len(sent)

        # Before: nothing for the lock timeout (60 s), then one row a claim, attempts counted.
        await eventually(delivered, timeout=15)
    finally:
        relay.stop()
        await asyncio.wait_for(task, 30)
        await proxy.stop()
        holder.close()
    with psycopg.connect(pg_url) as conn:
        rows = conn.execute("SELECT status, attempts FROM outboxer.outbox ORDER BY seq").fetchall()
    assert rows == [("PUBLISHED", 0)] * len(sent), "no attempt charged for the lost answer"
    assert relay.stats.recovered == 0
    by_key: dict[str | None, list[str]] = {}
    for message in broker.messages:
        by_key.setdefault(message.key, []).append(message.id)
    assert by_key == {
        "k0": [sent[0].id, sent[2].id],
        "k1": [sent[1].id, sent[3].id],
    }, "each once, in key order"


async def _true(value: bool) -> bool:
    return value


async def test_a_row_recovered_by_a_claim_whose_answer_was_lost_is_recovered_alone_again(
    pg_url: str,
) -> None:
    """The lost claim recovered a dead relay's row (alone, as the message may be what kills
    relays). Given back as FAILED, it would be claimed in a batch with the next rows and
    take them down with it if it kills this relay too: it is recovered alone again."""
    proxy = await TcpProxy("127.0.0.1", 5432).start()
    database = pg_url.rsplit("/", 1)[1]
    via_proxy = f"postgresql://postgres@127.0.0.1:{proxy.port}/{database}"
    broker = memory_broker(f"claim-lost-{uuid.uuid4().hex[:8]}")
    relay = Relay.from_settings(
        load_settings(
            {
                "db": via_proxy,
                "broker": f"memory://{broker.name}",
                "poll_interval": 0.1,
                "lock_timeout": 60.0,
                "concurrency": 1,
            },
            environ={},
        )
    )
    lock_key = relay.store.lock_key(DEFAULT_DESTINATION)
    with psycopg.connect(pg_url, autocommit=True) as conn:
        sent = [outboxer.enqueue(conn, "t", {"n": n}, key=f"k{n}") for n in range(3)]
        # The first row was in flight when its relay died: its lease has expired.
        conn.execute(
            "UPDATE outboxer.outbox SET status = 'PROCESSING', locked_by = 'dead', "
            "lease = gen_random_uuid(), locked_until = now() - interval '1 second' "
            "WHERE id = %s",
            (sent[0].id,),
        )
    holder = psycopg.connect(pg_url, autocommit=True)
    holder.execute("SELECT pg_advisory_lock(%s)", (lock_key,))
    task = asyncio.create_task(relay.run())
    try:

        async def claim_waiting() -> bool:
            row = holder.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = %s "
                "AND application_name = 'outboxer-relay' AND wait_event = 'advisory'",
                (database,),
            ).fetchone()
            return row is not None and row[0] >= 1

        await eventually(claim_waiting, timeout=20)
        await proxy.cut()
        await eventually(lambda: _true(relay.stats.store_errors > 0), timeout=20)
        await proxy.restore()
        holder.execute("SELECT pg_advisory_unlock(%s)", (lock_key,))

        async def recovered_by_the_lost_claim() -> bool:
            row = holder.execute(
                "SELECT attempts FROM outboxer.outbox WHERE id = %s", (sent[0].id,)
            ).fetchone()
            return row is not None and row[0] >= 1

        await eventually(recovered_by_the_lost_claim, timeout=20)

        async def delivered() -> bool:
            return len({m.id for m in broker.messages}) == len(sent)

        await eventually(delivered, timeout=15)
    finally:
        relay.stop()
        await asyncio.wait_for(task, 30)
        await proxy.stop()
        holder.close()
    assert relay.stats.recovered == 1, "recovered alone by this relay, not claimed in a batch"
    assert broker.messages[0].id == sent[0].id
