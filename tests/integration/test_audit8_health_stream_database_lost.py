"""The stream relay whose database sessions are ended (``pg_terminate_backend``) and whose
stream cannot be taken back at once: the reader lock taken by another session (log mode),
the slot dropped (WAL outbox). /health, /status and /metrics kept the first error the lost
connection gave (asyncpg's "cannot switch to state 12; another operation (2) is in
progress") for as long as the reconnect failed, never why it failed; and the reconnect
backed off up to 30 s whatever ``outage_backoff_max`` said. Now /health names the current
cause, and the relay is back within ``outage_backoff_max`` of the cause going.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import psycopg
import pytest

from outboxer.brokers.memory import MemoryPublisher, memory_broker
from outboxer.enqueue import Outbox
from outboxer.http import Request
from outboxer.stores.pglog import PgLog, reader_lock_key
from outboxer.stores.pgwal import PgWal
from outboxer.stream_api import StreamApi, stream_metrics
from outboxer.streamrelay import StreamRelay, StreamSource
from outboxer.testing import eventually
from tests.pgmodes.conftest import logical_pg, logical_url  # noqa: F401 -- fixtures

#: The relay's outage backoff limit here: it reconnects at least this often.
LIMIT = 0.1

TERMINATE = (
    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
    "WHERE application_name = 'outboxer-relay' AND datname = current_database()"
)


async def problems(api: StreamApi) -> list[str]:
    response = await api.handle(Request("GET", "/health"))
    body = json.loads(response.body)
    assert (response.status == 200) == (body["status"] == "ok")
    return list(body.get("reasons", []))


@contextlib.asynccontextmanager
async def running(source: StreamSource, name: str) -> AsyncIterator[tuple[StreamRelay, StreamApi]]:
    memory_broker(name).clear()
    relay = StreamRelay(
        source, MemoryPublisher(f"memory://{name}"), poll_interval=0.01, outage_backoff_max=LIMIT
    )
    api = StreamApi(relay, stream_metrics(relay))
    stop = asyncio.Event()
    await source.connect()
    task = asyncio.create_task(relay.run(stop))
    try:

        async def healthy() -> bool:
            return await problems(api) == []

        await eventually(healthy, timeout=5)
        yield relay, api
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await source.close()


@pytest.fixture
async def log_relay(pg_url: str) -> AsyncIterator[tuple[StreamRelay, StreamApi]]:
    async with PgLog(pg_url) as log:
        await log.apply_schema()
    async with running(PgLog(pg_url).reader("default"), "audit8-db-lost-log") as each:
        yield each


async def test_log_reader_lock_taken_meanwhile_is_the_reason_shown(
    pg_url: str, log_relay: tuple[StreamRelay, StreamApi]
) -> None:
    relay, api = log_relay
    with psycopg.connect(pg_url, autocommit=True) as other:
        other.execute(TERMINATE)
        # Granted once the relay's lock session is gone, before its first reconnect.
        other.execute(
            "SELECT pg_advisory_lock(hashtextextended(%s, 0))",
            (reader_lock_key(PgLog(pg_url), "default"),),
        )

        async def taken() -> bool:
            return any("already being read by another relay" in p for p in await problems(api))

        await eventually(taken, timeout=2)
        response = await api.handle(Request("GET", "/metrics"))
        assert b'outboxer_stream_relay_healthy{destination="default",mode="log"} 0.0' in (
            response.body
        )
        await asyncio.sleep(1.6)  # long enough for a 30 s-bounded backoff to pass 1 s
        with psycopg.connect(pg_url) as conn:
            Outbox(mode="log").enqueue(conn, "t", {"n": 1})
    loop = asyncio.get_running_loop()
    released_at = loop.time()

    async def back() -> bool:
        return relay.stats.published == 1 and await problems(api) == []

    await eventually(back, timeout=5)
    assert loop.time() - released_at < 0.8


async def test_wal_slot_dropped_meanwhile_is_the_reason_shown(
    logical_url: str,  # noqa: F811 -- the fixture
) -> None:
    prefix = logical_url.rsplit("/", 1)[1]
    async with PgWal(logical_url, slot_prefix=prefix) as wal:
        await wal.apply_schema()
        assert await wal.create_slot("default")
        slot = wal.slot_name("default")
    source = PgWal(logical_url, slot_prefix=prefix, keepalive_seconds=0.05).reader("default")
    async with running(source, "audit8-db-lost-wal") as (_, api):
        with psycopg.connect(logical_url, autocommit=True) as admin:
            admin.execute(TERMINATE)
            for _ in range(200):  # busy while a peek of the relay (or its ended session) has it
                try:
                    admin.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
                    break
                except psycopg.errors.ObjectInUse:
                    await asyncio.sleep(0.01)

        async def named() -> bool:
            return any(slot in p and "does not exist" in p for p in await problems(api))

        await eventually(named, timeout=2)


async def test_wal_slot_dropped_under_a_connected_relay_is_an_outage_not_a_crash(
    logical_url: str,  # noqa: F811 -- the fixture
) -> None:
    """The relay's sessions stay: its next peek met the driver's "replication slot … does
    not exist" (42704), which ended the relay; now an outage /health names, as connect's."""
    prefix = logical_url.rsplit("/", 1)[1]
    async with PgWal(logical_url, slot_prefix=prefix) as wal:
        await wal.apply_schema()
        assert await wal.create_slot("default")
        slot = wal.slot_name("default")
    source = PgWal(logical_url, slot_prefix=prefix, keepalive_seconds=0.05).reader("default")
    async with running(source, "audit8-slot-dropped") as (relay, api):
        with psycopg.connect(logical_url, autocommit=True) as admin:
            for _ in range(200):  # taken by each peek of the relay for its call
                try:
                    admin.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
                    break
                except psycopg.errors.ObjectInUse:
                    await asyncio.sleep(0.005)

        async def named() -> bool:
            return any(slot in p and "does not exist" in p for p in await problems(api))

        await eventually(named, timeout=2)
        assert relay.stats.outages >= 1
