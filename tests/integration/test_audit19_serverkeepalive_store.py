"""The table-mode relay's PostgreSQL connections carry TCP keepalives of about its statement
bound (a minute: 30 s idle, 3 probes 10 s apart) on both ends: the pool's and the schema
connections' (whose statements have no bound).

Before, the server noticed a relay host that vanished mid-transaction only with the kernel's
defaults (hours), its locks held meanwhile (a schema change's ACCESS EXCLUSIVE on the outbox
table: every writer behind it); and a schema change whose database host vanished waited for
its answer for ever (asyncpg sets no keepalives). Read back from the live sessions and
sockets (the vanished-peer proof with real dropped packets is in
test_audit19_serverkeepalive_consumer.py and tests/pgmodes/test_audit19_serverkeepalive_relay.py).
"""

from __future__ import annotations

from outboxer.stores.postgres import PostgresStore
from tests.integration.test_audit19_keepalive_sockets import client_socket, keepalives

SETTINGS = (
    "SELECT current_setting('tcp_keepalives_idle'), current_setting('tcp_keepalives_interval'),"
    " current_setting('tcp_keepalives_count')"
)
MINUTE = ("30", "10", "3")


async def test_the_relay_pool_and_schema_connection_get_keepalives(pg_url: str) -> None:
    store = PostgresStore(pg_url)
    await store.connect()
    try:
        async with store._pool.acquire() as conn:
            assert tuple(await conn.fetchrow(SETTINGS)) == MINUTE
            port = await conn.fetchval("SELECT inet_client_port()")
            with client_socket(port) as sock:
                assert keepalives(sock) == (1, 30, 10, 3)
        async with store._schema_connection() as conn:
            assert tuple(await conn.fetchrow(SETTINGS)) == MINUTE
            port = await conn.fetchval("SELECT inet_client_port()")
            with client_socket(port) as sock:
                assert keepalives(sock) == (1, 30, 10, 3)
    finally:
        await store.close()
