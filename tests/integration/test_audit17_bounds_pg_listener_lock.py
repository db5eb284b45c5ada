"""The PostgreSQL relay's wake-up listener no longer waits for ever on a statement that gets
no answer: its connection had no statement timeout, and a registration (or withdrawal)
blocked by a lock another session holds on the listeners' table kept the listener's lock,
and with it every idle loop of the relay: nothing was claimed, however long the lock was
held. Now the statement gives up after ``listener_timeout`` and the relay polls.

The hung statement is made for real: another connection holds an EXCLUSIVE lock on the
table (writers still read it, as their trigger does), and the test waits until the
listener's statement is seen waiting for it in pg_stat_activity before it commits a row."""

from __future__ import annotations

import asyncio

import asyncpg

from outboxer.stores.postgres import PostgresStore
from tests.receiver import Receiver
from tests.relaying import all_published, enqueue, relay, until

#: The shortened bound (5 s by default): long enough to see the statement wait.
LISTENER_TIMEOUT = 2.0


async def listeners_waiting_for_a_lock(admin: asyncpg.Connection) -> set[int]:
    """The listener sessions whose statement waits for a lock."""
    rows = await admin.fetch(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
        "AND application_name = 'outboxer-relay-listen' AND wait_event_type = 'Lock'"
    )
    return {row["pid"] for row in rows}


async def _listener_waits_for_a_lock(admin: asyncpg.Connection) -> bool:
    return bool(await listeners_waiting_for_a_lock(admin))


async def test_a_relay_whose_listener_waits_for_a_lock_polls_and_publishes(pg_url: str) -> None:
    receiver = Receiver().start()
    waiting = relay(pg_url, receiver.url, poll_interval=1.0)
    assert isinstance(waiting.store, PostgresStore)
    waiting.store.listener_timeout = LISTENER_TIMEOUT
    running = asyncio.create_task(waiting.run())
    holder = await asyncpg.connect(pg_url)
    observer = await asyncpg.connect(pg_url)
    try:
        enqueue(pg_url, ("order.placed", "k"))
        await until(lambda: all_published(pg_url, 1), "the first message is published", 8)
        # Idle now, and listening: it renews its registration about once a second.
        await holder.execute("BEGIN")
        await holder.execute("LOCK TABLE outboxer.outbox_listeners IN EXCLUSIVE MODE")
        await until(
            lambda: _listener_waits_for_a_lock(observer),
            "the listener's statement waits for the lock",
            5,
        )
        enqueue(pg_url, ("order.placed", "k"))
        # Before: the relay waited with its listener for as long as the lock was held.
        await until(lambda: all_published(pg_url, 2), "published while the lock is held", 6)
        assert not running.done()
    finally:
        await holder.close()  # rolls back: the lock goes
        await observer.close()
        waiting.stop()
        try:
            await asyncio.wait_for(running, 10)
        finally:
            receiver.stop()
