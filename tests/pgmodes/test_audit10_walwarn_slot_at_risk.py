"""A WAL outbox slot close to invalidation (max_slot_wal_keep_size) is reported before its
messages are lost: the stream relay's backlog probe reads wal_status and safe_wal_size,
/metrics exports them, /health says "degraded" (still 200), and one WARNING names the slot
and the setting, once rather than at every probe.

A private server (max_slot_wal_keep_size would invalidate the slots of other tests).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import uuid
from collections.abc import AsyncIterator

import psycopg
import pytest

from outboxer.brokers.memory import MemoryBroker, MemoryPublisher, memory_broker
from outboxer.enqueue import Outbox
from outboxer.http import Request
from outboxer.retry import Backoff
from outboxer.stores.pgwal import PgWal
from outboxer.stream_api import StreamApi, stream_metrics
from outboxer.streamrelay import StreamRelay
from outboxer.streamtesting import wait_until

KEEP_LIMIT = 64 * 1024 * 1024


@pytest.fixture
def wal(small_slot_wal: PgWal) -> PgWal:
    return small_slot_wal


def _slot_row(url: str, slot: str) -> tuple[str, int | None]:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT wal_status, safe_wal_size FROM pg_replication_slots WHERE slot_name = %s",
            (slot,),
        ).fetchone()
    assert row is not None
    return row[0], row[1]


def _unreserve(url: str, slot: str) -> None:
    """Write WAL past max_slot_wal_keep_size, without a checkpoint: the slot is
    'unreserved' (the next checkpoint would invalidate it)."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SELECT pg_logical_emit_message(true, 'filler', repeat('x', 4096))")
        conn.execute("SELECT pg_switch_wal()")
    assert _slot_row(url, slot)[0] == "unreserved"


def _nearly_unreserve(url: str, slot: str, limit: int) -> int:
    """Write WAL until less than 10 % of ``limit`` is left before the slot is invalidated,
    while it is still reserved or extended: the safe size it has then."""
    with psycopg.connect(url, autocommit=True) as conn:
        for _ in range(200):
            status, safe = _slot_row(url, slot)
            assert status in ("reserved", "extended") and safe is not None, (status, safe)
            if safe < limit // 10:
                return safe
            if safe > limit // 10 + 16 * 1024 * 1024:
                conn.execute("SELECT pg_switch_wal()")  # a segment at a time
            else:
                conn.execute("SELECT pg_logical_emit_message(true, 'filler', repeat('x', 262144))")
    raise AssertionError("the slot's safe_wal_size did not come under 10 %")


def _enqueue(url: str) -> None:
    with psycopg.connect(url) as conn:
        Outbox(mode="wal").enqueue(conn, "orders", {"n": 1})
        conn.commit()


@pytest.fixture
async def stuck_relay(wal: PgWal) -> AsyncIterator[tuple[StreamRelay, StreamApi, str]]:
    """A relay probing its backlog every 20 ms, stuck on a message its broker refuses (its
    slot does not move): the slot falls behind as a failing relay's would."""
    async with PgWal(wal.url, slot_prefix=wal.slot_prefix) as admin:
        assert isinstance(admin, PgWal)
        assert await admin.create_slot("default")
    slot = wal.slot_name("default")
    _enqueue(wal.url)
    broker: MemoryBroker = memory_broker(f"walwarn-{uuid.uuid4().hex[:8]}")
    broker.fail = lambda message: RuntimeError("refused for the test")
    source = wal.reader("default")
    await source.connect()
    relay = StreamRelay(
        source,
        MemoryPublisher(f"memory://{broker.name}"),
        poll_interval=0.01,
        probe_interval=0.02,
        max_attempts=1_000_000,
        backoff=Backoff(base=0.01, cap=0.02),
        outage_backoff_max=0.05,
    )
    api = StreamApi(relay, stream_metrics(relay))
    stop = asyncio.Event()
    task = asyncio.create_task(relay.run(stop))
    try:
        assert await wait_until(lambda: relay.stats.backlog is not None, 10)
        yield relay, api, slot
    finally:
        stop.set()
        await asyncio.wait({task}, timeout=10)
        await source.close()
    assert not task.cancelled() and task.exception() is None, task.exception()


async def _health(api: StreamApi) -> tuple[int, dict[str, object]]:
    response = await api.handle(Request("GET", "/health"))
    return response.status, json.loads(response.body)


async def _metrics(api: StreamApi) -> str:
    return (await api.handle(Request("GET", "/metrics"))).body.decode()


def _sample(body: str, name: str, **labels: str) -> float | None:
    for line in body.splitlines():
        match = re.match(rf"^{name}\{{(.*)\}} (\S+)$", line)
        if match and all(f'{key}="{value}"' in match.group(1) for key, value in labels.items()):
            return float(match.group(2))
    return None


def _warnings(caplog: pytest.LogCaptureFixture, slot: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING
        and slot in r.getMessage()
        and "invalidated" in r.getMessage()
    ]


async def test_unreserved_slot_is_measured_exported_degraded_and_warned_once(
    stuck_relay: tuple[StreamRelay, StreamApi, str], caplog: pytest.LogCaptureFixture
) -> None:
    relay, api, slot = stuck_relay
    backlog = relay.stats.backlog
    assert backlog is not None
    assert backlog.wal_status in ("reserved", "extended")
    assert backlog.wal_safe_bytes is not None and backlog.wal_safe_bytes > 0
    assert backlog.wal_keep_limit_bytes == 1024 * 1024
    assert await _health(api) == (
        200,
        {"status": "ok", "mode": "wal", "destination": "default"},
    )
    body = await _metrics(api)
    assert (_sample(body, "outboxer_stream_wal_safe_bytes", destination="default") or 0) > 0
    assert _sample(body, "outboxer_stream_wal_status", status="reserved") is not None

    with caplog.at_level(logging.INFO, logger="outboxer"):
        await asyncio.to_thread(_unreserve, _url(relay), slot)
        assert await wait_until(
            lambda: (
                relay.stats.backlog is not None and relay.stats.backlog.wal_status == "unreserved"
            ),
            10,
        )
        probes = relay.stats.backlog_at
        # More probes see it: still one warning.
        assert await wait_until(lambda: relay.stats.backlog_at != probes, 5)
        await asyncio.sleep(0.2)
    [warning] = _warnings(caplog, slot)
    assert "max_slot_wal_keep_size" in warning and "unreserved" in warning

    status, health = await _health(api)
    assert status == 200, health
    assert health["status"] == "degraded"
    reasons = health["reasons"]
    assert isinstance(reasons, list) and any(slot in reason for reason in reasons), reasons
    body = await _metrics(api)
    assert _sample(body, "outboxer_stream_wal_status", status="unreserved") == 1
    assert _sample(body, "outboxer_stream_wal_status", status="reserved") == 0
    assert (_sample(body, "outboxer_stream_wal_safe_bytes") or 0) <= 0
    assert _sample(body, "outboxer_stream_relay_healthy") == 1


def _url(relay: StreamRelay) -> str:
    source = relay.source
    url = getattr(getattr(source, "wal", None), "url", None)
    assert isinstance(url, str)
    return url


async def test_safe_size_under_a_tenth_of_the_limit_warns_once_while_still_reserved(
    small_slot_pg: str,
    stuck_relay: tuple[StreamRelay, StreamApi, str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    relay, api, slot = stuck_relay
    with psycopg.connect(small_slot_pg, autocommit=True) as admin:
        admin.execute(f"ALTER SYSTEM SET max_slot_wal_keep_size = '{KEEP_LIMIT // 1024}kB'")
        admin.execute("SELECT pg_reload_conf()")
    try:
        assert await wait_until(
            lambda: (
                relay.stats.backlog is not None
                and relay.stats.backlog.wal_keep_limit_bytes == KEEP_LIMIT
            ),
            10,
        )
        assert _warnings(caplog, slot) == []
        with caplog.at_level(logging.INFO, logger="outboxer"):
            safe = await asyncio.to_thread(_nearly_unreserve, _url(relay), slot, KEEP_LIMIT)
            assert await wait_until(
                lambda: (
                    relay.stats.backlog is not None
                    and (relay.stats.backlog.wal_safe_bytes or KEEP_LIMIT) <= safe
                ),
                10,
            )
            await asyncio.sleep(0.2)
        [warning] = _warnings(caplog, slot)
        assert "max_slot_wal_keep_size" in warning and "10%" in warning
        status, health = await _health(api)
        assert (status, health["status"]) == (200, "degraded"), health
        body = await _metrics(api)
        assert _sample(body, "outboxer_stream_wal_keep_limit_bytes") == KEEP_LIMIT
        assert 0 < (_sample(body, "outboxer_stream_wal_safe_bytes") or 0) < KEEP_LIMIT / 10
    finally:
        with psycopg.connect(small_slot_pg, autocommit=True) as admin:
            admin.execute("ALTER SYSTEM SET max_slot_wal_keep_size = '1MB'")
            admin.execute("SELECT pg_reload_conf()")
