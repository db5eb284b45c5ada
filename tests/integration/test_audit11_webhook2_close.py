"""WebhookReceiver.close() and the transactions in flight (PostgreSQL inbox).

close() used to close every session at once, the ones a request's shielded transaction
still used included: with a sync driver that is another thread closing the connection
inside the transaction (the handler's commit failed: a 503 for a request with nothing
wrong). It now waits for them (``shutdown_timeout``), leaves those still running alone
(their connections close when they end) and logs them. A request waiting for a session
when close() began waited on a queue nobody served any more (then got a closed connection);
one arriving after close() opened the receiver again, connections no lifespan closes:
both are a 503 now."""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from typing import Any

import psycopg
import pytest

from outboxer.consumer import Delivery
from outboxer.receivers.webhook import WebhookReceiver

DDL = "CREATE TABLE audit11_hook2 (message_id uuid NOT NULL)"


def request(message_id: str) -> dict[str, str]:
    return {
        "outboxer-id": message_id,
        "outboxer-topic": "hook.t",
        "content-type": "application/json",
    }


class Blocking:
    """A handler whose first call inserts its row, then waits for ``release``."""

    def __init__(self) -> None:
        self.started, self.release = threading.Event(), threading.Event()

    def __call__(self, message: Delivery, conn: Any) -> None:
        conn.execute("INSERT INTO audit11_hook2 (message_id) VALUES (%s)", (message.id,))
        if not self.started.is_set():
            self.started.set()
            assert self.release.wait(20), "the test never released the handler"


def applied(pg_url: str) -> list[str]:
    with psycopg.connect(pg_url) as conn:
        rows = conn.execute("SELECT message_id::text FROM audit11_hook2").fetchall()
    return sorted(row[0] for row in rows)


@pytest.fixture
def db(pg_url: str) -> str:
    with psycopg.connect(pg_url) as conn:
        conn.execute(DDL)
    return pg_url


async def test_close_waits_for_a_transaction_in_flight_and_it_commits(db: str) -> None:
    handler = Blocking()
    # Two sessions, two threads: the idle one's thread is free to close the busy one's
    # connection, which the old close() did, inside the running transaction.
    receiver = WebhookReceiver(db=db, group="hooks", handler=handler, secret=None, concurrency=2)
    message = str(uuid.uuid4())
    await receiver.start()
    try:
        answer = asyncio.create_task(receiver.handle(request(message), b"{}"))
        assert await asyncio.to_thread(handler.started.wait, 10)
        closing = asyncio.create_task(receiver.close())
        # A bounded look: close() must not return while the transaction runs.
        done, _ = await asyncio.wait({closing}, timeout=1)
        handler.release.set()
        await closing
        status, body, _ = await answer
    finally:
        handler.release.set()
        await receiver.close()
    assert not done, "close() returned while a transaction was still running"
    assert (status, body) == (200, {"result": "applied"})
    assert applied(db) == [message]


async def test_close_leaves_a_transaction_still_running_after_shutdown_timeout_alone(
    db: str, caplog: pytest.LogCaptureFixture
) -> None:
    handler = Blocking()
    receiver = WebhookReceiver(
        db=db, group="hooks", handler=handler, secret=None, concurrency=2, shutdown_timeout=0.2
    )
    message = str(uuid.uuid4())
    await receiver.start()
    answer = asyncio.create_task(receiver.handle(request(message), b"{}"))
    try:
        assert await asyncio.to_thread(handler.started.wait, 10)
        [(session, _)] = receiver._in_flight.values()
        with caplog.at_level(logging.WARNING, logger="outboxer.consumer.webhook"):
            await receiver.close()
        # Returned after shutdown_timeout with the transaction running, its connection open.
        assert not answer.done()
        assert not session.broken()
        assert message in caplog.text and "still running" in caplog.text
    finally:
        handler.release.set()
        status, body, _ = await answer
    assert (status, body) == (200, {"result": "applied"})
    assert applied(db) == [message]
    # Its connection was closed once it ended, and nothing holds it any more.
    assert session.broken()
    assert not receiver._in_flight


async def test_requests_during_and_after_close_get_a_503(db: str) -> None:
    handler = Blocking()
    receiver = WebhookReceiver(db=db, group="hooks", handler=handler, secret=None, concurrency=1)
    first, waiting, late = (str(uuid.uuid4()) for _ in range(3))
    await receiver.start()
    sessions = receiver._sessions
    assert sessions is not None
    try:
        running = asyncio.create_task(receiver.handle(request(first), b"{}"))
        assert await asyncio.to_thread(handler.started.wait, 10)
        queued = asyncio.create_task(receiver.handle(request(waiting), b"{}"))
        while not sessions._getters:  # type: ignore[attr-defined]  # it waits for the session
            await asyncio.sleep(0)
        closing = asyncio.create_task(receiver.close())
        # The waiting request is answered while the first one still runs.
        status, body, extra = await asyncio.wait_for(queued, 10)
        assert (status, extra.get("retry-after")) == (503, "5"), body
        assert "shutting down" in body["error"]
        # A request arriving now does not open the receiver again.
        status, body, _ = await receiver.handle(request(late), b"{}")
        assert status == 503 and "shutting down" in body["error"]
        handler.release.set()
        await closing
        assert (await running)[:2] == (200, {"result": "applied"})
        status, _, _ = await receiver.handle(request(late), b"{}")
        assert status == 503
        assert receiver._all == [] and receiver._sessions is None
    finally:
        handler.release.set()
        await receiver.close()
    assert applied(db) == [first]
    # start() opens it again, explicitly.
    await receiver.start()
    try:
        assert (await receiver.handle(request(late), b"{}"))[0] == 200
    finally:
        await receiver.close()
    assert applied(db) == sorted([first, late])


async def test_asgi_request_during_lifespan_shutdown_is_a_clean_503(db: str) -> None:
    """Through the ASGI interface: the answer is sent, no exception reaches the server."""
    handler = Blocking()
    receiver = WebhookReceiver(db=db, group="hooks", handler=handler, secret=None, concurrency=1)
    await receiver.start()
    await receiver.close()
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(event: Any) -> None:
        sent.append(event)

    scope = {
        "type": "http",
        "method": "POST",
        "headers": [(k.encode(), v.encode()) for k, v in request(str(uuid.uuid4())).items()],
    }
    await receiver(scope, receive, send)
    assert sent[0]["status"] == 503
    assert receiver._all == []
    assert applied(db) == []
