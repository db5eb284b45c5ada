"""The webhook receiver (an ASGI app) behind uvicorn, fed by the real relay: signatures, the
inbox, retries through the relay, dead letters; PostgreSQL for both sides."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import psycopg
import pytest
import uvicorn

import outboxer
from outboxer.consumer import Delivery
from outboxer.receivers.webhook import WebhookReceiver
from outboxer.retry import Backoff
from tests.consumer_handlers import APPLIED_DDL, record
from tests.services import free_port

SECRET = "s3cret-for-tests"


class Served:
    """A receiver served by uvicorn on a free port, mounted under /hooks of a bigger app."""

    def __init__(self, receiver: WebhookReceiver) -> None:
        self.receiver = receiver
        self.port = free_port()

        async def app(scope: Any, receive: Any, send: Any) -> None:
            # The receiver mounted at /hooks of an application of its own (routing by hand).
            if scope["type"] == "http" and scope["path"].startswith("/hooks"):
                await receiver(scope, receive, send)
                return
            if scope["type"] == "lifespan":
                await receiver(scope, receive, send)
                return
            await send({"type": "http.response.start", "status": 404, "headers": []})
            await send({"type": "http.response.body", "body": b""})

        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)

    def url(self, secret: str = SECRET) -> str:
        return f"http://127.0.0.1:{self.port}/hooks?secret={secret}"

    async def __aenter__(self) -> Served:
        self.task = asyncio.create_task(self.server.serve())
        while not self.server.started:
            await asyncio.sleep(0.02)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.should_exit = True
        await self.task


@pytest.fixture
def db(pg_url: str) -> str:
    with psycopg.connect(pg_url) as conn:
        conn.execute(APPLIED_DDL)
    return pg_url


def enqueue(db: str, count: int, keys: int = 2) -> None:
    with psycopg.connect(db) as conn:
        outboxer.enqueue_many(
            conn,
            [
                {
                    "topic": "hook.t",
                    "payload": {"n": n},
                    "key": f"k{n % keys}",
                    "headers": {"tr": "x y"},
                }
                for n in range(count)
            ],
        )


def rows(db: str, sql: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(db) as conn:
        return conn.execute(sql).fetchall()


def statuses(db: str) -> dict[str, int]:
    return dict(rows(db, "SELECT status, count(*) FROM outboxer.outbox GROUP BY status"))  # type: ignore[arg-type]


async def relay_until(db: str, broker: str, done: Callable[[], bool], timeout: float = 30) -> None:
    settings = outboxer.load_settings(
        {"db": db, "broker": broker, "poll_interval": 0.1, "backoff_base": 0.1, "backoff_max": 1},
        environ={},
    )
    relay = outboxer.Relay.from_settings(settings)
    task = asyncio.create_task(relay.run())
    deadline = time.monotonic() + timeout
    try:
        while not done():
            assert time.monotonic() < deadline, "timed out"
            await asyncio.sleep(0.05)
    finally:
        relay.stop()
        await task


@pytest.fixture
async def receiver(db: str) -> AsyncIterator[WebhookReceiver]:
    made = WebhookReceiver(db=db, group="hooks", handler=record, secret=SECRET, max_attempts=3)
    yield made
    await made.close()


async def test_relay_to_receiver_applies_each_message_once(db: str) -> None:
    seen: list[Delivery] = []

    def handler(message: Delivery, conn: Any) -> None:
        seen.append(message)
        record(message, conn)

    receiver = WebhookReceiver(db=db, group="hooks", handler=handler, secret=SECRET)
    enqueue(db, 20)
    async with Served(receiver) as served:
        await relay_until(db, served.url(), lambda: statuses(db).get("PUBLISHED") == 20)
        # A relay that lost its settle sends everything again: all duplicates now.
        with psycopg.connect(db) as conn:
            conn.execute("UPDATE outboxer.outbox SET status = 'PENDING'")
        await relay_until(db, served.url(), lambda: statuses(db).get("PUBLISHED") == 20)
    await receiver.close()
    assert rows(db, "SELECT count(*), count(DISTINCT message_id) FROM applied") == [(20, 20)]
    for key in ("k0", "k1"):
        numbers = [
            r[0] for r in rows(db, f"SELECT n FROM applied WHERE key = '{key}' ORDER BY position")
        ]
        assert numbers == sorted(numbers)
    assert (receiver.stats.applied, receiver.stats.duplicates) == (20, 20)
    assert seen[0].headers == {"tr": "x y"} and seen[0].topic == "hook.t"


async def test_a_wrong_signature_is_refused_and_nothing_applied(
    db: str, receiver: WebhookReceiver
) -> None:
    enqueue(db, 1)
    async with Served(receiver) as served:
        await relay_until(
            db, served.url("not-the-secret"), lambda: statuses(db).get("ABANDONED") == 1
        )
    [error] = rows(db, "SELECT last_error FROM outboxer.outbox")
    assert "401" in error[0] and "mismatch" in error[0]
    assert rows(db, "SELECT count(*) FROM applied") == [(0,)]


async def test_failures_are_retried_by_the_relay_then_dead_lettered(db: str) -> None:
    def handler(message: Delivery, conn: Any) -> None:
        if message.payload["n"] == 0:
            raise RuntimeError("never")
        if message.attempt < 2:
            raise RuntimeError("not yet")
        record(message, conn)

    receiver = WebhookReceiver(
        db=db,
        group="hooks",
        handler=handler,
        secret=SECRET,
        max_attempts=3,
        backoff=Backoff(0.1, 1, 0.1, 0),
    )
    enqueue(db, 3, keys=3)
    try:
        async with Served(receiver) as served:
            await relay_until(db, served.url(), lambda: statuses(db).get("PUBLISHED") == 3)
    finally:
        await receiver.close()
    assert sorted(r[0] for r in rows(db, "SELECT n FROM applied")) == [1, 2]
    assert rows(db, "SELECT attempt FROM applied") == [(2,), (2,)]
    assert rows(db, "SELECT error, attempts FROM outboxer.dead_letters") == [
        ("RuntimeError: never", 3)
    ]


async def test_handle_refuses_what_is_not_an_outboxer_webhook(db: str) -> None:
    receiver = WebhookReceiver(db=db, group="hooks", handler=record, secret=None)
    try:
        status, body, _ = await receiver.handle({"content-type": "application/json"}, b"{}")
    finally:
        await receiver.close()
    assert status == 400 and "not an outboxer webhook" in body["error"]


async def test_only_what_the_signature_covers_reaches_the_handler(db: str) -> None:
    """Scheme v2 covers the topic, the key, the content type and the user headers: one of
    them changed on the way is refused (401); a header added on the way (a second key, a
    proxy's) never reaches the handler; a request stripped down to the v1 signature (the
    body only) is refused unless the receiver accepts relays older than v2."""
    from outboxer.brokers.webhook import WebhookPublisher

    seen: list[Delivery] = []

    def handler(message: Delivery, conn: Any) -> None:
        seen.append(message)
        record(message, conn)

    publisher = WebhookPublisher("http://127.0.0.1:9/hooks", secret=SECRET)

    def request(n: int, key: str | None) -> tuple[dict[str, str], bytes]:
        [message] = outboxer.Outbox().build("hook.t", {"n": n}, key=key, headers={"tr": "x"})
        sent = publisher.request_headers(message)
        return {name.lower(): value for name, value in sent.items()}, message.payload

    strict = WebhookReceiver(db=db, group="hooks", handler=handler, secret=SECRET)
    lenient = WebhookReceiver(
        db=db, group="hooks-v1", handler=handler, secret=SECRET, require_signed_headers=False
    )
    try:
        headers, body = request(0, "k0")
        for name, value in (("outboxer-topic", "hook.evil"), ("outboxer-key", "k9"), ("tr", "y")):
            status, answer, _ = await strict.handle({**headers, name: value}, body)
            assert (status, "mismatch" in answer["error"]) == (401, True), name
        headers, body = request(1, None)
        added = {**headers, "outboxer-key": "k-added", "x-forwarded-for": "10.0.0.1"}
        assert (await strict.handle(added, body))[0] == 200
        assert seen[-1].key is None and seen[-1].headers == {"tr": "x"}
        headers, body = request(2, "k2")
        v1_only = {**headers, "outboxer-signature": headers["outboxer-signature"].split(",")[0]}
        del v1_only["outboxer-signed-headers"]
        status, answer, _ = await strict.handle(v1_only, body)
        assert status == 401 and "not signed" in answer["error"]
        assert (await lenient.handle(v1_only, body))[0] == 200
        assert seen[-1].payload == {"n": 2} and seen[-1].key == "k2"
    finally:
        await strict.close()
        await lenient.close()
    assert sorted(r[0] for r in rows(db, "SELECT n FROM applied")) == [1, 2]
