"""User headers against the webhook publisher's own: a message header must not replace a
header the relay is configured to send (its credentials), and must reach the handler."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import pytest

from outboxer.brokers.webhook import WebhookPublisher
from outboxer.receivers.base import decode
from outboxer.receivers.webhook import _envelope
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


async def test_a_message_header_cannot_replace_the_configured_credentials(
    server: tuple[str, list[list[tuple[str, str]]]],
) -> None:
    url, seen = server
    publisher = WebhookPublisher(
        url, headers={"Authorization": "Bearer relay", "X-Api-Key": "relay-key"}
    )
    user = {
        "Authorization": "Bearer attacker",
        "x-api-key": "attacker-key",
        "User-Agent": "my-agent",
        "Accept": "text/csv",
        "Via": "1.1 somewhere",
    }
    message = make_message("orders", {"n": 1}, headers=user)
    async with publisher:
        [outcome] = await publisher.publish_batch([message])
    assert outcome.published, outcome.error
    [request] = seen
    sent = {}
    for name, value in request:
        sent.setdefault(name.lower(), []).append(value)
    # The relay's own credentials went out, once, unchanged.
    assert sent["authorization"] == ["Bearer relay"]
    assert sent["x-api-key"] == ["relay-key"]
    # And the user's headers reach the receiver's handler as they were enqueued.
    delivered = decode(_envelope({n: v[-1] for n, v in sent.items()}), b'{"n":1}').delivery
    assert {name: delivered.headers.get(name.lower()) for name in user} == user


async def test_a_header_name_http_cannot_carry_is_delivered_not_failed(
    server: tuple[str, list[list[tuple[str, str]]]],
) -> None:
    """Enqueue takes any text as a header name; the publisher failed such a message for
    good ("cannot be sent over HTTP") instead of encoding the name as it encodes values."""
    url, seen = server
    user = {"with space": "a", "naïve": "b", "a:b": "c", "100%": "d", "plain": "e f"}
    message = make_message("orders", {"n": 1}, headers=user)
    async with WebhookPublisher(url) as publisher:
        [outcome] = await publisher.publish_batch([message])
    assert outcome.published, outcome.error
    [request] = seen
    delivered = decode(_envelope({n.lower(): v for n, v in request}), b'{"n":1}').delivery
    assert dict(delivered.headers) == user
