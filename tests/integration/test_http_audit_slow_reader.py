"""The HTTP API against a client that asks for a big answer and never reads it (real
server, real PostgreSQL)."""

from __future__ import annotations

import asyncio
import socket

import httpx
import psycopg

import outboxer
from outboxer import load_settings
from outboxer.http import HttpApi, HttpServer
from outboxer.stores import create_store
from outboxer.testing import eventually

ROWS = 1000
#: A last error at its longest (MAX_ERROR_LENGTH), in 4-byte characters: JSON escapes each
#: as 12 bytes, so the answer to /messages?limit=1000 is some 24 MB, far more than the
#: kernel's socket buffers take.
HOSTILE_ERROR_CHARS = 1990


def seed_abandoned(url: str) -> None:
    with psycopg.connect(url) as conn:
        outboxer.enqueue_many(
            conn, [{"topic": "t", "payload": {"n": n}, "key": f"k{n}"} for n in range(ROWS)]
        )
        conn.execute(
            "UPDATE outboxer.outbox SET status = 'ABANDONED', attempts = 1, "
            "last_error = repeat(chr(128512), %s)",
            (HOSTILE_ERROR_CHARS,),
        )


async def test_a_client_that_never_reads_a_big_answer_is_dropped(pg_url: str) -> None:
    # uvicorn writes a whole answer into the transport's buffer and closes it; asyncio then
    # keeps the socket (and the buffer) until the client has read everything. The deadline
    # skipped closing transports, so a client that asked and stopped reading held its
    # connection and megabytes of the relay's memory for as long as it liked: with
    # max_connections of them, every probe got 503 for good.
    seed_abandoned(pg_url)
    api = HttpApi(create_store(pg_url), load_settings({"db": pg_url}, environ={}))
    server = await HttpServer(api, "127.0.0.1", 0, max_connections=1, read_timeout=2.0).start()
    stuck = socket.socket()
    try:
        stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window
        stuck.settimeout(30)
        await asyncio.to_thread(stuck.connect, ("127.0.0.1", server.port))
        stuck.sendall(
            f"GET /messages?status=ABANDONED&limit={ROWS} HTTP/1.1\r\nHost: localhost\r\n\r\n".encode()
        )
        # The answer has started (peeking reads nothing, so the window stays full).
        head = await asyncio.to_thread(stuck.recv, 12, socket.MSG_PEEK)
        assert head == b"HTTP/1.1 200", head
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
            busy = await client.get("/health")
            assert busy.status_code == 503, "the stuck client holds the only connection"

            async def answered() -> bool:
                return (await client.get("/health")).status_code == 200

            # Dropped once it has read nothing for a read timeout (2 s), not held for good.
            await eventually(answered, timeout=15)
    finally:
        stuck.close()
        await server.close()
