"""User header names that differ only in case (``X-Id`` and ``x-id``): HTTP folds header
names, so the receiver got one of them and the other value was lost without a word, the
message counted as delivered. The webhook publisher now fails such a message for good,
naming the clash; its batch mates go out."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import pytest

from outboxer.brokers.base import OutcomeKind
from outboxer.brokers.webhook import WebhookPublisher
from outboxer.testing import make_message


@pytest.fixture
def server() -> Iterator[tuple[str, list[list[tuple[str, str]]]]]:
    seen: list[list[tuple[str, str]]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # the name http.server calls
            self.rfile.read(int(self.headers.get("content-length", "0")))
            seen.append(list(self.headers.items()))
            self.send_response(200)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/hook", seen
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(10)


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
