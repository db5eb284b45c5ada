"""The inbox on the real PostgreSQL and SQLite: once in effect, even under concurrency."""

from __future__ import annotations

import sqlite3
import threading
import time
import uuid

import psycopg
import pytest

from outboxer import Inbox, PayloadError, create_store, load_settings
from outboxer.relay import cleanup
from outboxer.stores.sqlite import sqlite_path


def test_first_delivery_only_and_rollback_forgets(pg_url: str) -> None:
    inbox, message_id = Inbox(), uuid.uuid4()
    with psycopg.connect(pg_url) as conn:
        assert inbox.claim(conn, "billing", message_id) is True
        conn.rollback()  # the consumer's work failed: the message must be applied again later
        assert inbox.claim(conn, "billing", str(message_id)) is True
        conn.commit()
        assert inbox.claim(conn, "billing", message_id) is False
        assert inbox.claim(conn, "shipping", message_id) is True, "each consumer applies it once"


def test_concurrent_deliveries_apply_once(pg_url: str) -> None:
    inbox, message_id = Inbox(), uuid.uuid4()
    first = psycopg.connect(pg_url)
    assert inbox.claim(first, "billing", message_id) is True  # open transaction, not committed
    result: dict[str, bool] = {}

    def second_delivery() -> None:
        with psycopg.connect(pg_url) as conn:
            result["second"] = inbox.claim(conn, "billing", message_id)

    thread = threading.Thread(target=second_delivery)
    thread.start()
    time.sleep(0.3)
    assert thread.is_alive(), "the second delivery waits for the first transaction"
    first.commit()
    thread.join(10)
    first.close()
    assert result == {"second": False}


async def test_async_drivers(pg_url: str) -> None:
    import asyncpg

    inbox, message_id = Inbox(), uuid.uuid4()
    conn = await asyncpg.connect(pg_url)
    async with conn.transaction():
        assert await inbox.claim_async(conn, "c", message_id) is True
    assert await inbox.claim_async(conn, "c", message_id) is False
    await conn.close()
    with pytest.raises(TypeError, match=r"use `claim\("), psycopg.connect(pg_url) as sync_conn:
        await inbox.claim_async(sync_conn, "c", message_id)


def test_sqlite_inbox(sqlite_url: str) -> None:
    inbox, message_id = Inbox(), uuid.uuid4()
    conn = sqlite3.connect(sqlite_path(sqlite_url))
    with conn:
        assert inbox.claim(conn, "c", message_id) is True
    with conn:
        assert inbox.claim(conn, "c", message_id) is False
    with pytest.raises(PayloadError):
        inbox.claim(conn, "c", "not-a-uuid")
    with pytest.raises(PayloadError):
        inbox.claim(conn, "", message_id)
    conn.close()


async def test_inbox_retention(pg_url: str) -> None:
    with psycopg.connect(pg_url) as conn:
        for _ in range(3):
            Inbox().claim(conn, "c", uuid.uuid4())
        conn.execute("UPDATE outboxer.inbox SET received_at = now() - interval '2 days'")
        Inbox().claim(conn, "c", uuid.uuid4())
    settings = load_settings({"db": pg_url, "inbox_retention": "1d", "cleanup_batch": "2"}, environ={})
    async with create_store(pg_url) as store:
        assert await cleanup(store, settings) == 3
    with psycopg.connect(pg_url) as conn:
        assert conn.execute("SELECT count(*) FROM outboxer.inbox").fetchone() == (1,)
