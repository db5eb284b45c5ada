"""A receiver's ``Retry-After`` that is no RFC 9110 delay (a non-ASCII digit such as ``²``,
which ``str.isdigit`` accepts and ``float`` refuses): the answer stays an HTTP 503 with no
wait asked for, not a ValueError that hid the status. A real local HTTP server."""

from __future__ import annotations

from outboxer.brokers.base import OutcomeKind
from outboxer.brokers.webhook import WebhookPublisher, parse_retry_after
from outboxer.testing import make_message
from tests.integration.test_broker_webhook import HookServer


def test_non_ascii_digits_are_no_delay() -> None:
    for text in ("²", "12³", "٣", "\u0663\u0660"):
        assert parse_retry_after(text) is None, text


async def test_a_503_with_an_unreadable_retry_after_is_still_a_503() -> None:
    server = await HookServer().start()
    try:
        async with WebhookPublisher(server.url + "/hooks") as publisher:
            headers = {"test-answer": "503", "test-retry-after": "²"}  # the server decodes it
            [outcome] = await publisher.publish_batch([make_message("t", headers=headers)])
    finally:
        await server.stop()
    assert outcome.kind is OutcomeKind.FAILED and outcome.retryable
    assert outcome.error is not None and "HTTP 503" in outcome.error, outcome.error
    assert outcome.retry_after is None
