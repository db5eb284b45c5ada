"""The relay's own transactions run READ COMMITTED whatever the database's default."""

from __future__ import annotations

import json
import logging
import uuid

import psycopg
import pytest

import outboxer
from outboxer.brokers.memory import memory_broker
from tests.conftest import _admin_execute
from tests.relaying import relay, rows


async def test_a_repeatable_read_default_does_not_turn_claims_into_outages(
    pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The claim function's steps take a fresh snapshot per statement, after the destination
    lock. Under a REPEATABLE READ default the snapshot predated the lock, so every claim that
    waited for another failed with a serialization error, which the relay backs off as an
    outage (and /health reports)."""
    name = pg_url.rsplit("/", 1)[1]
    _admin_execute(f"ALTER DATABASE {name} SET default_transaction_isolation = 'repeatable read'")
    with psycopg.connect(pg_url) as conn:
        assert conn.execute("SHOW default_transaction_isolation").fetchone() == ("repeatable read",)
        for n in range(300):
            outboxer.enqueue(conn, "t", {"n": n}, key=f"k{n % 7}")
        conn.commit()
    broker = f"isolation-{uuid.uuid4().hex[:8]}"
    with caplog.at_level(logging.WARNING, logger="outboxer"):
        await relay(
            pg_url, f"memory://{broker}", concurrency=4, batch_size=20, exit_when_idle=True
        ).run()
    assert "could not serialize" not in caplog.text
    assert {row["status"] for row in await rows(pg_url)} == {"PUBLISHED"}
    per_key: dict[str | None, list[int]] = {}
    for message in memory_broker(broker).messages:
        per_key.setdefault(message.key, []).append(json.loads(message.payload)["n"])
    assert sum(map(len, per_key.values())) == 300
    assert all(numbers == sorted(numbers) for numbers in per_key.values())
