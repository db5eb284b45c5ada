"""The consumer on a database that stops answering (a network that black-holes packets, a
proxy that accepts and forwards nothing): each round trip of the runner's own (the inbox
claim, the checks after the handlers, COMMIT, the connect) now gives up after the session's
``statement_timeout`` (a minute by default, lowered here). The connection is cut off from
outside its call (its socket shut down, asyncpg's transport aborted), so the blocked call
returns and its thread is free; the batch is an outage: not acked, no attempt counted,
applied again on a new connection once the database answers, exactly once, in key order.

Before, the worker waited in that statement for ever: nothing reported, nothing counted,
its messages (and their keys) held for good while the consumer looked alive.

The fault: a proxy in front of the database (``tests/chaos/proxy.py``) that a handler stalls
from its thread just after its own write; the runner's next round trip (the transaction-id
check on PostgreSQL, the first claim's check on MySQL) then gets no answer. The COMMIT case
stalls it right before the COMMIT goes out."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest

from outboxer import consumer_db
from outboxer.brokers.memory import memory_broker
from outboxer.consumer import Consumer, Delivery
from outboxer.consumer_db import PyMySQLSession
from outboxer.receivers.memory import group_state
from outboxer.testing import make_message
from tests.chaos.proxy import FaultProxy
from tests.conftest import mysql_connect
from tests.integration.test_audit17_bounds_mysql_hung import _through
from tests.relaying import until

#: The shortened bound on each round trip of the runner's own (a minute by default).
BOUND = 0.5
#: How long the old code was watched waiting for ever before the test gave up on it.
GIVE_UP = 4.0
#: Keys, and messages a key: applied in this order within each key.
KEYS, PER_KEY = 3, 3
#: In the PostgreSQL URLs: never to appear in a log line (trust auth does not ask for it).
PASSWORD = "pw-not-for-logs"

DRIVERS = ("psycopg", "pymysql", "asyncpg", "psycopg-async")
#: What a reconnect to the stalled database logs when it gives up.
NO_CONNECT = "cannot connect to the consumer's database: no answer within 0.5s"


def _through_pg(url: str, port: int) -> str:
    """``url`` with 127.0.0.1:``port`` for its host and a password the server never asks."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=f"{parts.username}:{PASSWORD}@127.0.0.1:{port}"))


def _messages(broker: str) -> list[Any]:
    """KEYS keys of PER_KEY messages each, interleaved, in the broker's list."""
    messages = [
        make_message("t", {"n": n}, key=f"k{k}") for n in range(PER_KEY) for k in range(KEYS)
    ]
    memory_broker(broker).messages.extend(messages)
    return messages


def _create_applied(driver: str, url: str) -> None:
    if driver == "pymysql":
        conn = mysql_connect(url, autocommit=True)
        with conn.cursor() as cursor:
            cursor.execute(
                "CREATE TABLE applied (seq BIGINT AUTO_INCREMENT PRIMARY KEY, "
                "message_id CHAR(36) NOT NULL, k VARCHAR(20) NOT NULL, n INT NOT NULL)"
            )
        conn.close()
        return
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE applied (seq BIGSERIAL PRIMARY KEY, message_id TEXT NOT NULL, "
            "k TEXT NOT NULL, n INT NOT NULL)"
        )


def _applied(driver: str, url: str) -> list[tuple[str, str, int]]:
    """(message id, key, n) of each row the handlers committed, in commit order."""
    sql = "SELECT message_id, k, n FROM applied ORDER BY seq"
    if driver == "pymysql":
        conn = mysql_connect(url)
        with conn.cursor() as cursor:
            cursor.execute(sql)
            rows = [tuple(row) for row in cursor.fetchall()]
        conn.close()
        return rows  # type: ignore[return-value]
    with psycopg.connect(url) as conn:
        return [tuple(row) for row in conn.execute(sql).fetchall()]  # type: ignore[misc]


def _handler(driver: str, written: Callable[[Delivery, Any], None]) -> Any:
    """The driver's handler: one row per message, then ``written`` (the test's hook)."""
    insert = "INSERT INTO applied (message_id, k, n) VALUES (%s, %s, %s)"

    def values(message: Delivery) -> tuple[str, str | None, int]:
        return str(message.id), message.key, message.payload["n"]

    if driver == "psycopg":

        def sync_pg(message: Delivery, conn: Any) -> None:
            conn.execute(insert, values(message))
            written(message, conn)

        return sync_pg
    if driver == "pymysql":

        def sync_mysql(message: Delivery, conn: Any) -> None:
            with conn.cursor() as cursor:
                cursor.execute(insert, values(message))
            written(message, conn)

        return sync_mysql
    if driver == "asyncpg":

        async def on_asyncpg(message: Delivery, conn: Any) -> None:
            await conn.execute(insert.replace("%s, %s, %s", "$1, $2, $3"), *values(message))
            written(message, conn)

        return on_asyncpg

    async def on_psycopg(message: Delivery, conn: Any) -> None:
        await conn.execute(insert, values(message))
        written(message, conn)

    return on_psycopg


def _closed(conn: Any) -> bool:
    """Whether the connection a handler was given is closed now (its socket released)."""
    if hasattr(conn, "is_closed"):
        return bool(conn.is_closed())  # asyncpg
    if hasattr(conn, "open"):
        return not conn.open  # PyMySQL
    return bool(conn.closed)  # psycopg


def _pool_threads(group: str) -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith(f"outboxer-{group}_"))


@pytest.fixture(params=DRIVERS)
def setup(request: pytest.FixtureRequest) -> Iterator[tuple[str, str, FaultProxy]]:
    """(driver, the database's URL, a proxy in front of it)."""
    driver: str = request.param
    url: str = request.getfixturevalue("mysql_url" if driver == "pymysql" else "pg_url")
    proxy = FaultProxy(urlsplit(url).port or (3306 if driver == "pymysql" else 5432)).start()
    try:
        yield driver, url, proxy
    finally:
        proxy.resume()
        proxy.stop()


def _proxied(driver: str, url: str, proxy: FaultProxy) -> str:
    return _through(url, proxy.port) if driver == "pymysql" else _through_pg(url, proxy.port)


async def _stop(consumer: Consumer, run: asyncio.Task[Any], proxy: FaultProxy) -> None:
    proxy.resume()  # the old code's statement is answered then, and its worker ends
    consumer.stop()
    await asyncio.wait_for(run, 10)


async def test_a_stalled_database_is_an_outage_and_each_message_applies_once_after_it(
    setup: tuple[str, str, FaultProxy], caplog: pytest.LogCaptureFixture
) -> None:
    driver, url, proxy = setup
    caplog.set_level(logging.DEBUG, logger="outboxer")
    _create_applied(driver, url)
    broker = f"audit18-{uuid.uuid4().hex[:8]}"
    messages = _messages(broker)
    trigger = messages[KEYS + 1]  # key k1's second message
    stalled = threading.Event()
    given: dict[uuid.UUID, Any] = {}

    def written(message: Delivery, conn: Any) -> None:
        given[message.id] = conn
        if message.id == trigger.id and not stalled.is_set():
            stalled.set()
            proxy.stall()  # from here on the database answers nothing, either way

    consumer = Consumer(
        db=_proxied(driver, url, proxy),
        broker=f"memory://{broker}",
        group="g",
        handler=_handler(driver, written),
        concurrency=2,
        batch=1,
        async_driver={"asyncpg": "asyncpg", "psycopg-async": "psycopg"}.get(driver),
    )
    consumer.statement_timeout = BOUND
    acked = group_state(broker, "g").acked
    run = asyncio.create_task(consumer.run_async())
    try:
        await until(stalled.is_set, "the trigger's handler ran", 8)
        began = time.monotonic()
        await until(
            lambda: consumer.stats.database_errors >= 1,
            "the consumer reports the stalled database (before: it waited for ever)",
            GIVE_UP,
        )
        reported = time.monotonic() - began
        # The cut-off connection is closed and its thread free: the runner's close of it ran.
        await until(lambda: _closed(given[trigger.id]), "the stalled connection closed", 3)
        assert messages.index(trigger) not in acked  # its transaction never committed
        # Reconnecting to the stalled database gives up too (and again), on no more threads.
        await until(lambda: NO_CONNECT in caplog.text, "a reconnect gave up", 4)
        assert messages.index(trigger) not in acked
        assert _pool_threads("g") <= consumer.concurrency
        proxy.resume()
        await until(lambda: len(acked) == len(messages), "every message acked after it", 8)
    finally:
        await _stop(consumer, run, proxy)
    assert reported < BOUND + 1.0, reported
    rows = _applied(driver, url)
    assert sorted(row[0] for row in rows) == sorted(str(m.id) for m in messages)  # once each
    for k in range(KEYS):  # in each key's order
        assert [n for _, key, n in rows if key == f"k{k}"] == list(range(PER_KEY))
    assert consumer.stats.failed == 0  # no attempt counted for the outage
    assert consumer.stats.dead_lettered == 0
    assert _pool_threads("g") <= consumer.concurrency
    assert "did not answer within 0.5s" in caplog.text
    assert str(trigger.id) in caplog.text  # the outage names the message it holds back
    assert PASSWORD not in caplog.text


@pytest.mark.parametrize("driver", ["psycopg", "pymysql"])
async def test_a_commit_whose_answer_is_lost_is_not_acked_and_applies_once(
    driver: str,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The network stalls as the COMMIT goes out: the consumer cannot know whether it
    committed, so it acks nothing; the COMMIT reaches the server once the network is back
    (it did commit), and the next attempt finds the inbox claim: a duplicate, acked, the
    handler not run again."""
    url: str = request.getfixturevalue("mysql_url" if driver == "pymysql" else "pg_url")
    proxy = FaultProxy(urlsplit(url).port or (3306 if driver == "pymysql" else 5432)).start()
    caplog.set_level(logging.WARNING, logger="outboxer")
    _create_applied(driver, url)
    broker = f"audit18-{uuid.uuid4().hex[:8]}"
    messages = _messages(broker)
    trigger = messages[KEYS + 1]
    pending = threading.Event()  # the trigger's handler ran: its COMMIT comes next
    stalled = threading.Event()
    calls: dict[uuid.UUID, int] = {}

    def written(message: Delivery, conn: Any) -> None:
        calls[message.id] = calls.get(message.id, 0) + 1
        if message.id == trigger.id:
            pending.set()

    def stall_if_committing() -> None:
        if pending.is_set() and not stalled.is_set():
            stalled.set()
            proxy.stall()

    sessions = None
    if driver == "pymysql":

        class StallsAtCommit(PyMySQLSession):
            def _commit(self) -> None:
                stall_if_committing()
                super()._commit()

        def sessions(executor: Any) -> Any:
            return StallsAtCommit(proxied, "outboxer", executor)

    else:
        # Called on the batch's transaction right before psycopg's block ends (COMMIT).
        refuse_aborted = consumer_db._refuse_aborted

        def stalling(conn: Any) -> None:
            refuse_aborted(conn)
            stall_if_committing()

        monkeypatch.setattr(consumer_db, "_refuse_aborted", stalling)

    proxied = _proxied(driver, url, proxy)
    consumer = Consumer(
        db=proxied,
        broker=f"memory://{broker}",
        group="g",
        handler=_handler(driver, written),
        concurrency=1,
        batch=1,
        sessions=sessions,
    )
    consumer.statement_timeout = BOUND
    acked = group_state(broker, "g").acked
    run = asyncio.create_task(consumer.run_async())
    try:
        await until(stalled.is_set, "the trigger's COMMIT went out", 8)
        await until(
            lambda: consumer.stats.database_errors >= 1,
            "the consumer reports the unanswered COMMIT (before: it waited for ever)",
            GIVE_UP,
        )
        assert messages.index(trigger) not in acked
        # On the pool's one thread, which the cut freed from the COMMIT's wait.
        await until(lambda: NO_CONNECT in caplog.text, "a reconnect gave up", 4)
        assert messages.index(trigger) not in acked
        proxy.resume()  # the held COMMIT reaches the server: it commits
        await until(lambda: len(acked) == len(messages), "every message acked after it", 8)
    finally:
        await _stop(consumer, run, proxy)
        proxy.stop()
    rows = _applied(driver, url)
    assert sorted(row[0] for row in rows) == sorted(str(m.id) for m in messages)  # once each
    for k in range(KEYS):
        assert [n for _, key, n in rows if key == f"k{k}"] == list(range(PER_KEY))
    assert "(COMMIT)" in caplog.text and "may have been applied" in caplog.text
    assert consumer.stats.failed == 0
    # It had committed: the next attempt was the inbox's duplicate, the handler not run again.
    assert consumer.stats.duplicates == 1
    assert calls[trigger.id] == 1
