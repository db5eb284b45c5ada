"""The table relay's wake-up listener gets the same TCP keepalives as its pool.

cd9d7f5 gave the relay's pool and schema connections keepalives of about COMMAND_TIMEOUT on
both ends, but not the connection that LISTENs for wake-ups (``outboxer-relay-listen``): a
relay whose host vanished left that session to the server's defaults, over two hours, and it
counts among the relay's sessions, so ``outboxer schema migrate-partitioned`` was refused
("… session(s) of outboxer relays … are connected") all that time, besides the connection
slot. Read back (server and socket), and proven with the listener's packets dropped
(iptables, as test_audit19_serverkeepalive_consumer.py).
"""

from __future__ import annotations

import psycopg
import pytest

from outboxer.stores import postgres
from outboxer.stores.postgres import PostgresStore
from tests.integration.test_audit19_keepalive_sockets import client_socket, keepalives
from tests.integration.test_audit19_serverkeepalive_consumer import (
    require_iptables,
    vanish_ready,
    vanished,
)
from tests.relaying import until

#: Server keepalives of 1 s idle, then 3 probes 1 s apart (about 4 s).
BOUND = 3.0
SETTINGS = (
    "SELECT current_setting('tcp_keepalives_idle'), current_setting('tcp_keepalives_interval'),"
    " current_setting('tcp_keepalives_count')"
)


async def test_the_listener_gets_keepalives_on_both_ends(pg_url: str) -> None:
    store = PostgresStore(pg_url)
    await store.connect()
    try:
        await store._ensure_listener()
        listener = store._listener
        assert tuple(await listener.fetchrow(SETTINGS)) == ("30", "10", "3")  # old: 7200
        port = await listener.fetchval("SELECT inet_client_port()")
        with client_socket(port) as sock:
            assert keepalives(sock) == (1, 30, 10, 3)
    finally:
        await store.close()


def _relay_sessions(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND application_name LIKE 'outboxer-relay%%'"
        ).fetchone()
    assert row is not None
    return int(row[0])


async def test_a_vanished_relays_listener_session_ends_within_about_its_bound(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    require_iptables()
    monkeypatch.setattr(postgres, "COMMAND_TIMEOUT", BOUND)
    store = PostgresStore(pg_url)
    try:
        await store._ensure_listener()  # no pool: the listener is the relay's one session
        assert _relay_sessions(pg_url) == 1
        client, server = await vanish_ready(pg_url, store._listener.get_server_pid())
        with vanished(client, server):
            # What `schema migrate-partitioned` counts (relays_connected): 0 once the server
            # ended the vanished relay's listener. Old code: still 1 (hours).
            await until(
                lambda: _relay_sessions(pg_url) == 0,
                "the vanished relay's listener session ended",
                2.5 * BOUND,
            )
    finally:
        listener, store._listener = store._listener, None
        if listener is not None:
            listener.terminate()
