"""TLS on MySQL connections, seen by a man in the middle: a TCP proxy on a free port in front
of the shared MariaDB that rewrites the server's greeting (the Initial Handshake) and records
what the client sends next.

* With an ``ssl_mode`` that requires TLS and a greeting without CLIENT_SSL, no login
  (HandshakeResponse: the user name, the auth response, with ``mysql_clear_password`` the
  password itself) may leave the client: aiomysql's pool (the relay's store) sent it and
  was refused by outboxer only after the login.
* With ``ssl_mode=disabled`` and a greeting offering TLS, the client must not ask for TLS
  (the MySQL client's DISABLED: an unencrypted connection): PyMySQL 1.2 tries TLS whenever
  it was given no TLS argument (its PREFERRED default).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

import pytest

from outboxer.errors import InsecureConnectionError, StoreError
from outboxer.stores import create_store

CLIENT_SSL = 0x0800
PASSWORD = "audit12-secret-pw"
REFUSED = "does not offer TLS"


def _read_packet(sock: socket.socket) -> tuple[int, bytes]:
    header = _read_exactly(sock, 4)
    length = int.from_bytes(header[:3], "little")
    return header[3], _read_exactly(sock, length)


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError(f"closed after {len(data)} of {n} bytes")
        data += chunk
    return data


def _packet(seq: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "little") + bytes([seq]) + payload


def _rewrite_greeting(payload: bytes, ssl: bool, plugin: bytes | None) -> bytes:
    """The Initial Handshake (protocol 10) with CLIENT_SSL set or cleared and, optionally,
    another default auth plugin."""
    assert payload[0] == 10, payload[:1]
    at = payload.index(b"\0", 1) + 1 + 4 + 8 + 1  # version, thread id, scramble 1, filler
    (lower,) = struct.unpack_from("<H", payload, at)
    lower = lower | CLIENT_SSL if ssl else lower & ~CLIENT_SSL
    payload = payload[:at] + struct.pack("<H", lower) + payload[at + 2 :]
    if plugin is not None:
        assert payload.endswith(b"\0")
        start = payload.rindex(b"\0", 0, len(payload) - 1) + 1
        payload = payload[:start] + plugin + b"\0"
    return payload


@dataclass
class Mitm:
    """One connection at a time: the greeting rewritten, then either the client's first
    packet recorded and the connection dropped, or (``forward``) everything relayed."""

    ssl: bool
    plugin: bytes | None = None
    forward: bool = False
    port: int = 0
    first: list[bytes] = field(default_factory=list)  # the client's first packet, per connection
    done: threading.Event = field(default_factory=threading.Event)
    errors: list[BaseException] = field(default_factory=list)

    def start(self, upstream: tuple[str, int]) -> None:
        self._upstream = upstream
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def stop(self) -> None:
        self._listener.close()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(client,), daemon=True).start()

    def _handle(self, client: socket.socket) -> None:
        server = socket.create_connection(self._upstream, timeout=10)
        client.settimeout(10)
        try:
            seq, greeting = _read_packet(server)
            client.sendall(_packet(seq, _rewrite_greeting(greeting, self.ssl, self.plugin)))
            sent = b""
            with contextlib.suppress(ConnectionError):  # the client hung up: nothing sent
                _, sent = _read_packet(client)
            self.first.append(sent)
            if self.forward and sent:
                server.sendall(_packet(1, sent))
                self._relay(client, server)
        except BaseException as exc:  # reported by the test
            self.errors.append(exc)
        finally:
            client.close()
            server.close()
            self.done.set()

    def _relay(self, client: socket.socket, server: socket.socket) -> None:
        def pump(src: socket.socket, dst: socket.socket) -> None:
            try:
                while data := src.recv(65536):
                    dst.sendall(data)
            except OSError:
                pass
            finally:
                for sock in (src, dst):
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_RDWR)

        back = threading.Thread(target=pump, args=(server, client), daemon=True)
        back.start()
        pump(client, server)
        back.join(10)

    def client_packet(self) -> bytes:
        assert self.done.wait(10), "the proxy saw no connection"
        assert not self.errors, self.errors
        return self.first[0]

    async def client_packet_async(self) -> bytes:
        """As client_packet, leaving the event loop free: asyncio closes a transport's
        socket in a callback, and the proxy waits for that hang-up."""
        return await asyncio.to_thread(self.client_packet)


@pytest.fixture
def mitm_factory(mysql_url: str) -> Iterator[object]:
    parts = urlsplit(mysql_url)
    made: list[Mitm] = []

    def make(**kwargs: object) -> tuple[Mitm, str]:
        mitm = Mitm(**kwargs)  # type: ignore[arg-type]
        mitm.start((parts.hostname or "127.0.0.1", parts.port or 3306))
        made.append(mitm)
        netloc = f"{parts.username}:{PASSWORD}@127.0.0.1:{mitm.port}"
        return mitm, urlunsplit(parts._replace(netloc=netloc))

    yield make
    for mitm in made:
        mitm.stop()


def _assert_no_login(sent: bytes) -> None:
    assert sent == b"", f"the client sent its login in clear: {sent!r}"


@pytest.mark.parametrize("mode", ["required", "verify_ca", "verify_identity"])
@pytest.mark.parametrize("plugin", [None, b"mysql_clear_password"])
async def test_the_relay_store_sends_no_login_to_a_server_stripped_of_tls(
    mitm_factory, mode: str, plugin: bytes | None
) -> None:
    mitm, url = mitm_factory(ssl=False, plugin=plugin)
    with pytest.raises(StoreError) as caught:
        async with create_store(f"{url}?ssl_mode={mode}"):
            pass
    _assert_no_login(await mitm.client_packet_async())
    assert isinstance(caught.value, InsecureConnectionError), caught.value
    assert REFUSED in str(caught.value)


@pytest.mark.parametrize("plugin", [None, b"mysql_clear_password"])
def test_pymysql_paths_send_no_login_to_a_server_stripped_of_tls(
    mitm_factory, plugin: bytes | None
) -> None:
    from outboxer.payload_admin import connect

    mitm, url = mitm_factory(ssl=False, plugin=plugin)
    with pytest.raises(InsecureConnectionError, match=REFUSED):
        connect(f"{url}?ssl_mode=required")
    _assert_no_login(mitm.client_packet())


async def test_the_relay_store_still_asks_for_tls_when_the_server_offers_it(mitm_factory) -> None:
    """The check lets a greeting offering TLS through: the client's next packet is the
    SSLRequest (32 bytes, CLIENT_SSL set), not a refusal and not a login."""
    mitm, url = mitm_factory(ssl=True)
    with pytest.raises(StoreError):  # the real server behind has TLS off: the handshake fails
        async with create_store(f"{url}?ssl_mode=required"):
            pass
    sent = await mitm.client_packet_async()
    assert len(sent) == 32 and struct.unpack_from("<I", sent)[0] & CLIENT_SSL, sent


def _no_tls_asked(sent: bytes) -> None:
    (flags,) = struct.unpack_from("<I", sent)
    assert not flags & CLIENT_SSL, f"the client asked for TLS: {len(sent)} bytes {sent!r}"
    assert len(sent) > 32  # the login itself, in plaintext


def test_pymysql_with_ssl_mode_disabled_does_not_ask_for_tls(mitm_factory) -> None:
    """PyMySQL 1.2 tried TLS with ssl_mode=disabled as soon as the greeting offered it."""
    from outboxer.payload_admin import connect

    mitm, url = mitm_factory(ssl=True, forward=True)
    parts = urlsplit(url)
    root = urlunsplit(parts._replace(netloc=f"{parts.username}@{parts.hostname}:{parts.port}"))
    conn = connect(f"{root}?ssl_mode=disabled")
    try:
        with conn.cursor() as cursor:
            cursor.execute("SELECT 1")
            assert cursor.fetchone()[0] == 1
    finally:
        conn.close()
    _no_tls_asked(mitm.client_packet())


async def test_the_relay_store_with_ssl_mode_disabled_does_not_ask_for_tls(mitm_factory) -> None:
    mitm, url = mitm_factory(ssl=True, forward=True)
    parts = urlsplit(url)
    root = urlunsplit(parts._replace(netloc=f"{parts.username}@{parts.hostname}:{parts.port}"))
    async with create_store(f"{root}?ssl_mode=disabled") as store:
        await store.ping()
    _no_tls_asked(mitm.first[0])
