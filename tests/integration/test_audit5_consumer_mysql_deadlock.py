"""MySQL/MariaDB: a deadlock rolls back the whole transaction, and the next statement begins
a new one. A handler that catches the deadlock and retries its statement (a common pattern)
then commits in a new transaction: before, the runner committed it and acked the batch, so
the messages applied before it in the batch (writes and inbox claims rolled back) were lost.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from typing import Any

import pymysql

from outboxer.brokers.memory import memory_broker
from outboxer.consumer import Consumer, Delivery
from outboxer.testing import make_message
from tests.conftest import mysql_connect


def test_mysql_a_handler_retrying_after_a_deadlock_loses_no_message_of_its_batch(
    mysql_url: str,
) -> None:
    setup = mysql_connect(mysql_url, autocommit=True)
    with setup.cursor() as cursor:
        cursor.execute("CREATE TABLE applied (message_id CHAR(36) PRIMARY KEY, n INT NOT NULL)")
        cursor.execute("CREATE TABLE counters (id INT PRIMARY KEY, v INT NOT NULL)")
        cursor.execute("INSERT INTO counters VALUES (1, 0), (2, 0)")
        cursor.execute("CREATE TABLE ballast (id INT PRIMARY KEY)")
    setup.close()

    # Another transaction holding counter 2; heavier than the consumer's (InnoDB picks the
    # lighter one as the deadlock's victim), so that the consumer's is rolled back.
    other = mysql_connect(mysql_url)
    other_thread_id = other.thread_id()
    with other.cursor() as cursor:
        cursor.executemany("INSERT INTO ballast VALUES (%s)", [(i,) for i in range(300)])
        cursor.execute("UPDATE counters SET v = v + 1 WHERE id = 2")
    go = threading.Event()

    def other_transaction() -> None:
        go.wait(10)
        with other.cursor() as cursor:
            cursor.execute("UPDATE counters SET v = v + 1 WHERE id = 1")  # waits: deadlock
        other.commit()

    waiter = threading.Thread(target=other_transaction)
    waiter.start()
    deadlocks = []

    def handler(message: Delivery, conn: Any) -> None:
        with conn.cursor() as cursor:
            cursor.execute(
                "INSERT INTO applied (message_id, n) VALUES (%s, %s)",
                (str(message.id), message.payload["n"]),
            )
            if message.payload["n"] != 1 or deadlocks:
                return
            cursor.execute("UPDATE counters SET v = v + 1 WHERE id = 1")
            go.set()
            watcher = mysql_connect(mysql_url, autocommit=True)
            with watcher.cursor() as watching:
                for _ in range(500):  # until the other transaction waits for counter 1
                    watching.execute(
                        "SELECT count(*) FROM information_schema.INNODB_TRX "
                        "WHERE trx_mysql_thread_id = %s AND trx_state = 'LOCK WAIT'",
                        (other_thread_id,),
                    )
                    if watching.fetchone()[0]:
                        break
                    time.sleep(0.01)
            watcher.close()
            try:
                cursor.execute("UPDATE counters SET v = v + 1 WHERE id = 2")
            except pymysql.err.OperationalError as exc:
                assert exc.args[0] == 1213  # deadlock: this transaction was rolled back
                deadlocks.append(exc)
                # "Retry the statement": it runs in a new transaction.
                cursor.execute("UPDATE counters SET v = v + 1 WHERE id = 2")
                cursor.execute(
                    "INSERT INTO applied (message_id, n) VALUES (%s, %s)",
                    (str(message.id), message.payload["n"]),
                )

    broker = f"audit5-{uuid.uuid4().hex[:8]}"
    # Two keys: one batch, message 0 applied first (sorted by id), then message 1.
    memory_broker(broker).messages.extend(
        [make_message("t", {"n": n}, key=f"k{n}") for n in range(2)]
    )
    consumer = Consumer(
        db=mysql_url,
        broker=f"memory://{broker}",
        group="g",
        handler=handler,
        concurrency=1,
        exit_when_idle=True,
    )
    try:
        stats = asyncio.run(consumer.run_async())
    finally:
        go.set()
        waiter.join(10)
        other.close()
    assert deadlocks, "the handler met no deadlock: the test did not test anything"
    check = mysql_connect(mysql_url)
    with check.cursor() as cursor:
        cursor.execute("SELECT n FROM applied ORDER BY n")
        applied = [row[0] for row in cursor.fetchall()]
        cursor.execute("SELECT count(*) FROM inbox WHERE consumer = 'g'")
        claimed = cursor.fetchone()[0]
    check.close()
    assert applied == [0, 1]  # message 0 was lost: rolled back by the deadlock, then acked
    assert claimed == 2
    assert stats.applied == 2
