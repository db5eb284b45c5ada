"""Refusals at the write path's boundary on the real databases: reserved header names and
ids repeated within one write are refused before any SQL, so the caller's transaction goes
on (on PostgreSQL an error from SQL would abort it) and nothing is written."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

import outboxer
from outboxer import DuplicateMessageError, PayloadError
from tests.integration.test_enqueue_drivers import committed_topics, stored, sync_connection


def _refused_writes() -> list[tuple[type[Exception], Any]]:
    """(expected error, a call on a connection) for each refusal."""
    same = uuid.uuid4()
    return [
        (PayloadError, lambda c: outboxer.enqueue(c, "t", {}, headers={"outboxer-key": "k"})),
        (PayloadError, lambda c: outboxer.enqueue(c, "t", {}, headers={"Outboxer-ID": "x"})),
        (
            PayloadError,
            lambda c: outboxer.enqueue_many(
                c, [{"topic": "t", "payload": {}, "headers": {"outboxer-claim-check": "o"}}]
            ),
        ),
        (
            DuplicateMessageError,
            lambda c: outboxer.enqueue_many(
                c,
                [
                    {"topic": "t", "payload": {"n": 1}, "message_id": same, "key": "a"},
                    {"topic": "t", "payload": {"n": 2}, "message_id": str(same), "key": "b"},
                ],
            ),
        ),
    ]


@pytest.mark.parametrize(
    ("driver", "url_fixture"),
    [("psycopg", "pg_url"), ("pymysql", "mysql_url"), ("sqlite3", "sqlite_url")],
)
def test_boundary_refusals_leave_the_callers_transaction_usable(
    request: pytest.FixtureRequest, driver: str, url_fixture: str
) -> None:
    url = request.getfixturevalue(url_fixture)
    conn = sync_connection(driver, url)
    try:
        outboxer.enqueue(conn, "before", {"n": 1}, key="a")
        for error, write in _refused_writes():
            with pytest.raises(error):
                write(conn)
            if driver == "psycopg":
                import psycopg

                status = conn.info.transaction_status
                assert status == psycopg.pq.TransactionStatus.INTRANS, status.name
        outboxer.enqueue(conn, "after", {"n": 2}, key="a")
        conn.commit()
    finally:
        conn.close()
    assert committed_topics(driver, url) == ["before", "after"], "nothing refused was written"


async def test_boundary_refusals_leave_an_asyncpg_transaction_usable(pg_url: str) -> None:
    import asyncpg

    same = uuid.uuid4()
    conn = await asyncpg.connect(pg_url)
    try:
        async with conn.transaction():
            await outboxer.enqueue_async(conn, "before", {"n": 1})
            with pytest.raises(PayloadError, match="reserved"):
                await outboxer.enqueue_async(conn, "t", {}, headers={"OUTBOXER-KEY": "k"})
            with pytest.raises(DuplicateMessageError):
                await outboxer.enqueue_many_async(
                    conn, [{"topic": "t", "payload": {}, "message_id": same}] * 2
                )
            assert await conn.fetchval("SELECT 1") == 1, "the transaction was aborted"
            await outboxer.enqueue_async(conn, "after", {"n": 2})
    finally:
        await conn.close()
    assert [row["topic"] for row in stored(pg_url)] == ["before", "after"]


def test_a_destination_named_twice_is_refused_before_sql(pg_url: str) -> None:
    import psycopg

    with psycopg.connect(pg_url) as conn:
        outboxer.enqueue(conn, "before", {})
        with pytest.raises(outboxer.ConfigError, match="twice"):
            outboxer.enqueue(conn, "t", {}, destinations=["a", "a"])
        outboxer.enqueue(conn, "after", {})
    assert [row["topic"] for row in stored(pg_url)] == ["before", "after"]


async def test_boundary_refusals_on_aiomysql_write_nothing(mysql_url: str) -> None:
    from tests.conftest import aiomysql_connect
    from tests.integration.test_enqueue_drivers import mysql_stored

    same = uuid.uuid4()
    conn = await aiomysql_connect(mysql_url)
    try:
        await conn.begin()
        await outboxer.enqueue_async(conn, "before", {"n": 1}, key="a")
        with pytest.raises(PayloadError, match="reserved"):
            await outboxer.enqueue_async(conn, "t", {}, headers={"outboxer-key": "k"})
        with pytest.raises(DuplicateMessageError):
            await outboxer.enqueue_many_async(
                conn,
                [
                    {"topic": "t", "payload": {}, "message_id": same, "key": "b"},
                    {"topic": "t", "payload": {}, "message_id": same, "key": "c"},
                ],
            )
        await outboxer.enqueue_async(conn, "after", {"n": 2}, key="a")
        await conn.commit()
    finally:
        conn.close()
    assert [row["topic"] for row in mysql_stored(mysql_url)] == ["before", "after"]


def _mysql_args(url: str) -> dict[str, Any]:
    from outboxer.stores.mysql import mysql_connect_args

    args = mysql_connect_args(url)
    args["charset"] = "utf8"  # MySQL's three-byte UTF-8 (utf8mb3): an application's choice
    if "connect_timeout" in args:
        args["connect_timeout"] = int(args["connect_timeout"])
    return args


@pytest.mark.parametrize("driver", ["pymysql", "mysqlclient"])
def test_text_a_utf8mb3_connection_cannot_carry_is_refused(mysql_url: str, driver: str) -> None:
    """Without strict mode the server stored "t????" and "k????": other topics, one key."""
    import MySQLdb
    import pymysql

    from tests.integration.test_enqueue_drivers import mysql_stored

    connect = pymysql.connect if driver == "pymysql" else MySQLdb.connect
    conn = connect(**_mysql_args(mysql_url))
    try:
        conn.cursor().execute("SET SESSION sql_mode = ''")
        if driver == "pymysql":
            conn.begin()
        else:
            conn.autocommit(False)
        for change in ({"topic": "t\U0001f600"}, {"key": "k\U0001f603"}):
            with pytest.raises(PayloadError, match="U\\+FFFF"):
                outboxer.enqueue(conn, **({"topic": "t", "payload": {}} | change))
        with pytest.raises(PayloadError, match="U\\+FFFF"):
            outboxer.enqueue(conn, "t", {}, headers={"h": "\U0001f600"})
        outboxer.enqueue(conn, "caf\u00e9", {"emoji": "\U0001f600"}, key="k\u20ac")
        conn.commit()
    finally:
        conn.close()
    [row] = mysql_stored(mysql_url)
    assert (row["topic"], row["key"]) == ("caf\u00e9", "k\u20ac")
    assert json.loads(row["payload"]) == {"emoji": "\U0001f600"}, "the payload is bytes"


async def test_text_a_utf8mb3_aiomysql_connection_cannot_carry_is_refused(mysql_url: str) -> None:
    import aiomysql

    from tests.integration.test_enqueue_drivers import mysql_stored

    args = _mysql_args(mysql_url)
    conn = await aiomysql.connect(db=args.pop("database"), **args)
    try:
        await conn.begin()
        with pytest.raises(PayloadError, match="U\\+FFFF"):
            await outboxer.enqueue_async(conn, "t", {}, key="k\U0001f600")
        await outboxer.enqueue_async(conn, "after", {})
        await conn.commit()
    finally:
        conn.close()
    assert [row["topic"] for row in mysql_stored(mysql_url)] == ["after"]
