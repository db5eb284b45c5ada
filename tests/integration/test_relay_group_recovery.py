"""Two databases in one relay process, each with rows a crashed relay left in flight: the
process recovers them one at a time, across databases, and drains both (the gate once let
one claim of each database recover at the same time; each recovered row then waited in
``alone`` for the other, forever)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import outboxer
from outboxer import load_settings
from outboxer.brokers.memory import memory_broker
from outboxer.relay_group import RelayGroup
from tests.conftest import _admin_execute, _pg_url
from tests.relaying import enqueue, rows

#: Rows a crashed relay holds per database, each of a key of its own.
IN_FLIGHT = 6


@pytest.fixture
def other_pg_url(pg_template: str) -> Iterator[str]:
    """A second fresh PostgreSQL database from the test template."""
    name = f"outboxer_t_{uuid.uuid4().hex[:12]}"
    _admin_execute(f"CREATE DATABASE {name} TEMPLATE {pg_template}")
    yield _pg_url(name)
    _admin_execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


async def crash_holding(url: str, count: int) -> None:
    """``count`` messages claimed by a relay that then died: PROCESSING, lease 0.3 s."""
    enqueue(url, *(("t", f"k{n}") for n in range(count)))
    async with outboxer.create_store(url) as store:
        claimed = await store.claim("default", "relay-that-died", count, 0.3, False)
    assert len(claimed) == count


async def test_two_databases_recovering_at_once_both_drain(
    pg_url: str, other_pg_url: str, tmp_path: Path
) -> None:
    databases = {"orders": pg_url, "billing": other_pg_url}
    for url in databases.values():
        await crash_holding(url, IN_FLIGHT)
    await asyncio.sleep(0.4)  # the dead relay's leases have expired
    broker = f"memory://recover-{uuid.uuid4().hex[:8]}"
    config = tmp_path / "outboxer.toml"
    config.write_text(
        "\n".join(
            [
                f'broker = "{broker}"',
                "poll_interval = 0.05",
                "backoff_base = 0.05",
                "backoff_max = 0.1",
                "concurrency = 3",
                *(f'[databases.{name}]\nurl = "{url}"' for name, url in databases.items()),
            ]
        )
        + "\n"
    )
    settings = load_settings({}, config_file=config, environ={})
    group = RelayGroup.from_settings(settings)
    run = asyncio.create_task(group.run())
    deadline = time.monotonic() + 20
    try:
        while True:
            statuses = {
                name: {str(row["status"]) for row in await rows(url)}
                for name, url in databases.items()
            }
            if all(found == {"PUBLISHED"} for found in statuses.values()):
                break
            assert not run.done(), run
            assert time.monotonic() < deadline, f"the relays stalled recovering: {statuses}"
            await asyncio.sleep(0.1)
    finally:
        group.stop()
        stats = await asyncio.wait_for(run, 10)
    assert {name: each.recovered for name, each in stats.items()} == dict.fromkeys(
        databases, IN_FLIGHT
    )
    assert len(memory_broker(broker.removeprefix("memory://")).messages) == 2 * IN_FLIGHT
    for url in databases.values():
        assert {int(str(row["attempts"])) for row in await rows(url)} == {1}
