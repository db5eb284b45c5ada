"""The webhook receiver applies only whole request bodies. A client that went away mid-body
used to have the part that arrived applied and recorded in the inbox (``http.disconnect``
has no ``more_body``, so it ended the read loop like the last chunk): the sender's full
retry was then a duplicate, and the real message was never applied. Driven as ASGI, with
PostgreSQL for the inbox."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, MutableMapping
from typing import Any

import psycopg
import pytest

from outboxer.consumer import Delivery
from outboxer.receivers.webhook import WebhookReceiver

Event = MutableMapping[str, Any]


class Exchange:
    """One request driven through the ASGI app: the events it receives, the ones it sent."""

    def __init__(self, body_events: list[Event], headers: dict[str, str]) -> None:
        self.events = list(body_events)
        self.sent: list[Event] = []
        self.scope: dict[str, Any] = {
            "type": "http",
            "method": "POST",
            "path": "/",
            "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()],
        }

    async def receive(self) -> Event:
        return self.events.pop(0) if self.events else {"type": "http.disconnect"}

    async def send(self, event: Event) -> None:
        self.sent.append(event)

    async def run(self, app: WebhookReceiver) -> Exchange:
        await app(self.scope, self.receive, self.send)
        return self

    @property
    def status(self) -> int | None:
        starts = [e["status"] for e in self.sent if e["type"] == "http.response.start"]
        return starts[0] if starts else None


def headers(length: int) -> dict[str, str]:
    return {
        "outboxer-id": str(uuid.uuid4()),
        "outboxer-topic": "hook.t",
        "content-type": "text/plain",
        "content-length": str(length),
    }


def chunk(body: bytes, more: bool) -> Event:
    return {"type": "http.request", "body": body, "more_body": more}


@pytest.fixture
async def hooks(pg_url: str) -> AsyncIterator[tuple[WebhookReceiver, list[Delivery]]]:
    calls: list[Delivery] = []

    def handler(message: Delivery, conn: Any) -> None:
        calls.append(message)

    receiver = WebhookReceiver(db=pg_url, group="hooks", handler=handler, secret=None)
    yield receiver, calls
    await receiver.close()


def inbox(db: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(db) as conn:
        return conn.execute("SELECT consumer, message_id FROM outboxer.inbox").fetchall()


async def test_a_client_gone_mid_body_has_nothing_applied(
    pg_url: str, hooks: tuple[WebhookReceiver, list[Delivery]]
) -> None:
    receiver, calls = hooks
    sent = headers(len(b"the whole message"))
    exchange = await Exchange(
        [chunk(b"the whole", more=True), {"type": "http.disconnect"}], sent
    ).run(receiver)
    assert exchange.sent == []  # nobody is there to answer
    assert calls == [] and inbox(pg_url) == []
    # The sender's retry is the message itself, applied.
    retry = await Exchange([chunk(b"the whole message", more=False)], sent).run(receiver)
    assert retry.status == 200
    assert [c.payload for c in calls] == ["the whole message"]
    assert inbox(pg_url) == [("hooks", uuid.UUID(sent["outboxer-id"]))]


async def test_a_body_shorter_than_its_content_length_is_refused(
    pg_url: str, hooks: tuple[WebhookReceiver, list[Delivery]]
) -> None:
    receiver, calls = hooks
    exchange = await Exchange([chunk(b"the whole", more=False)], headers(17)).run(receiver)
    assert exchange.status == 400
    assert b"Content-Length" in exchange.sent[-1]["body"]
    assert calls == [] and inbox(pg_url) == []


async def test_a_body_in_chunks_as_long_as_its_content_length_is_applied(
    pg_url: str, hooks: tuple[WebhookReceiver, list[Delivery]]
) -> None:
    receiver, calls = hooks
    exchange = await Exchange(
        [chunk(b"the whole", more=True), chunk(b" message", more=False)], headers(17)
    ).run(receiver)
    assert exchange.status == 200
    assert [c.payload for c in calls] == ["the whole message"]
    assert len(inbox(pg_url)) == 1
