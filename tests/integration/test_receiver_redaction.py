"""Receivers redact what they log and what the webhook receiver answers: a handler's or a
driver's error text may carry a URL with its password. Inside a user's ASGI app the
application's own log handlers see these records, so they must be clean at the logger."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import MutableMapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from outboxer.consumer import Delivery
from outboxer.receivers import create_receiver
from outboxer.receivers.base import Incoming
from outboxer.receivers.file import FileReceiver
from outboxer.receivers.webhook import WebhookReceiver
from outboxer.retry import Backoff

PASSWORD = "hunter2-not-for-logs"
LEAKY = f"cannot reach postgresql://app:{PASSWORD}@db.internal:5432/app"


def leaked(records: Sequence[logging.LogRecord]) -> list[str]:
    return [r.getMessage() for r in records if PASSWORD in r.getMessage()]


async def post(receiver: WebhookReceiver, message_id: str) -> tuple[int, dict[str, Any]]:
    sent: list[MutableMapping[str, Any]] = []
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/",
        "headers": [
            (b"outboxer-id", message_id.encode()),
            (b"outboxer-topic", b"hook.t"),
            (b"content-type", b"application/json"),
        ],
    }

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b'{"n": 1}', "more_body": False}

    async def send(event: MutableMapping[str, Any]) -> None:
        sent.append(event)

    await receiver(scope, receive, send)
    return sent[0]["status"], json.loads(sent[1]["body"])


async def test_webhook_answers_and_logs_a_handler_error_redacted(
    pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    def handler(message: Delivery, conn: Any) -> None:
        raise RuntimeError(LEAKY)

    receiver = WebhookReceiver(
        db=pg_url,
        group="hooks",
        handler=handler,
        secret=None,
        max_attempts=2,
        backoff=Backoff(0.1, 1, 0.1, 0),
    )
    message_id = str(uuid.uuid4())
    caplog.set_level(logging.INFO)
    try:
        retry_status, retry = await post(receiver, message_id)
        dead_status, dead = await post(receiver, message_id)
    finally:
        await receiver.close()
    assert (retry_status, dead_status) == (503, 200)
    assert dead["result"] == "dead-lettered"
    for answer in (retry, dead):
        assert PASSWORD not in answer["error"]
        assert "postgresql://app:***@db.internal:5432/app" in answer["error"]
    logged = [r for r in caplog.records if r.name == "outboxer.consumer.webhook"]
    assert any("dead letter" in r.getMessage() and "app:***@" in r.getMessage() for r in logged)
    assert leaked(caplog.records) == []


async def test_receiver_logs_a_failed_ack_redacted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "events.jsonl"
    record = {"id": str(uuid.uuid4()), "topic": "t", "content_type": "text/plain", "payload": "x"}
    path.write_text(json.dumps(record) + "\n")
    receiver = create_receiver(f"file://{path}", group="g")

    async def ack(self: FileReceiver, incomings: Sequence[Incoming]) -> None:
        raise ConnectionError(LEAKY)

    monkeypatch.setattr(FileReceiver, "_ack", ack)
    await receiver.connect()
    try:
        received = await receiver.receive(1, 1.0)
        await receiver.ack(received)
    finally:
        await receiver.close()
    assert receiver.stats.failed_acks == 1
    [warning] = [r for r in caplog.records if r.name == "outboxer.receiver"]
    assert "could not ack" in warning.getMessage() and "app:***@" in warning.getMessage()
    assert leaked(caplog.records) == []
