"""PostgresStore keeps the connections of its claims and settles between statements, and
gives them back to the pool after a failure, when it goes idle, and on close."""

from __future__ import annotations

import asyncio

import psycopg

import outboxer
from outboxer.stores.postgres import QUIET_WAIT, PostgresStore


async def test_statements_reuse_one_connection_and_close_gives_it_back(pg_url: str) -> None:
    store = PostgresStore(pg_url)
    await store.connect()
    try:
        for _ in range(5):
            await store.claim("default", "r", 10, 30, False)
        assert len(store._kept) == 1, "one loop, one connection, kept between statements"
        assert store._pool.get_idle_size() == store._pool.get_size() - 1
    finally:
        # The pool's close waits for every connection acquired from it: a kept one that
        # was not given back would hang here.
        await asyncio.wait_for(store.close(), 10)


async def test_a_cancelled_statement_gives_its_connection_back_to_the_pool(pg_url: str) -> None:
    store = PostgresStore(pg_url)
    await store.connect()
    try:
        with psycopg.connect(pg_url, autocommit=True) as holder:
            # The claim waits for the destination's lock, held here.
            holder.execute("SELECT pg_advisory_lock(%s)", (store.lock_key("default"),))
            claim = asyncio.create_task(store.claim("default", "r", 10, 30, False))
            await asyncio.sleep(0.3)
            claim.cancel()
            await asyncio.gather(claim, return_exceptions=True)
            assert store._kept == [], "not kept: the pool checks what a failure may have left"
            holder.execute("SELECT pg_advisory_unlock(%s)", (store.lock_key("default"),))
        with psycopg.connect(pg_url) as conn:
            outboxer.enqueue(conn, "t", {"n": 1})
        assert len(await store.claim("default", "r", 10, 30, False)) == 1
    finally:
        await asyncio.wait_for(store.close(), 10)


async def test_an_idle_store_gives_its_connections_back_to_the_pool(pg_url: str) -> None:
    store = PostgresStore(pg_url)
    await store.connect()
    try:
        await asyncio.gather(*(store.claim("default", "r", 10, 30, False) for _ in range(3)))
        assert len(store._kept) == 3
        assert await store.wait_for_wakeup("default", 0.05) is True, "registered: look once"
        store.reset_wakeup("default")  # as the relay does before each claim
        assert await store.wait_for_wakeup("default", 0.05) is False, "nothing came"
        assert len(store._kept) == 3, "a short wait (the relay's grace) keeps them"
        assert await store.wait_for_wakeup("default", QUIET_WAIT) is False, "nothing came"
        assert store._kept == []
        assert store._pool.get_idle_size() == store._pool.get_size()
    finally:
        await asyncio.wait_for(store.close(), 10)


async def test_close_while_a_statement_runs_waits_for_it_and_does_not_hang(pg_url: str) -> None:
    """A lease renewal may still be running when the relay closes its store: its connection
    must go back to the pool, not into the kept list (the pool's close waits for it)."""
    store = PostgresStore(pg_url)
    await store.connect()
    with psycopg.connect(pg_url, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(%s)", (store.lock_key("default"),))
        late = asyncio.create_task(store.claim("default", "r", 10, 30, False))
        await asyncio.sleep(0.3)  # the claim waits for the lock held here
        closing = asyncio.create_task(store.close())
        await asyncio.sleep(0.3)
        assert not closing.done(), "close waits for the statement in flight"
        holder.execute("SELECT pg_advisory_unlock(%s)", (store.lock_key("default"),))
        await asyncio.wait_for(closing, 10)
    assert await late == []
    assert store._kept == []


async def test_more_loops_than_connections_all_go_on(pg_url: str) -> None:
    """Twelve loops running statements back to back on a pool of ten: a statement that waits
    for the pool gets the next connection that ends its statement. Kept instead, the ten
    connections went round the ten loops that had one, for as long as the load lasted
    (no quiet wait returns them), and the other two (a settle, a lease renewal) waited for
    ever."""
    store = PostgresStore(pg_url, pool_size=10)
    await store.connect()
    done = [0] * 12
    stop = asyncio.Event()

    async def loop(n: int) -> None:
        while not stop.is_set():
            await store.claim("default", f"r{n}", 10, 30, False)
            done[n] += 1

    loops = [asyncio.create_task(loop(n)) for n in range(12)]
    try:
        await asyncio.sleep(3)
        stop.set()
        await asyncio.wait_for(asyncio.gather(*loops), 10)
        assert min(done) > 0, f"statements per loop: {done}"
        assert store._acquiring == 0
    finally:
        for task in loops:
            task.cancel()
        await asyncio.wait_for(store.close(), 10)
