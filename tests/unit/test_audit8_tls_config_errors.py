"""TLS files in database and broker URLs that cannot be loaded are a ConfigError when the URL
is read, naming the option, never the password: asyncpg, redis-py and aiormq read them at
each connect, where a bad one was an outage retried for ever (asyncpg's and redis-py's
errors named neither the file nor the option)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from outboxer.brokers import create_publisher
from outboxer.errors import ConfigError
from outboxer.stores import create_store

PASSWORD = "hunter2-not-shown"


@pytest.fixture(scope="module")
def pem(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A self-signed certificate (``cert.pem``), its key, and the key encrypted."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    d = tmp_path_factory.mktemp("pem")
    run = ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"]
    subprocess.run([*run, "-nodes", "-keyout", f"{d}/key.pem", "-out", f"{d}/cert.pem",
                    "-days", "2", "-subj", "/CN=t"], check=True, capture_output=True)  # fmt: skip
    subprocess.run(["openssl", "pkey", "-in", f"{d}/key.pem", "-aes256", "-passout",
                    f"pass:{PASSWORD}", "-out", f"{d}/encrypted.pem"],
                   check=True, capture_output=True)  # fmt: skip
    return d


def refused(url: str, expected: str) -> str:
    with pytest.raises(ConfigError, match=expected) as caught:
        if url.startswith("postgresql"):
            create_store(url)
        else:
            create_publisher(url)
    message = str(caught.value)
    assert PASSWORD not in message and "PRIVATE KEY" not in message
    return message


@pytest.mark.parametrize("option", ["sslrootcert", "sslcert", "sslkey", "sslcrl"])
def test_postgres_names_the_file_option(option: str, tmp_path: Path) -> None:
    url = f"postgresql://app:{PASSWORD}@db.example/orders?sslmode=verify-full&{option}="
    refused(url + "/nonexistent/file.pem", f"PostgreSQL URL option {option}: cannot read")
    refused(url + str(tmp_path), f"option {option}: cannot read .*Is a directory")


def test_postgres_takes_readable_files_and_the_system_store(pem: Path) -> None:
    base = f"postgresql://app:{PASSWORD}@db.example/orders?sslmode=verify-full"
    create_store(f"{base}&sslrootcert=system")
    create_store(f"{base}&sslrootcert={pem}/cert.pem&sslcert={pem}/cert.pem&sslkey={pem}/key.pem")


def test_redis_names_the_file_option(pem: Path) -> None:
    base = f"rediss://:{PASSWORD}@cache.example:6380/0"
    refused(f"{base}?ssl_ca_certs=/nonexistent/ca.pem", "redis option ssl_ca_certs: cannot load")
    refused(f"{base}?ssl_certfile={pem}/key.pem", "redis option ssl_certfile/ssl_keyfile")
    refused(f"{base}?ssl_keyfile={pem}/key.pem", "ssl_keyfile needs ssl_certfile")
    refused(
        f"redis://cache.example?ssl_ca_certs={pem}/cert.pem",
        "redis option ssl_ca_certs: TLS needs a rediss:// URL",
    )
    create_publisher(f"{base}?ssl_ca_certs={pem}/cert.pem")


def test_redis_opens_an_encrypted_key_with_its_ssl_password(pem: Path) -> None:
    files = f"ssl_certfile={pem}/cert.pem&ssl_keyfile={pem}/encrypted.pem"
    create_publisher(f"rediss://cache.example?{files}&ssl_password={PASSWORD}")
    message = refused(f"rediss://cache.example?{files}", "an encrypted key is not supported")
    assert "encrypted.pem" in message


def test_rabbitmq_names_the_file_option(pem: Path) -> None:
    base = f"amqps://app:{PASSWORD}@mq.example/"
    refused(f"{base}?cafile=/nonexistent/ca.pem", "rabbitmq option cafile: cannot load")
    refused(f"{base}?cafile={pem}/key.pem", "rabbitmq option cafile: cannot load")
    refused(
        f"amqp://app:{PASSWORD}@mq.example/?cafile={pem}/cert.pem",
        "rabbitmq option cafile: TLS needs an amqps:// URL",
    )
    create_publisher(f"{base}?cafile={pem}/cert.pem&certfile={pem}/cert.pem&keyfile={pem}/key.pem")


def test_nats_names_a_creds_file_it_cannot_read(tmp_path: Path) -> None:
    refused(
        f"nats://app:{PASSWORD}@nats.example:4222?creds=/nonexistent/app.creds",
        "nats option creds: cannot read '/nonexistent/app.creds': No such file or directory",
    )
    (tmp_path / "app.creds").write_text("-----BEGIN NATS USER JWT-----\n")
    create_publisher(f"nats://nats.example:4222?creds={tmp_path}/app.creds")
