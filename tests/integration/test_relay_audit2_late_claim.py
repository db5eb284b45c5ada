"""A claim that answers after its lease would have ended (it waited longer than the lock
timeout for the destination's lock) must publish nothing: another relay may already have
taken its rows over. It published its batch all the same (the first wave goes out before
the lease's timer gets a turn), so a row reached the broker from two relays at once."""

from __future__ import annotations

import asyncio
import uuid

import psycopg

import outboxer
from outboxer import Relay, load_settings
from outboxer.brokers.memory import memory_broker
from outboxer.message import DEFAULT_DESTINATION
from outboxer.testing import eventually


def _relay(url: str, broker: str, relay_id: str) -> Relay:
    return Relay.from_settings(
        load_settings(
            {
                "db": url,
                "broker": f"memory://{broker}",
                "relay_id": relay_id,
                "poll_interval": 0.05,
                "lock_timeout": 1.0,
                "concurrency": 1,
            },
            environ={},
        )
    )


async def test_a_claim_answered_after_its_lease_ended_publishes_nothing(pg_url: str) -> None:
    database = pg_url.rsplit("/", 1)[1]
    broker = memory_broker(f"late-claim-{uuid.uuid4().hex[:8]}")
    late, other = _relay(pg_url, broker.name, "late"), _relay(pg_url, broker.name, "other")
    lock_key = late.store.lock_key(DEFAULT_DESTINATION)
    with psycopg.connect(pg_url, autocommit=True) as conn:
        sent = [outboxer.enqueue(conn, "t", {"n": n}, key=f"k{n}") for n in range(5)]
    holder = psycopg.connect(pg_url, autocommit=True)
    holder.execute("SELECT pg_advisory_lock(%s)", (lock_key,))

    def waiting_claims() -> list[tuple[object, ...]]:
        return holder.execute(
            "SELECT EXTRACT(EPOCH FROM now() - xact_start) FROM pg_stat_activity "
            "WHERE datname = %s AND application_name = 'outboxer-relay' "
            "AND wait_event = 'advisory'",
            (database,),
        ).fetchall()

    tasks = [asyncio.create_task(late.run())]
    try:
        await eventually(lambda: _true(len(waiting_claims()) == 1), timeout=20)
        tasks.append(asyncio.create_task(other.run()))  # queued behind the first claim
        await eventually(lambda: _true(len(waiting_claims()) == 2), timeout=20)
        # The first claim's lease (1 s from its start) has ended before it can commit.
        await eventually(
            lambda: _true(max(float(str(age)) for (age,) in waiting_claims()) > 1.5), timeout=20
        )
        holder.execute("SELECT pg_advisory_unlock(%s)", (lock_key,))

        async def settled() -> bool:
            row = holder.execute(
                "SELECT count(*) FROM outboxer.outbox WHERE status = 'PUBLISHED'"
            ).fetchone()
            return row is not None and row[0] == len(sent)

        await eventually(settled, timeout=20)
    finally:
        for relay in (late, other):
            relay.stop()
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
        holder.close()
    delivered = [message.id for message in broker.messages]
    assert sorted(delivered) == sorted(m.id for m in sent), f"each once: {delivered}"
    assert late.stats.leases_lost == 1


async def _true(value: bool) -> bool:
    return value
