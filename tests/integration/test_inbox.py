"""The inbox on the real PostgreSQL, SQLite and MariaDB: once in effect, even under concurrency."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from outboxer import Inbox, PayloadError, create_store, load_settings
from outboxer.relay import cleanup
from outboxer.stores.sqlite import sqlite_path
from tests.conftest import aiomysql_connect, mysql_connect


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

    waits_for_commit(first, second_delivery)
    first.close()
    assert result == {"second": False}


def waits_for_commit(first: Any, deliver: Callable[[], None]) -> None:
    """``deliver`` (in a thread) must wait while ``first``'s transaction is open, then finish."""
    thread = threading.Thread(target=deliver)
    thread.start()
    time.sleep(0.3)
    assert thread.is_alive(), "the second delivery waits for the first transaction"
    first.commit()
    thread.join(10)
    assert not thread.is_alive()


async def test_async_drivers(pg_url: str) -> None:
    import asyncpg

    inbox, message_id = Inbox(), uuid.uuid4()
    conn = await asyncpg.connect(pg_url)
    async with conn.transaction():
        assert await inbox.claim_async(conn, "c", message_id) is True
    async with conn.transaction():  # outside one, asyncpg would commit the record on its own
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
    settings = load_settings(
        {"db": pg_url, "inbox_retention": "1d", "cleanup_batch": "2"}, environ={}
    )
    async with create_store(pg_url) as store:
        assert await cleanup(store, settings) == 3
    with psycopg.connect(pg_url) as conn:
        assert conn.execute("SELECT count(*) FROM outboxer.inbox").fetchone() == (1,)


def test_mysql_first_delivery_only_concurrency_and_retention(mysql_url: str) -> None:
    """PyMySQL: once per consumer, a rollback forgets, a concurrent delivery waits and skips."""
    inbox, message_id = Inbox(), uuid.uuid4()
    first = mysql_connect(mysql_url)
    assert inbox.claim(first, "billing", message_id) is True
    first.rollback()
    assert inbox.claim(first, "billing", str(message_id)) is True  # open, not committed
    result: dict[str, bool] = {}

    def second_delivery() -> None:
        conn = mysql_connect(mysql_url)
        result["second"] = inbox.claim(conn, "billing", message_id)
        result["other consumer"] = inbox.claim(conn, "shipping", message_id)
        conn.commit()
        conn.close()

    waits_for_commit(first, second_delivery)
    assert result == {"second": False, "other consumer": True}
    assert inbox.claim(first, "billing", message_id) is False
    first.commit()
    with first.cursor() as cursor:
        cursor.execute("UPDATE inbox SET received_at = received_at - INTERVAL 2 DAY")
    first.commit()
    first.close()
    settings = load_settings(
        {"db": mysql_url, "inbox_retention": "1d", "cleanup_batch": "1"}, environ={}
    )

    async def clean() -> int:
        async with create_store(mysql_url) as store:
            return await cleanup(store, settings)

    assert asyncio.run(clean()) == 2


async def test_mysql_async_and_sqlalchemy_inbox(mysql_url: str) -> None:
    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session

    inbox, message_id = Inbox(), uuid.uuid4()
    conn = await aiomysql_connect(mysql_url)
    assert await inbox.claim_async(conn, "c", message_id) is True
    await conn.commit()
    assert await inbox.claim_async(conn, "c", message_id) is False
    conn.close()
    engine = create_engine(mysql_url.replace("mysql://", "mysql+pymysql://", 1))
    with Session(engine) as session:
        assert inbox.claim(session, "c", message_id) is False
        assert inbox.claim(session, "d", message_id) is True  # the session's transaction goes on
        session.commit()
    engine.dispose()
