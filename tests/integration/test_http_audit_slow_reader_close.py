"""Closing the HTTP API while a client holds a big answer it does not read (real server,
real PostgreSQL)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time

from outboxer import load_settings
from outboxer.http import HttpApi, HttpServer
from outboxer.stores import create_store
from tests.integration.test_http_audit_slow_reader import ROWS, seed_abandoned


async def test_closing_the_server_does_not_wait_for_a_client_that_does_not_read(
    pg_url: str,
) -> None:
    seed_abandoned(pg_url)
    api = HttpApi(create_store(pg_url), load_settings({"db": pg_url}, environ={}))
    server = await HttpServer(api, "127.0.0.1", 0, read_timeout=30.0).start()
    stuck = socket.socket()
    try:
        stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stuck.settimeout(30)
        await asyncio.to_thread(stuck.connect, ("127.0.0.1", server.port))
        stuck.sendall(
            f"GET /messages?status=ABANDONED&limit={ROWS} HTTP/1.1\r\nHost: localhost\r\n\r\n".encode()
        )
        head = await asyncio.to_thread(stuck.recv, 12, socket.MSG_PEEK)
        assert head == b"HTTP/1.1 200", head
        started = time.monotonic()
        await server.close()
        elapsed = time.monotonic() - started
        # Dropped (what the kernel already took still arrives), not left open with the
        # rest of its answer once close() returned.
        stuck.settimeout(5)

        def read_all() -> bytes:
            answer = bytearray()
            with contextlib.suppress(ConnectionResetError):
                while chunk := stuck.recv(1 << 20):
                    answer += chunk
            return bytes(answer)

        answer = await asyncio.to_thread(read_all)
    finally:
        stuck.close()
    assert elapsed < 2, f"close() waited {elapsed:.1f}s for a client that reads nothing"
    head, _, body = answer.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    assert len(body) < length, "the answer was cut, not kept for the client"
