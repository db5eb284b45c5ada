"""A MySQL that stops answering (a stalled network: a proxy that keeps the connections open
and forwards nothing; a listener that accepts and never answers) no longer holds the relay,
an admin change or a connect for ever: aiomysql has no read timeout, and every statement,
COMMIT and connect of MySQLStore now gives up after ``statement_timeout`` (StoreError).

Before, the relay's claim (or its wake-up probe) waited for ever: it published nothing, its
/health said nothing was wrong, and a requeue from the HTTP API or the CLI never returned.
The bound is shortened here (a minute by default) by setting it on the store."""

from __future__ import annotations

import asyncio
import time
from urllib.parse import urlsplit

import pytest

from outboxer import create_store
from outboxer.admin import MessageFilter
from outboxer.errors import StoreError
from outboxer.relay import Relay
from outboxer.stores.mysql import MySQLStore
from outboxer.testing import TcpProxy
from tests.receiver import Receiver
from tests.relaying import all_published, enqueue, relay, until
from tests.s3 import silent_listener

#: The shortened bound on each statement.
BOUND = 0.5
#: What the old code reached instead of an answer (it waited for ever).
GIVE_UP = 5.0


def _through(url: str, port: int) -> str:
    """``url`` with its host and port replaced by 127.0.0.1:``port``."""
    parts = urlsplit(url)
    user = f"{parts.username}@" if parts.username else ""
    return f"mysql://{user}127.0.0.1:{port}{parts.path}"


async def test_a_claim_and_a_requeue_on_a_stalled_mysql_fail_within_the_bound(
    mysql_url: str,
) -> None:
    proxy = await TcpProxy("127.0.0.1", urlsplit(mysql_url).port or 3306).start()
    store = create_store(_through(mysql_url, proxy.port))
    assert isinstance(store, MySQLStore)
    store.statement_timeout = BOUND
    try:
        await store.connect()
        await store.ping()  # the pool's connection works
        await proxy.blackhole()
        for what, call in (
            ("claim", lambda: store.claim("default", "relay-1", 10, 30.0, False)),
            ("requeue", lambda: store.requeue_matching(MessageFilter(statuses=("ABANDONED",)))),
        ):
            started = time.monotonic()
            async with asyncio.timeout(GIVE_UP):  # the old code waited here for ever
                with pytest.raises(StoreError, match=r"did not answer within 0\.5s"):
                    await call()
            assert time.monotonic() - started < 3 * BOUND + 1, what
        await proxy.restore()  # drops the stalled connections: the next call opens a new one
        await store.ping()
    finally:
        await proxy.restore()
        await store.close()
        await proxy.stop()


async def test_a_connect_to_a_mysql_that_never_answers_fails_within_the_bound() -> None:
    with silent_listener() as address:
        store = MySQLStore(f"mysql://root@{address}/outboxer")
        store.statement_timeout = BOUND
        started = time.monotonic()
        async with asyncio.timeout(GIVE_UP):  # the old code waited for the handshake for ever
            with pytest.raises(
                StoreError, match=r"cannot connect to MySQL: no answer within 0\.5s"
            ):
                await store.connect()
        assert time.monotonic() - started < 2 * BOUND + 1
        await store.close()


async def test_a_relay_on_a_stalled_mysql_reports_the_outage_and_publishes_after_it(
    mysql_url: str,
) -> None:
    """The relay's idle wait probes, then claims, on the stalled connections: each gives up
    within the bound, /health names the database, and once the network is back the relay
    publishes what was committed meanwhile, without a restart."""
    proxy = await TcpProxy("127.0.0.1", urlsplit(mysql_url).port or 3306).start()
    receiver = Receiver().start()
    cut_off: Relay = relay(_through(mysql_url, proxy.port), receiver.url)
    assert isinstance(cut_off.store, MySQLStore)
    cut_off.store.statement_timeout = BOUND
    running = asyncio.create_task(cut_off.run())
    try:
        await until(lambda: cut_off.health_problems() == [], "the relay runs", 10)
        await proxy.blackhole()
        enqueue(mysql_url, ("order.placed", "k"))  # committed directly, not through the proxy
        await until(
            lambda: any(p.startswith("database") for p in cut_off.health_problems()),
            "the relay reports the stalled database (it waited for ever, /health said ok)",
            GIVE_UP,
        )
        assert not running.done()
        await proxy.restore()
        await until(lambda: all_published(mysql_url, 1), "published after the stall", 8)
        assert cut_off.stats.published == 1
    finally:
        cut_off.stop()
        await proxy.restore()  # the old code's hung reads end with their connections
        try:
            await asyncio.wait_for(running, 10)
        finally:
            receiver.stop()
            await proxy.stop()
