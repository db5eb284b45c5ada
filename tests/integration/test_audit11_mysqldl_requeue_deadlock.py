"""MySQL/MariaDB: a requeue that InnoDB chooses as a deadlock's victim is tried again.

Beside a live relay, whose settles and cleanup lock the outbox's rows in another order than
an operator's requeue, InnoDB can roll the requeue back with error 1213 ("Deadlock found";
seen in CI: `test_admin_audit_concurrent` on MariaDB, the operator's requeue failed and its
rows stayed ABANDONED). The whole transaction is rolled back, so trying it again is safe, as
MySQL advises. Here the deadlock is made for real: another transaction, heavier (so InnoDB
picks the requeue as the victim), holds the row the requeue updates and then asks for the
destination lock the requeue holds shared.
"""

from __future__ import annotations

import asyncio
import time

import outboxer
from outboxer import admin
from outboxer.admin import MessageFilter
from tests.conftest import mysql_connect


def _lock_waits(url: str) -> int:
    conn = mysql_connect(url, autocommit=True)
    try:
        with conn.cursor() as cursor:
            cursor.execute(
                "SELECT COUNT(*) FROM information_schema.innodb_trx WHERE trx_state = 'LOCK WAIT'"
            )
            (count,) = cursor.fetchone()
        return int(count)
    finally:
        conn.close()


async def test_a_requeue_chosen_as_a_deadlocks_victim_is_tried_again(mysql_url: str) -> None:
    writer = mysql_connect(mysql_url)
    try:
        message = outboxer.enqueue(writer, "t", {"n": 1}, key="k")
        writer.commit()
        with writer.cursor() as cursor:
            cursor.execute(
                "UPDATE outbox SET status = 'ABANDONED', attempts = 3 WHERE id = %s",
                (str(message.id),),
            )
        writer.commit()
    finally:
        writer.close()

    holder = mysql_connect(mysql_url)
    try:
        with holder.cursor() as cursor:
            # Heavier than the requeue: InnoDB rolls back the transaction that changed fewer
            # rows, so the requeue is the victim.
            cursor.execute("CREATE TABLE IF NOT EXISTS ballast (n INT)")
            holder.commit()
            cursor.execute("INSERT INTO ballast VALUES " + ",".join(["(1)"] * 2000))
            cursor.execute("SELECT seq FROM outbox WHERE id = %s FOR UPDATE", (str(message.id),))
        async with outboxer.create_store(mysql_url) as store:
            requeue = asyncio.create_task(
                admin.requeue(store, MessageFilter(topics=("t",)), destinations=("default",))
            )
            # The requeue holds the destination lock shared and waits for the row.
            deadline = time.monotonic() + 10
            while not await asyncio.to_thread(_lock_waits, mysql_url):
                assert time.monotonic() < deadline, "the requeue never waited for the row"
                assert not requeue.done(), requeue
                await asyncio.sleep(0.25)  # innodb_trx is refreshed at most every 0.1 s
            with holder.cursor() as cursor:
                # The destination lock, exclusive, as a claim takes it: a deadlock.
                await asyncio.to_thread(
                    cursor.execute,
                    "SELECT destination FROM outbox_destinations WHERE destination = 'default' "
                    "FOR UPDATE",
                )
            holder.commit()
            result = await asyncio.wait_for(requeue, 30)
        assert result is not None
    finally:
        holder.close()
    check = mysql_connect(mysql_url, autocommit=True)
    try:
        with check.cursor() as cursor:
            cursor.execute("SELECT status, attempts FROM outbox WHERE id = %s", (str(message.id),))
            assert cursor.fetchone() == ("PENDING", 0)
    finally:
        check.close()
