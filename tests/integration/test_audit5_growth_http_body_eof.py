"""A client that ends its side of the connection inside a request body is answered at once.

After the end of the stream no more of the body can come, yet the server kept the
connection, its request task and its deadline for the whole read timeout (10 s by default,
a connection of ``max_connections`` each), then answered 408 "the body did not arrive"
and logged it as a slow client. A client killed mid-upload is not slow: it is gone.
"""

from __future__ import annotations

import asyncio
import time

from tests.integration.test_http_api import serving


async def test_a_body_cut_short_by_the_end_of_the_stream_is_refused_at_once(
    sqlite_url: str,
) -> None:
    async with serving(sqlite_url, read_timeout=30.0) as client:
        port = client.server.port  # type: ignore[attr-defined]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST /messages/requeue HTTP/1.1\r\nHost: localhost\r\n"
            b"Content-Type: application/json\r\nContent-Length: 20\r\n\r\n{}"
        )  # ... 2 of the 20 bytes, and the end of the stream
        writer.write_eof()
        started = time.monotonic()
        answer = await asyncio.wait_for(reader.read(), 5)
        writer.close()
    assert answer.startswith(b"HTTP/1.1 400 Bad Request"), answer
    assert b"inside the request body" in answer
    assert time.monotonic() - started < 2
