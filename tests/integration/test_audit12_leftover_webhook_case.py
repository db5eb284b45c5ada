"""User header names that differ only in case (``X-Id`` and ``x-id``): HTTP folds header
names, so the receiver got one of them and the other value was lost without a word, the
message counted as delivered. The webhook publisher now fails such a message for good,
naming the clash; its batch mates go out."""

from __future__ import annotations

import pytest

from outboxer.brokers.base import OutcomeKind
from outboxer.brokers.webhook import WebhookPublisher
from outboxer.testing import make_message
from tests.integration.test_audit12_headers_webhook import server

__all__ = ["server"]


@pytest.mark.parametrize(
    "headers",
    [
        {"X-Id": "a", "x-id": "b"},
        {"Authorization": "a", "authorization": "b"},  # both sent under Outboxer-Header-
        {"with space": "a", "WITH SPACE": "b"},
    ],
)
async def test_case_variant_header_names_fail_their_message_alone(
    server: tuple[str, list[list[tuple[str, str]]]], headers: dict[str, str]
) -> None:
    url, seen = server
    clash = make_message("orders", {"n": 1}, headers=headers)
    fine = make_message("orders", {"n": 2}, headers={"X-Id": "a", "x-other": "b"})
    async with WebhookPublisher(url, secret="s3cret") as publisher:
        outcomes = await publisher.publish_batch([clash, fine])
    assert [outcome.kind for outcome in outcomes] == [
        OutcomeKind.FAILED,
        OutcomeKind.PUBLISHED,
    ], [outcome.error for outcome in outcomes]
    assert outcomes[0].retryable is False
    first, second = headers
    assert f"{first!r} and {second!r} differ only in case" in (outcomes[0].error or "")
    assert len(seen) == 1  # only the fine one was posted
