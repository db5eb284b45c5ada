"""Shutdown while a sync worker's thread waits for a lock in its transaction, on MariaDB
(PyMySQL: the inbox claim waits on the row another transaction inserted, up to
innodb_lock_wait_timeout) and on SQLite (BEGIN IMMEDIATE waits on another connection's write
lock, up to busy_timeout): the runner neither waits for that thread beyond
``shutdown_timeout`` + ``CANCELLED_WAIT`` nor closes the connection under it, and the batch
neither runs its handler nor commits once the lock is free (the PostgreSQL variant:
test_audit11_cancel_shutdown_claim_wait.py)."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Callable
from typing import Any

import pytest

from outboxer.brokers import create_publisher
from outboxer.consumer import Consumer, Delivery
from outboxer.errors import ConsumerShutdownError
from outboxer.message import Message
from outboxer.stores.sqlite import sqlite_path
from outboxer.testing import make_message
from tests.conftest import mysql_connect

REDIS = "redis://127.0.0.1:6379/0"
#: InnoDB refreshes what information_schema.innodb_trx (and innodb_locks, innodb_lock_waits)
#: show only when they were not read in the last 0.1 s (trx_i_s_cache): polled faster, they
#: show the first snapshot for ever, and a lock wait that began after it is never seen.
INNODB_TRX_POLL = 0.25


async def _shut_down_while_waiting(
    url: str,
    message: Message,
    waiting: Callable[[Consumer], bool],
    release: Callable[[], None],
    claimed: Callable[[], bool],
    poll: float,
    forced: bool,
) -> None:
    """Deliver ``message``, whose transaction waits on a lock the test holds; once
    ``waiting()`` says the consumer's thread waits (asked every ``poll`` seconds), stop:
    ``shutdown_timeout`` runs out, or (``forced``) a second SIGTERM cuts a long one short.
    The lock freed (``release()``), the abandoned thread goes on and its batch rolls back:
    ``claimed()`` stays False."""
    handled: list[str] = []

    def handler(delivery: Delivery, conn: Any) -> None:
        handled.append(str(delivery.id))

    consumer = Consumer(
        db=url,
        broker=REDIS,
        group="g",
        topics=[message.topic],
        handler=handler,
        concurrency=1,  # the close would queue behind the blocked thread
        shutdown_timeout=600 if forced else 0.2,
    )
    running = asyncio.create_task(consumer.run_async())
    released = False
    try:
        async with create_publisher(REDIS) as publisher:
            [outcome] = await publisher.publish_batch([message])
        assert outcome.published, outcome
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while not await asyncio.to_thread(waiting, consumer):
            assert not running.done(), running
            assert loop.time() < deadline, "the consumer's transaction never waited on the lock"
            await asyncio.sleep(poll)
        started = time.monotonic()
        consumer.signalled()  # the first SIGTERM
        if forced:
            consumer.signalled()  # the second
        done, _ = await asyncio.wait({running}, timeout=5)
        took = time.monotonic() - started
        assert done, "run_async waited for the transaction blocked on the lock"
        with pytest.raises(ConsumerShutdownError) as raised:
            running.result()
        assert raised.value.message_ids == [str(message.id)]
        assert raised.value.hung
        assert took < 3, took
        # Left open under its thread, not closed, and marked abandoned: once the lock is
        # free, the thread goes on, and the batch rolls back, not commits.
        [(session, _)] = consumer._batches.values()
        assert session.abandoned and session.conn is not None
        release()
        released = True
        deadline = loop.time() + 10
        while session.busy():
            assert loop.time() < deadline, "the abandoned thread never ended"
            await asyncio.sleep(0.05)
        assert not await asyncio.to_thread(claimed), "the abandoned batch committed"
        # Nor did its handler run: the message was handed back to the broker at shutdown.
        assert handled == [], "a handler ran in the batch abandoned at shutdown"
        # Not closed by hand: the consumer closes it once its call ended (close_after).
    finally:
        consumer.stop()
        if not released:
            release()
        await asyncio.gather(running, return_exceptions=True)


@pytest.mark.parametrize("forced", [False, True], ids=["timeout", "second-sigterm"])
async def test_mariadb_shutdown_does_not_wait_for_a_claim_blocked_on_a_row_lock(
    mysql_url: str, redis_stream: str, forced: bool
) -> None:
    message = make_message(redis_stream, {"n": 1}, key="k1")
    holder = mysql_connect(mysql_url)
    watcher = mysql_connect(mysql_url, autocommit=True)

    def query(sql: str, params: tuple[Any, ...] = ()) -> list[Any]:
        with watcher.cursor() as cursor:
            cursor.execute(sql, params)
            return list(cursor.fetchall())

    def waiting(consumer: Consumer) -> bool:
        # The server's own view: a transaction of the consumer's connection (neither the
        # holder's nor the watcher's) waiting on a lock.
        return bool(
            query(
                "SELECT trx_id FROM information_schema.innodb_trx WHERE trx_state = 'LOCK WAIT'"
                " AND trx_mysql_thread_id NOT IN (CONNECTION_ID(), %s)",
                (holder.thread_id(),),
            )
        )

    def claimed() -> bool:
        return bool(query("SELECT 1 FROM `inbox` WHERE message_id = %s", (str(message.id),)))

    try:
        # Another consumer's open transaction holds the message's inbox row.
        with holder.cursor() as cursor:
            cursor.execute(
                "INSERT INTO `inbox` (consumer, message_id) VALUES ('g', %s)", (str(message.id),)
            )
        await _shut_down_while_waiting(
            mysql_url, message, waiting, holder.rollback, claimed, INNODB_TRX_POLL, forced
        )
    finally:
        holder.close()
        watcher.close()


@pytest.mark.parametrize("forced", [False, True], ids=["timeout", "second-sigterm"])
async def test_sqlite_shutdown_does_not_wait_for_a_begin_blocked_on_the_write_lock(
    sqlite_url: str, redis_stream: str, forced: bool
) -> None:
    message = make_message(redis_stream, {"n": 1}, key="k1")
    path = sqlite_path(sqlite_url)
    # Another connection holds the write lock: the consumer's BEGIN IMMEDIATE waits for it
    # (busy_timeout, 30 s). WAL: the consumer's schema check, a read, does not.
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")
    watcher = sqlite3.connect(path, isolation_level=None, check_same_thread=False)

    def waiting(consumer: Consumer) -> bool:
        # SQLite has no view of a connection waiting on a lock. The batch's call runs in its
        # thread (busy) and cannot get past BEGIN IMMEDIATE while the holder holds the lock.
        return any(session.busy() for session, _ in list(consumer._batches.values()))

    def claimed() -> bool:
        rows = watcher.execute(
            'SELECT 1 FROM "inbox" WHERE message_id = ?', (str(message.id),)
        ).fetchall()
        return bool(rows)

    def release() -> None:
        if holder.in_transaction:
            holder.execute("ROLLBACK")

    try:
        await _shut_down_while_waiting(sqlite_url, message, waiting, release, claimed, 0.05, forced)
    finally:
        release()
        holder.close()
        watcher.close()
