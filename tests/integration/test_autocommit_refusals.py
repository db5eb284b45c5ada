"""Connections that commit every statement on their own are refused before any SQL runs.

An enqueue there commits the message apart from the rows it announces; an inbox claim
commits the record apart from the consumer's work, so a failed apply leaves the message
marked as applied and every redelivery is skipped: the message is lost.
"""

from __future__ import annotations

import sqlite3
import uuid
from typing import Any

import psycopg
import pytest

import outboxer
from outboxer import Inbox
from outboxer.stores.sqlite import sqlite_path
from tests.conftest import mysql_connect


def _count(path: str, table: str) -> int:
    conn = sqlite3.connect(path)
    try:
        row = conn.execute(f"SELECT count(*) FROM {table}").fetchone()
    finally:
        conn.close()
    return int(row[0])


def test_sqlalchemy_sqlite_autocommit_enqueue_is_refused(sqlite_url: str) -> None:
    """SQLAlchemy's AUTOCOMMIT isolation sets the sqlite3 connection's isolation_level to
    None: engine.begin() then opens no transaction, and the message committed at once,
    surviving the rollback of the block that enqueued it."""
    from sqlalchemy import create_engine

    path = sqlite_path(sqlite_url)
    engine = create_engine(sqlite_url, isolation_level="AUTOCOMMIT")
    with pytest.raises(TypeError, match="autocommit"), engine.begin() as conn:
        outboxer.enqueue(conn, "order.placed", {"id": 1})
    engine.dispose()
    assert _count(path, "outbox") == 0, "nothing written outside a transaction"

    engine = create_engine(sqlite_url)  # pysqlite's default: a transaction per block
    with pytest.raises(RuntimeError), engine.begin() as conn:
        outboxer.enqueue(conn, "order.placed", {"id": 2})
        raise RuntimeError("the caller's work failed")
    with engine.begin() as conn:
        outboxer.enqueue(conn, "order.placed", {"id": 3})
    engine.dispose()
    assert _count(path, "outbox") == 1, "the rolled back message is gone, the committed one kept"


def test_sqlite_inbox_claim_through_sqlalchemy_autocommit_is_refused(sqlite_url: str) -> None:
    from sqlalchemy import create_engine

    engine = create_engine(sqlite_url, isolation_level="AUTOCOMMIT")
    with pytest.raises(TypeError, match="autocommit"), engine.begin() as conn:
        Inbox().claim(conn, "billing", uuid.uuid4())
    engine.dispose()
    assert _count(sqlite_path(sqlite_url), "inbox") == 0


def test_mysql_inbox_claim_in_autocommit_is_refused(mysql_url: str) -> None:
    """PyMySQL in autocommit recorded the message for good before the work was applied."""
    inbox, message_id = Inbox(), uuid.uuid4()
    conn = mysql_connect(mysql_url, autocommit=True)
    try:
        with pytest.raises(TypeError, match="autocommit"):
            inbox.claim(conn, "billing", message_id)
        conn.begin()  # inside an explicit transaction the same connection may claim
        assert inbox.claim(conn, "billing", message_id) is True
        conn.rollback()  # the apply failed: the message must be applied on redelivery
        conn.begin()
        assert inbox.claim(conn, "billing", message_id) is True, "the rollback forgot it"
        conn.commit()
    finally:
        conn.close()


def test_postgres_inbox_claim_in_autocommit_is_refused(pg_url: str) -> None:
    inbox, message_id = Inbox(), uuid.uuid4()
    with psycopg.connect(pg_url, autocommit=True) as conn:
        with pytest.raises(TypeError, match="autocommit"):
            inbox.claim(conn, "billing", message_id)
        with pytest.raises(RuntimeError), conn.transaction():  # autocommit=True, then BEGIN
            assert inbox.claim(conn, "billing", message_id) is True
            raise RuntimeError("the apply failed")
        with conn.transaction():
            assert inbox.claim(conn, "billing", message_id) is True, "the rollback forgot it"
        with conn.transaction():
            assert inbox.claim(conn, "billing", message_id) is False


async def test_asyncpg_inbox_claim_outside_a_transaction_is_refused(pg_url: str) -> None:
    import asyncpg

    inbox, message_id = Inbox(), uuid.uuid4()
    conn: Any = await asyncpg.connect(pg_url)
    try:
        with pytest.raises(TypeError, match="autocommit"):
            await inbox.claim_async(conn, "billing", message_id)
        count = await conn.fetchval("SELECT count(*) FROM outboxer.inbox")
        assert count == 0
        async with conn.transaction():
            assert await inbox.claim_async(conn, "billing", message_id) is True
    finally:
        await conn.close()


async def test_sqlalchemy_asyncpg_inbox_claim_follows_the_isolation_level(pg_url: str) -> None:
    """SQLAlchemy opens asyncpg's transaction at a block's first statement: a claim that
    comes first is inside the block all the same; only AUTOCOMMIT isolation is refused."""
    from sqlalchemy.ext.asyncio import create_async_engine

    inbox, message_id = Inbox(), uuid.uuid4()
    url = pg_url.replace("postgresql://", "postgresql+asyncpg://", 1)
    engine = create_async_engine(url, isolation_level="AUTOCOMMIT")
    with pytest.raises(TypeError, match="autocommit"):
        async with engine.begin() as conn:
            await inbox.claim_async(conn, "billing", message_id)
    await engine.dispose()
    engine = create_async_engine(url)
    async with engine.begin() as conn:
        assert await inbox.claim_async(conn, "billing", message_id) is True
    await engine.dispose()
