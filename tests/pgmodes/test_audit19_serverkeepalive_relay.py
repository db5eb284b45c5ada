"""PostgreSQL ends the reader-lock session of a stream relay whose host vanished within about
COMMAND_TIMEOUT, so a standby relay on another host takes the stream over.

Before, the lock's session (idle by design, for the relay's life) was noticed gone only by the
server's TCP keepalives with the kernel's defaults (a first probe after two hours, given up
some eleven minutes later): the standby was refused "already being read by another relay" all
that time. Now the session's first query also sets its ``tcp_keepalives_*`` from
COMMAND_TIMEOUT (30 s idle, 3 probes 10 s apart for the default minute), where nothing
configures them; the mode's own connection, its schema connections and their sockets too.

The fault is real: iptables drops every packet the first relay's lock socket sends the server
(see tests/integration/test_audit19_serverkeepalive_consumer.py). Read-backs for the others.
"""

from __future__ import annotations

import time
import uuid

import psycopg
import pytest

from outboxer.stores import pgmodes
from outboxer.stores.pglog import PgLog
from outboxer.stores.pgmodes import ReaderLock
from tests.integration.test_audit19_keepalive_sockets import client_socket, keepalives
from tests.integration.test_audit19_serverkeepalive_consumer import (
    require_iptables,
    vanish_ready,
    vanished,
)

#: The relays' bound here: server keepalives of 1 s idle, then 3 probes 1 s apart (about 4 s).
BOUND = 3.0
#: The standby's wait for the lock, at most: 3x the bound.
WAIT = 3 * BOUND
SETTINGS = (
    "SELECT current_setting('tcp_keepalives_idle'), current_setting('tcp_keepalives_interval'),"
    " current_setting('tcp_keepalives_count')"
)


async def test_a_vanished_relays_reader_lock_is_released_within_about_its_bound(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    require_iptables()
    monkeypatch.setattr(pgmodes, "COMMAND_TIMEOUT", BOUND)
    key = f"outboxer-test-reader:{uuid.uuid4().hex}"
    first = ReaderLock(pg_url, key, "first relay")
    standby = ReaderLock(pg_url, key, "standby relay")
    try:
        assert await first.acquire()
        assert not await standby.acquire()  # refused while the first relay reads
        assert first._session is not None
        client, server = await vanish_ready(pg_url, first._session[0])
        with vanished(client, server), psycopg.connect(pg_url, autocommit=True) as waiter:
            waiter.execute(f"SET lock_timeout = '{WAIT:g}s'")
            started = time.monotonic()
            # Granted once the server ended the vanished relay's session (lock_timeout
            # otherwise: LockNotAvailable after 9 s).
            waiter.execute("SELECT pg_advisory_lock(hashtextextended(%s, 0))", (key,))
            waited = time.monotonic() - started
            waiter.execute("SELECT pg_advisory_unlock(hashtextextended(%s, 0))", (key,))
        assert waited < 2.5 * BOUND, waited  # 4.04 s measured; slack for a loaded box
        assert await standby.acquire()  # the standby relay takes the stream over
    finally:
        await standby.release()
        await first.release()


async def test_the_mode_connection_and_schema_connections_get_keepalives(pg_url: str) -> None:
    """The default minute: 30 s idle, 10 s apart, 3 probes, on the server's end and on the
    socket (asyncpg sets none); a schema connection's too, though its statements have no
    bound."""
    async with PgLog(pg_url) as log:
        assert tuple(await log.conn.fetchrow(SETTINGS)) == ("30", "10", "3")
        async with log.schema_connection() as conn:
            assert tuple(await conn.fetchrow(SETTINGS)) == ("30", "10", "3")
            port = await conn.fetchval("SELECT inet_client_port()")
            with client_socket(port) as sock:
                assert keepalives(sock) == (1, 30, 10, 3)
    lock = ReaderLock(pg_url, f"outboxer-test-reader:{uuid.uuid4().hex}", "relay")
    try:
        assert await lock.acquire()
        assert tuple(await lock._conn.fetchrow(SETTINGS)) == ("30", "10", "3")
    finally:
        await lock.release()
