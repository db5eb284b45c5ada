"""A settle whose connection is cut after its transaction committed: the relay retries it,
finds its rows settled, and must not count them as taken over by another relay."""

from __future__ import annotations

import asyncio
import uuid

import psycopg

import outboxer
from outboxer import Relay, load_settings
from outboxer.brokers.memory import memory_broker
from outboxer.message import DEFAULT_DESTINATION
from outboxer.testing import TcpProxy, eventually


async def test_a_settle_whose_answer_was_lost_is_not_counted_as_taken_over(pg_url: str) -> None:
    proxy = await TcpProxy("127.0.0.1", 5432).start()
    database = pg_url.rsplit("/", 1)[1]
    via_proxy = f"postgresql://postgres@127.0.0.1:{proxy.port}/{database}"
    broker = memory_broker(f"settle-lost-{uuid.uuid4().hex[:8]}")
    broker.latency = 1.0
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
    holder = psycopg.connect(pg_url, autocommit=True)
    task = asyncio.create_task(relay.run())
    try:
        await eventually(lambda: _true(relay.stats.claimed == len(sent)), timeout=20)
        holder.execute("SELECT pg_advisory_lock(%s)", (lock_key,))  # the settle waits

        async def settle_waiting() -> bool:
            row = holder.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = %s "
                "AND application_name = 'outboxer-relay' AND wait_event = 'advisory'",
                (database,),
            ).fetchone()
            return row is not None and row[0] >= 1

        await eventually(settle_waiting, timeout=20)
        await proxy.cut()
        await eventually(lambda: _true(relay.stats.store_errors > 0), timeout=20)
        holder.execute("SELECT pg_advisory_unlock(%s)", (lock_key,))

        async def settled() -> bool:
            row = holder.execute(
                "SELECT count(*) FROM outboxer.outbox WHERE status = 'PUBLISHED'"
            ).fetchone()
            return row is not None and row[0] == len(sent)

        await eventually(settled, timeout=20)
        await proxy.restore()
        await eventually(lambda: _true(relay.stats.published + relay.stats.lost == 3), timeout=20)
    finally:
        relay.stop()
        await asyncio.wait_for(task, 30)
        await proxy.stop()
        holder.close()
    assert (relay.stats.published, relay.stats.lost) == (3, 0), relay.stats


async def _true(value: bool) -> bool:
    return value
