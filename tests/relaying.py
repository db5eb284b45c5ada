"""Helpers for relay tests on every database: write messages, read rows, build relays.

The ``db`` fixture gives each test the URL of a fresh PostgreSQL, MariaDB and SQLite
database in turn; import it into a test module to use it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

import outboxer
from outboxer import Relay, load_settings
from tests.integration.test_http_api import connect_sync

STATUSES = ["PENDING", "PROCESSING", "PUBLISHED", "FAILED", "ABANDONED"]


@pytest.fixture(params=["pg_url", "mysql_url", "sqlite_url"])
def db(request: pytest.FixtureRequest) -> str:
    url: str = request.getfixturevalue(request.param)
    return url


def enqueue(url: str, *items: tuple[str, str | None]) -> list[outboxer.Message]:
    """Commit one message per (topic, key), in one transaction, in order; payload {"n": n}."""
    conn = connect_sync(url)
    try:
        sent = [
            outboxer.enqueue(conn, topic, {"n": n}, key=key) for n, (topic, key) in enumerate(items)
        ]
        conn.commit()
    finally:
        conn.close()
    return sent


async def rows(url: str) -> list[dict[str, object]]:
    """Every row (up to 1000), as ``outboxer messages`` lists them, in seq order."""
    async with outboxer.create_store(url) as store:
        listed = await store.list_messages(STATUSES, 1000)
    return sorted(listed, key=lambda row: int(str(row["seq"])))


async def until(check: Callable[[], Awaitable[bool] | bool], what: str, seconds: float) -> None:
    """Poll ``check`` (a plain or an async predicate) every 20 ms; fail with ``what`` after ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        found = check()
        if not isinstance(found, bool):
            found = await found
        if found:
            return
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


async def drained(url: str) -> bool:
    """Whether every row is PUBLISHED."""
    return {row["status"] for row in await rows(url)} == {"PUBLISHED"}


async def all_published(url: str, count: int) -> bool:
    found = await rows(url)
    return len(found) == count and {r["status"] for r in found} == {"PUBLISHED"}


def relay(url: str, broker: str, **overrides: Any) -> Relay:
    """A relay with short polls and backoffs, one loop, unless ``overrides`` say otherwise."""
    base: dict[str, Any] = {
        "db": url,
        "broker": broker,
        "poll_interval": 0.05,
        "backoff_base": 0.05,
        "backoff_max": 0.1,
        "concurrency": 1,
    }
    return Relay.from_settings(load_settings(base | overrides, environ={}))
