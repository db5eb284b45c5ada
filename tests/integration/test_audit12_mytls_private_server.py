"""TLS on MySQL connections against a real server with TLS on: a private MariaDB (the shared
one has TLS off) on a free port, its certificate issued by a CA made here for 127.0.0.1.

The positive path of the refusals (a server offering TLS is not refused, the connection is
encrypted, for aiomysql's pool as for PyMySQL), and ``ssl_mode=disabled``: no TLS even
though the server offers it (PyMySQL 1.2 used TLS there, its PREFERRED default)."""

from __future__ import annotations

import datetime
import ipaddress
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from outboxer.stores import create_store
from outboxer.stores.mysql import MySQLStore
from tests.services import free_port, port_open

MARIADBD = "/usr/sbin/mariadbd"
INSTALL_DB = shutil.which("mariadb-install-db") or "/usr/bin/mariadb-install-db"


def _certificates(where: Path) -> tuple[Path, Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def name(common: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])

    def pem_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
        path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.TraditionalOpenSSL,
                serialization.NoEncryption(),
            )
        )

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(name("audit12 test CA"))
        .issuer_name(name("audit12 test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(name("127.0.0.1"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    paths = where / "ca.pem", where / "server.pem", where / "server-key.pem"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pem_key(key, paths[2])
    return paths


@pytest.fixture(scope="module")
def tls_server() -> Iterator[tuple[str, Path]]:
    """``mysql://root@127.0.0.1:<port>/mysql`` of a private MariaDB with TLS on, and its CA."""
    if not (os.path.exists(MARIADBD) and os.path.exists(INSTALL_DB)):
        pytest.skip("mariadbd / mariadb-install-db not installed")
    home = Path(tempfile.mkdtemp(prefix="outboxer-audit12-mytls-"))
    server: subprocess.Popen[bytes] | None = None
    log = open(home / "err.log", "wb")  # noqa: SIM115 - the server's stderr, closed below
    try:
        ca, cert, key = _certificates(home)
        data = home / "data"
        user = ["--user=root"] if os.geteuid() == 0 else []
        subprocess.run(
            [INSTALL_DB, "--no-defaults", *user, f"--datadir={data}", "--skip-test-db"],
            check=True,
            capture_output=True,
            timeout=60,
        )
        port = free_port()
        server = subprocess.Popen(
            [
                MARIADBD,
                "--no-defaults",
                *user,
                f"--datadir={data}",
                f"--port={port}",
                "--bind-address=127.0.0.1",
                f"--socket={home / 'sock'}",
                f"--pid-file={home / 'pid'}",
                "--skip-grant-tables",  # any login: the test is about the transport
                "--skip-log-bin",
                "--innodb-buffer-pool-size=16M",
                f"--ssl-ca={ca}",
                f"--ssl-cert={cert}",
                f"--ssl-key={key}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
        deadline = time.monotonic() + 60
        while not port_open(port):
            if server.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"private MariaDB did not start: {(home / 'err.log').read_text()}")
            time.sleep(0.05)
        yield f"mysql://root@127.0.0.1:{port}/mysql", ca
    finally:
        if server is not None:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
        log.close()
        shutil.rmtree(home, ignore_errors=True)


def _pymysql_tls_version(url: str) -> str:
    from outboxer.payload_admin import connect

    conn = connect(url)
    try:
        with conn.cursor() as cursor:
            cursor.execute("SHOW SESSION STATUS LIKE 'Ssl_version'")
            return str(cursor.fetchone()[1])
    finally:
        conn.close()


async def _store_tls_version(url: str) -> str:
    async with create_store(url) as store:
        assert isinstance(store, MySQLStore)
        async with store._transaction() as cursor:
            await cursor.execute("SHOW SESSION STATUS LIKE 'Ssl_version'")
            return str((await cursor.fetchone())["Value"])


@pytest.mark.parametrize("mode", ["required", "verify_ca", "verify_identity"])
async def test_the_relay_store_connects_over_tls(tls_server: tuple[str, Path], mode: str) -> None:
    url, ca = tls_server
    query = f"ssl_mode={mode}" + (f"&ssl_ca={ca}" if mode != "required" else "")
    assert (await _store_tls_version(f"{url}?{query}")).startswith("TLS")


@pytest.mark.parametrize("mode", ["required", "verify_ca", "verify_identity"])
def test_pymysql_connects_over_tls(tls_server: tuple[str, Path], mode: str) -> None:
    url, ca = tls_server
    query = f"ssl_mode={mode}" + (f"&ssl_ca={ca}" if mode != "required" else "")
    assert _pymysql_tls_version(f"{url}?{query}").startswith("TLS")


def test_pymysql_with_ssl_mode_disabled_stays_unencrypted(tls_server: tuple[str, Path]) -> None:
    url, _ = tls_server
    assert _pymysql_tls_version(f"{url}?ssl_mode=DISABLED") == ""


async def test_the_relay_store_with_ssl_mode_disabled_stays_unencrypted(
    tls_server: tuple[str, Path],
) -> None:
    url, _ = tls_server
    assert await _store_tls_version(f"{url}?ssl_mode=disabled") == ""
