"""A webhook receiver that answers with a redirect (a moved endpoint, an http-to-https
upgrade, a load balancer pointing elsewhere).

Redirects are not followed, rightly: the signed request and the configured credentials
would go wherever the receiver points. But the error recorded on the message said only
"answered HTTP 301": which URL to configure instead had to be found by hand. The error now
names the ``Location`` (absolute, without its credentials or query), the failure stays
permanent, and the place redirected to gets nothing."""

from __future__ import annotations

import asyncio

import pytest

from outboxer.brokers.base import OutcomeKind
from outboxer.brokers.webhook import WebhookPublisher
from outboxer.testing import make_message


async def _serve(answer: bytes) -> tuple[asyncio.Server, int, list[bytes]]:
    """A server answering every request with ``answer``; records each request's head."""
    heads: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                heads.append(head)
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.lower().split(b"\r\n")
                        if line.startswith(b"content-length:")
                    ),
                    0,
                )
                await reader.readexactly(length)
                writer.write(answer)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.transport.abort()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], heads


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
async def test_a_redirect_elsewhere_is_permanent_names_the_location_and_is_not_followed(
    status: int,
) -> None:
    elsewhere, other_port, other_heads = await _serve(
        b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
    )
    location = f"http://user:hunter2@127.0.0.1:{other_port}/moved?token=s3cr3t"
    answer = (
        f"HTTP/1.1 {status} Moved\r\nLocation: {location}\r\nContent-Length: 5\r\n\r\nmoved"
    ).encode()
    receiver, port, heads = await _serve(answer)
    try:
        async with WebhookPublisher(
            f"http://127.0.0.1:{port}/hooks", secret="topsecret", timeout=2
        ) as publisher:
            [outcome] = await publisher.publish_batch([make_message("t", key="k")])
    finally:
        receiver.close()
        elsewhere.close()
    assert outcome.kind is OutcomeKind.FAILED and not outcome.retryable, outcome
    error = outcome.error or ""
    assert f"HTTP {status}" in error, error
    assert f"redirects to http://127.0.0.1:{other_port}/moved, not followed" in error, error
    assert "moved" in error.rsplit("not followed", 1)[1], error  # the body's excerpt too
    for secret in ("hunter2", "s3cr3t", "topsecret", "user:"):
        assert secret not in error, error
    assert len(heads) == 1 and other_heads == [], "the redirect was followed"


async def test_a_relative_location_is_shown_absolute() -> None:
    receiver, port, _ = await _serve(
        b"HTTP/1.1 308 Permanent Redirect\r\nLocation: /v2/hooks?sig=abc\r\n"
        b"Content-Length: 0\r\n\r\n"
    )
    try:
        async with WebhookPublisher(f"http://127.0.0.1:{port}/hooks", timeout=2) as publisher:
            [outcome] = await publisher.publish_batch([make_message("t")])
    finally:
        receiver.close()
    error = outcome.error or ""
    assert not outcome.retryable, outcome
    assert f"redirects to http://127.0.0.1:{port}/v2/hooks" in error, error
    assert "sig=abc" not in error, error


async def test_a_3xx_without_location_keeps_the_plain_error() -> None:
    receiver, port, _ = await _serve(b"HTTP/1.1 300 Multiple Choices\r\nContent-Length: 0\r\n\r\n")
    try:
        async with WebhookPublisher(f"http://127.0.0.1:{port}/hooks", timeout=2) as publisher:
            [outcome] = await publisher.publish_batch([make_message("t")])
    finally:
        receiver.close()
    assert not outcome.retryable, outcome
    assert (outcome.error or "").endswith("answered HTTP 300"), outcome.error
