"""The cost of a claim on a SQLite outbox with a long history: it runs under the write lock
(BEGIN IMMEDIATE), so every millisecond of it is one the application's writers wait. With
20,000 rows, half PUBLISHED, and every key held by a claim in flight, the claim that finds
nothing to take used to scan every earlier row of the table for each waiting row (11 s
here): writers with Python's default busy timeout (5 s) failed with "database is locked"."""

from __future__ import annotations

import sqlite3
import time

import pytest

import outboxer
from outboxer.stores.sqlite import sqlite_path

ROWS = 20_000
KEYS = 32


def fill(path: str) -> None:
    conn = sqlite3.connect(path)
    try:
        for n in range(ROWS):
            outboxer.enqueue(conn, "audit10.event", {"n": n}, key=f"k{n % KEYS}")
        conn.execute("UPDATE outbox SET status = 'PUBLISHED' WHERE seq <= ?", (ROWS // 2,))
        conn.commit()
    finally:
        conn.close()


@pytest.mark.timeout(120)
async def test_a_claim_on_a_long_history_is_short(sqlite_url: str) -> None:
    fill(sqlite_path(sqlite_url))
    async with outboxer.create_store(sqlite_url) as store:
        first = await store.claim("default", "audit10", 200, 30, True)
        assert len(first) == 200  # the head of every key: each key now waits on it
        started = time.perf_counter()
        second = await store.claim("default", "audit10", 200, 30, True)
        took = time.perf_counter() - started
        assert len(second) == 0
        await store.settle("default", first.lease, [m.stored_seq for m in first], [], [], 10)
        started = time.perf_counter()
        third = await store.claim("default", "audit10", 200, 30, True)
        took = max(took, time.perf_counter() - started)
        assert [m.stored_seq for m in third] == [ROWS // 2 + 201 + n for n in range(200)]
    assert took < 0.5, f"a claim held the write lock {took:.2f} s"
