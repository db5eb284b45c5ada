"""The consumer's keepalives on TLS connections: set on the TCP socket under the TLS layer
(asyncpg's transport over TLS, PyMySQL's SSLSocket), read back with getsockopt from the
live connection's socket, found from outside its driver by its local port.

The shared servers have TLS off and must not be reconfigured: asyncpg speaks TLS to a
terminator here that answers PostgreSQL's SSLRequest, does the handshake as the server and
forwards the decrypted stream to the shared PostgreSQL; PyMySQL to a private MariaDB with
TLS on (test_audit12_mytls_private_server's). No vanished host is simulated: a user-space
peer still has its kernel acknowledge data and answer probes (see
test_audit19_keepalive_sockets), so the options the kernel was given are the proof.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import struct
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from outboxer.consumer_db import AsyncpgSession, DaemonThreadPool, PyMySQLSession
from tests.integration.test_audit12_mytls_private_server import (
    _certificates,
    tls_server,  # noqa: F401 -- the private MariaDB with TLS on, a fixture
)
from tests.integration.test_audit19_keepalive_sockets import (
    BOUND,
    BOUNDED,
    client_socket,
    keepalives,
)

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="TCP_KEEPIDLE and /proc are Linux's"
)

#: PostgreSQL's SSLRequest: length 8, code 1234.5679.
SSL_REQUEST = struct.pack("!ii", 8, 80877103)


class TlsFront:
    """Accepts PostgreSQL clients asking for TLS, and forwards what they send inside it to
    the server at ``target`` in the clear; ``peers``: the clients' addresses, as accepted."""

    def __init__(self, context: ssl.SSLContext, target: tuple[str, int]) -> None:
        self.context = context
        self.target = target
        self.peers: list[tuple[str, int]] = []
        self.port = 0
        self._tasks: set[asyncio.Task[None]] = set()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        upstream: asyncio.StreamWriter | None = None
        try:
            if await reader.readexactly(len(SSL_REQUEST)) != SSL_REQUEST:
                return  # not a client asking for TLS: closed, so it fails
            writer.write(b"S")
            await writer.drain()
            await writer.start_tls(self.context)
            self.peers.append(writer.get_extra_info("peername")[:2])
            up_reader, upstream = await asyncio.open_connection(*self.target)

            async def pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
                sink.close()

            await asyncio.gather(pump(reader, upstream), pump(up_reader, writer))
        except (OSError, asyncio.IncompleteReadError, ssl.SSLError):
            pass  # a side closed: the other follows below
        finally:
            writer.close()
            if upstream is not None:
                upstream.close()
            self._tasks.discard(task)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[TlsFront]:
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        try:
            yield self
        finally:
            server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await server.wait_closed()


async def test_asyncpg_over_tls_has_the_keepalives_on_the_socket_under_it(
    pg_url: str, tmp_path: Path
) -> None:
    _, cert, key = _certificates(tmp_path)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    parts = urlsplit(pg_url)
    async with TlsFront(context, (parts.hostname or "127.0.0.1", parts.port or 5432)).running() as (
        front
    ):
        url = parts._replace(netloc=f"postgres@127.0.0.1:{front.port}").geturl()
        session = AsyncpgSession(f"{url}?sslmode=require", "outboxer")
        session.statement_timeout = BOUND
        await session.open()
        try:
            # Answered through the front: the client spoke TLS.
            assert await session.conn.fetchval("SELECT 1") == 1
            (peer,) = front.peers
            with client_socket(peer[1]) as sock:
                assert keepalives(sock) == BOUNDED
        finally:
            await session.close()


async def test_pymysql_over_tls_has_the_keepalives_on_its_socket(
    tls_server: tuple[str, Path],  # noqa: F811 -- the fixture imported above
) -> None:
    url, _ = tls_server
    pool = DaemonThreadPool(1, thread_name_prefix="audit19-keepalive")
    session = PyMySQLSession(f"{url}?ssl_mode=required", "outboxer", pool)
    session.statement_timeout = BOUND
    await session.open()
    try:
        with session.conn.cursor() as cursor:
            cursor.execute("SHOW SESSION STATUS LIKE 'Ssl_version'")
            assert str(cursor.fetchone()[1]).startswith("TLS")
        # The server's address, as the private server's processlist shows no client's.
        parts = urlsplit(url)
        with client_socket(peer=(parts.hostname or "127.0.0.1", parts.port or 3306)) as sock:
            assert keepalives(sock) == BOUNDED
    finally:
        await session.close()
        pool.shutdown(wait=False)
