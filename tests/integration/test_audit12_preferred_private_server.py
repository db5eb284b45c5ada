"""``ssl_mode=preferred`` against a server with TLS on (the private MariaDB of
test_audit12_mytls_private_server): TLS is used, on aiomysql's pool (the relay) as on
PyMySQL (the consumer, the admin commands); and behind a proxy that strips CLIENT_SSL from
the greeting (the server still has TLS on), plaintext, as the MySQL client's PREFERRED: the
client must then not set CLIENT_SSL in its login either, or the server, which reads that
flag as "TLS follows", fails the handshake."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

from tests.integration import test_audit12_mytls_mitm as mitm_module
from tests.integration import test_audit12_mytls_private_server as private

tls_server = private.tls_server  # the module's fixture: a private MariaDB with TLS on


@pytest.fixture
def stripped(tls_server: tuple[str, Path]) -> Iterator[tuple[mitm_module.Mitm, str]]:
    """A proxy in front of the TLS server that removes CLIENT_SSL from its greeting."""
    url, _ = tls_server
    parts = urlsplit(url)
    mitm = mitm_module.Mitm(ssl=False, forward=True)
    mitm.start((parts.hostname or "127.0.0.1", parts.port or 3306))
    try:
        yield mitm, urlunsplit(parts._replace(netloc=f"root@127.0.0.1:{mitm.port}"))
    finally:
        mitm.stop()


def _asked_no_tls(mitm: mitm_module.Mitm) -> None:
    assert mitm.first, "the proxy saw no connection"
    (flags,) = struct.unpack_from("<I", mitm.first[0])
    assert not flags & mitm_module.CLIENT_SSL, "CLIENT_SSL set in a plaintext login"


async def test_the_relay_store_uses_tls_when_offered(tls_server: tuple[str, Path]) -> None:
    url, _ = tls_server
    assert (await private._store_tls_version(f"{url}?ssl_mode=preferred")).startswith("TLS")


def test_pymysql_uses_tls_when_offered(tls_server: tuple[str, Path]) -> None:
    url, _ = tls_server
    assert private._pymysql_tls_version(f"{url}?ssl_mode=PREFERRED").startswith("TLS")


async def test_the_relay_store_falls_back_to_plaintext_when_tls_is_not_offered(
    stripped: tuple[mitm_module.Mitm, str],
) -> None:
    mitm, url = stripped
    assert await private._store_tls_version(f"{url}?ssl_mode=preferred") == ""
    _asked_no_tls(mitm)


def test_pymysql_falls_back_to_plaintext_when_tls_is_not_offered(
    stripped: tuple[mitm_module.Mitm, str],
) -> None:
    mitm, url = stripped
    assert private._pymysql_tls_version(f"{url}?ssl_mode=preferred") == ""
    _asked_no_tls(mitm)


def test_a_reconnect_uses_tls_again_once_offered(tls_server: tuple[str, Path]) -> None:
    """PyMySQL reconnects the same Connection object (``connect()``, as
    ``ping(reconnect=True)`` does): a fallback to plaintext must not stick to it."""
    from outboxer.payload_admin import connect

    url, _ = tls_server
    parts = urlsplit(url)
    mitm = mitm_module.Mitm(ssl=False, forward=True)
    mitm.start((parts.hostname or "127.0.0.1", parts.port or 3306))
    try:
        proxied = urlunsplit(parts._replace(netloc=f"root@127.0.0.1:{mitm.port}"))
        conn = connect(f"{proxied}?ssl_mode=preferred")
    finally:
        mitm.stop()
    try:
        conn.close()
        conn.port = parts.port  # the server itself now, offering TLS
        conn.connect()
        with conn.cursor() as cursor:
            cursor.execute("SHOW SESSION STATUS LIKE 'Ssl_version'")
            assert str(cursor.fetchone()[1]).startswith("TLS")
    finally:
        conn.close()
