"""Review of the PostgreSQL wake-up listener's bound (``listener_timeout``): a registration
that waited for a lock on the listeners' table was given up on by asyncpg, and the listener
terminated (_drop_listener). asyncpg's cancel request for the statement went with it (a
terminated connection abandons its pending cancellations), so the server session went on
waiting for the lock. The next wait registered on a new listener, which waited too: one more
session every ``listener_timeout`` plus a poll (6 s by default), all held until the lock
went, up to the server's max_connections, when the applications' own connections failed.
Now the server gives the statement up too (the listener session's statement_timeout).

The hung registration is made for real: another connection holds an EXCLUSIVE lock on the
listeners' table, as in test_audit17_bounds_pg_listener_lock."""

from __future__ import annotations

import asyncio

import asyncpg

from outboxer.stores.postgres import PostgresStore
from tests.integration.test_audit17_bounds_pg_listener_lock import listeners_waiting_for_a_lock
from tests.receiver import Receiver
from tests.relaying import all_published, enqueue, relay, until

#: The shortened bound (5 s by default).
LISTENER_TIMEOUT = 1.0


async def test_a_registration_given_up_on_leaves_no_session_waiting_on_the_server(
    pg_url: str,
) -> None:
    receiver = Receiver().start()
    waiting = relay(pg_url, receiver.url, poll_interval=0.1)
    assert isinstance(waiting.store, PostgresStore)
    waiting.store.listener_timeout = LISTENER_TIMEOUT
    running = asyncio.create_task(waiting.run())
    holder = await asyncpg.connect(pg_url)
    observer = await asyncpg.connect(pg_url)
    try:
        enqueue(pg_url, ("order.placed", "k"))
        await until(lambda: all_published(pg_url, 1), "the first message is published", 8)
        await holder.execute("BEGIN")
        await holder.execute("LOCK TABLE outboxer.outbox_listeners IN EXCLUSIVE MODE")
        seen: list[int] = []  # the sessions seen waiting, in order

        async def given_up_twice() -> bool:
            for pid in sorted(await listeners_waiting_for_a_lock(observer)):
                if pid not in seen:
                    seen.append(pid)
            return len(seen) >= 3

        await until(given_up_twice, "two registrations given up on, a third waits", 10)
        still = await listeners_waiting_for_a_lock(observer)
        # Before: every session given up on still waited for the lock (until it went).
        assert seen[0] not in still
        assert len(still) <= 1
        enqueue(pg_url, ("order.placed", "k"))  # and the relay polls meanwhile
        await until(lambda: all_published(pg_url, 2), "published while the lock is held", 5)
        assert not running.done()
    finally:
        await holder.close()  # rolls back: the lock goes
        await observer.close()
        waiting.stop()
        try:
            await asyncio.wait_for(running, 10)
        finally:
            receiver.stop()
