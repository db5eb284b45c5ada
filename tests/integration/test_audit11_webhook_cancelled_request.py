"""A webhook request cancelled mid-transaction (the ASGI server cancels the app when the
client hangs up or at shutdown; a timeout around the app does too) must keep its database
session until the transaction ended. It used to hand the session back at once, while the
sync driver's thread went on in the transaction: the next request to get that session ran
on the same connection, inside that open transaction, and psycopg failed it (a 503 for a
request with nothing wrong; other drivers would have mixed the two transactions' fates).
PostgreSQL inbox."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import uuid
from typing import Any

import psycopg

from outboxer.consumer import Delivery
from outboxer.receivers.webhook import WebhookReceiver

DDL = "CREATE TABLE audit11_hook_applied (message_id uuid NOT NULL, n integer NOT NULL)"


def request(message_id: str) -> dict[str, str]:
    return {
        "outboxer-id": message_id,
        "outboxer-topic": "hook.t",
        "content-type": "application/json",
    }


async def test_a_cancelled_request_keeps_its_session_until_its_transaction_ended(
    pg_url: str,
) -> None:
    with psycopg.connect(pg_url) as conn:
        conn.execute(DDL)
    started, release = threading.Event(), threading.Event()

    def handler(message: Delivery, conn: Any) -> None:
        conn.execute(
            "INSERT INTO audit11_hook_applied (message_id, n) VALUES (%s, %s)",
            (message.id, message.payload["n"]),
        )
        if message.payload["n"] == 0:
            started.set()
            assert release.wait(10), "the test never released the first handler"
            raise RuntimeError("the first message fails after its insert")

    # Two sessions (and two threads): the first request's session is the one the third
    # request got when it went back to the queue behind the second's at cancellation.
    receiver = WebhookReceiver(
        db=pg_url, group="hooks", handler=handler, secret=None, concurrency=2
    )
    first, second, third = (str(uuid.uuid4()) for _ in range(3))
    try:
        await receiver.start()
        cancelled = asyncio.create_task(receiver.handle(request(first), b'{"n": 0}'))
        assert await asyncio.to_thread(started.wait, 10)
        cancelled.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await cancelled
        answers = [
            await receiver.handle(request(second), b'{"n": 1}'),
            await receiver.handle(request(third), b'{"n": 2}'),
        ]
        release.set()
        # The cancelled request's transaction ends (rolls back) on its own.
        await asyncio.gather(*getattr(receiver, "_in_flight", ()), return_exceptions=True)
    finally:
        release.set()
        await receiver.close()
    assert [(status, body) for status, body, _ in answers] == [(200, {"result": "applied"})] * 2
    with psycopg.connect(pg_url) as conn:
        rows = conn.execute("SELECT message_id::text FROM audit11_hook_applied").fetchall()
        inbox = conn.execute("SELECT message_id::text FROM outboxer.inbox").fetchall()
    # The first message failed and rolled back: nothing of it, and no inbox claim (its retry
    # is applied, not taken for a duplicate); the third is applied in a transaction of its own.
    assert sorted(rows) == sorted([(second,), (third,)])
    assert sorted(inbox) == sorted([(second,), (third,)])
