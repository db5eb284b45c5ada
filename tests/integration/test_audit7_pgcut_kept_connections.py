"""PostgresStore after the server cut its connections (pg_terminate_backend, a restart):
the connections it keeps between statements, and its LISTEN connection, are replaced by
the next statement, which succeeds at its first try instead of failing as an outage."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable

import psycopg

import outboxer
from outboxer import Relay, load_settings
from outboxer.brokers.memory import memory_broker
from outboxer.stores.postgres import PostgresStore
from outboxer.testing import eventually


def _terminate(url: str, application_name: str) -> int:
    """pg_terminate_backend on the sessions of this test's database with that name; returns
    once they have ended (their sockets closed)."""
    database = url.rsplit("/", 1)[1]
    query = (
        "SELECT pid FROM pg_stat_activity WHERE datname = %s AND application_name = %s "
        "AND pid <> pg_backend_pid()"
    )
    with psycopg.connect(url, autocommit=True) as admin:
        pids = [pid for (pid,) in admin.execute(query, (database, application_name))]
        for pid in pids:
            admin.execute("SELECT pg_terminate_backend(%s, 5000)", (pid,))
    return len(pids)


async def _until(condition: Callable[[], bool], seconds: float = 5.0) -> None:
    """Let the event loop read the server's goodbye (the sockets' end) until ``condition``."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "the store's connections never saw the cut"
        await asyncio.sleep(0.005)


async def test_kept_connections_cut_by_the_server_are_replaced_not_an_outage(
    pg_url: str,
) -> None:
    store = PostgresStore(pg_url)
    await store.connect()
    try:
        # Three loops at once: three connections kept between statements.
        await asyncio.gather(*(store.claim("default", "r", 10, 30, False) for _ in range(3)))
        kept = list(store._kept)
        assert len(kept) == 3
        assert _terminate(pg_url, "outboxer-relay") == 3
        await _until(lambda: all(conn._con is None for conn in kept))

        with psycopg.connect(pg_url) as conn:
            outboxer.enqueue(conn, "t", {"n": 1})
        # Each of the first statements would otherwise meet a dead kept connection.
        claims = await asyncio.gather(
            *(store.claim("default", "r", 10, 30, False) for _ in range(3))
        )
        claim = next(c for c in claims if c)
        assert sum(len(c) for c in claims) == 1
        result = await store.settle("default", claim.lease, [claim[0].seq], [], [], 5)
        assert result.published == 1
        assert store._unanswered == {}, "no claim went unanswered: none was sent"
    finally:
        await asyncio.wait_for(store.close(), 10)


async def test_a_statement_between_the_servers_goodbye_and_the_sockets_end_runs_again(
    pg_url: str,
) -> None:
    """asyncpg reads the server's FATAL goodbye a loop turn before the end of the socket;
    in between, the connection looks alive and refuses any statement ("cannot switch to
    state"), before sending it. The store runs the statement again on a new connection."""
    store = PostgresStore(pg_url)
    await store.connect()
    try:
        await asyncio.gather(*(store.claim("default", "r", 10, 30, False) for _ in range(3)))
        kept = list(store._kept)
        with psycopg.connect(pg_url) as conn:
            outboxer.enqueue(conn, "t", {"n": 1})
        # Blocks the loop until the sessions are gone: their goodbyes and ends wait unread.
        assert _terminate(pg_url, "outboxer-relay") == 3
        await asyncio.sleep(0)
        await asyncio.sleep(0)  # one turn: the goodbyes are read, the ends not yet
        assert not any(conn._con is None for conn in kept), "in the window"
        claim = await store.claim("default", "r", 10, 30, False)
        assert len(claim) == 1
        assert store._unanswered == {}
        assert (await store.settle("default", claim.lease, [claim[0].seq], [], [], 5)).published
    finally:
        await asyncio.wait_for(store.close(), 10)


async def test_a_cut_listen_connection_wakes_the_waiting_loops(pg_url: str) -> None:
    """The relay waits for a NOTIFY on its listening connection; cut, that connection hears
    nothing more, and a loop waiting on it slept its whole poll interval while writes came."""
    store = PostgresStore(pg_url)
    await store.connect()
    try:
        assert await store.wait_for_wakeup("default", 5) is True, "registered: look once"
        store.reset_wakeup("default")
        waiting = asyncio.create_task(store.wait_for_wakeup("default", 5))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        assert _terminate(pg_url, "outboxer-relay-listen") == 1
        assert await asyncio.wait_for(waiting, 2) is True, "woken to listen again"

        # The next wait listens on a new connection, and the writers' NOTIFY reaches it.
        store.reset_wakeup("default")
        waiting = asyncio.create_task(store.wait_for_wakeup("default", 5))
        await asyncio.sleep(0.1)
        with psycopg.connect(pg_url) as conn:
            outboxer.enqueue(conn, "t", {"n": 1})
        assert await asyncio.wait_for(waiting, 2) is True
    finally:
        await asyncio.wait_for(store.close(), 10)


async def test_a_relay_whose_sessions_were_cut_goes_on_without_an_outage(pg_url: str) -> None:
    """The relay's database sessions ended by the server while it works: its next claims and
    settles run on new connections at once, no outage is logged or backed off from."""
    broker = memory_broker(f"pgcut-{uuid.uuid4().hex[:8]}")
    relay = Relay.from_settings(
        load_settings(
            # A long poll interval: the loops wait on their NOTIFYs, keeping their
            # connections (only a wait that nobody cut short gives them back).
            {"db": pg_url, "broker": f"memory://{broker.name}", "poll_interval": 10},
            environ={},
        )
    )
    task = asyncio.create_task(relay.run())
    try:
        with psycopg.connect(pg_url) as conn:
            outboxer.enqueue(conn, "t", {"n": 1})
        await eventually(lambda: _true(len(broker.messages) == 1), timeout=5)
        store = relay.store
        assert isinstance(store, PostgresStore)
        # Settled, and waiting for the next NOTIFY (a cut in the middle of a statement is
        # an outage: its answer was lost).
        # Listening too: a relay that found the row at its first claim polls while busy and
        # opens its LISTEN connection only once a claim finds nothing (on a slow box the
        # enqueue came before the relay's first wait, and no listener was there yet). And
        # every loop parked on that wait: a fresh LISTEN sends a loop to claim once more
        # (what was committed before it took effect was not announced), and a cut during
        # that claim is an outage (in CI, three workers on two cores, the cut came then).
        await eventually(
            lambda: _true(
                bool(store._kept)
                and _published(pg_url) == 1
                and store._listener is not None
                and not store._listener.is_closed()
                and store._wakeups.registered
                and _parked(store, "default") == relay.settings.concurrency
            ),
            timeout=5,
        )
        kept = list(store._kept)
        assert _terminate(pg_url, "outboxer-relay") >= 1
        assert _terminate(pg_url, "outboxer-relay-listen") == 1
        await _until(lambda: all(conn._con is None for conn in kept))

        with psycopg.connect(pg_url) as conn:
            outboxer.enqueue(conn, "t", {"n": 2})
        await eventually(lambda: _true(len(broker.messages) == 2), timeout=3)
        assert relay.stats.store_errors == 0, "no outage: the store replaced what was cut"
        assert relay.health_problems() == []
    finally:
        relay.stop()
        await asyncio.wait_for(task, 10)


async def _true(value: bool) -> bool:
    return value


def _parked(store: PostgresStore, destination: str) -> int:
    """How many loops of ``destination`` wait for a nudge (no statement of theirs in flight)."""
    waiters = store._wakeups._waiters.get(destination, ())
    return sum(not waiter.done() for waiter in waiters)


def _published(url: str) -> int:
    with psycopg.connect(url) as conn:
        (count,) = conn.execute(
            "SELECT count(*) FROM outboxer.outbox WHERE status = 'PUBLISHED'"
        ).fetchall()[0]
        return int(count)
