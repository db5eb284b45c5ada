"""The relay's connections run without JIT whatever the database's default (ALTER DATABASE
… SET jit_above_cost = 0, a DBA tuning the database for analytics)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import psycopg
import pytest

import outboxer
from outboxer.brokers.memory import memory_broker
from tests.conftest import _admin_execute
from tests.relaying import relay, rows


async def test_a_database_compiling_every_statement_does_not_slow_the_relay_down(
    pg_url: str,
) -> None:
    """Each claim step and settle was compiled (~100 ms with inlining and optimization): 60
    messages took the relay well over 8 s on four loops (200 took 40 s); its own short
    statements run without JIT now, in well under a second."""
    name = pg_url.rsplit("/", 1)[1]
    with psycopg.connect(pg_url) as conn:
        if not conn.execute("SELECT pg_jit_available()").fetchone()[0]:  # type: ignore[index]
            pytest.skip("the server has no JIT (built without LLVM)")
    _admin_execute(
        *(
            f"ALTER DATABASE {name} SET {setting}"
            for setting in (
                "jit = on",
                "jit_above_cost = 0",
                "jit_inline_above_cost = 0",
                "jit_optimize_above_cost = 0",
            )
        )
    )
    # The test's own writes without JIT (the caller's connection is the caller's business).
    with psycopg.connect(pg_url, options="-c jit=off") as conn:
        for n in range(60):
            outboxer.enqueue(conn, "t", {"n": n}, key=f"k{n % 5}")
        conn.commit()
    with psycopg.connect(pg_url) as conn:
        assert conn.execute("SHOW jit_above_cost").fetchone() == ("0",)
    broker = f"jit-{uuid.uuid4().hex[:8]}"
    started = time.monotonic()
    async with asyncio.timeout(8):
        await relay(
            pg_url, f"memory://{broker}", concurrency=4, batch_size=20, exit_when_idle=True
        ).run()
    assert time.monotonic() - started < 4
    assert {row["status"] for row in await rows(pg_url)} == {"PUBLISHED"}
    per_key: dict[str | None, list[int]] = {}
    for message in memory_broker(broker).messages:
        per_key.setdefault(message.key, []).append(json.loads(message.payload)["n"])
    assert sum(map(len, per_key.values())) == 60
    assert all(numbers == sorted(numbers) for numbers in per_key.values())
