"""``cafile``/``certfile``/``keyfile`` for ``mqtts://`` and NATS ``tls=true``: a broker whose
certificate a private CA signed could not be used (the options were ignored, so only the
system's CAs were trusted and every connect failed as an outage). Against a private
Mosquitto and nats-server with TLS listeners and a CA made here with openssl."""

from __future__ import annotations

import getpass
import http.server
import shutil
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from outboxer.brokers import create_publisher
from outboxer.brokers.mqtt import MqttPublisher
from outboxer.brokers.nats import NatsPublisher
from outboxer.errors import BrokerUnavailableError, ConfigError
from outboxer.testing import make_message
from tests.services import free_port


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA, a server certificate it signed for 127.0.0.1, and a client certificate."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    d = tmp_path_factory.mktemp("pki")
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    openssl("req", "-x509", *ec, "-keyout", f"{d}/ca.key", "-out", f"{d}/ca.pem",
            "-days", "2", "-subj", "/CN=outboxer test CA")  # fmt: skip
    for name in ("server", "client"):
        openssl("req", *ec, "-keyout", f"{d}/{name}.key", "-out", f"{d}/{name}.csr",
                "-subj", f"/CN={name}")  # fmt: skip
        (d / f"{name}.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        openssl("x509", "-req", "-in", f"{d}/{name}.csr", "-CA", f"{d}/ca.pem",
                "-CAkey", f"{d}/ca.key", "-CAcreateserial", "-days", "2",
                "-extfile", f"{d}/{name}.ext", "-out", f"{d}/{name}.pem")  # fmt: skip
    (d / "other.pem").write_text((d / "server.pem").read_text())  # a CA that signed nothing
    return d


def serve(command: list[str], port: int) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{command[0]} exited: {process.stderr and process.stderr.read()!r}")
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return process
        time.sleep(0.02)
    process.kill()
    raise RuntimeError(f"{command[0]} did not listen on {port}")


def stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(5)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@pytest.fixture(scope="module")
def mosquitto(pki: Path) -> Iterator[int]:
    if shutil.which("mosquitto") is None:
        pytest.skip("mosquitto is not installed")
    port = free_port()
    conf = pki / "mosquitto.conf"
    conf.write_text(
        # As the user running the tests: as root, Mosquitto would switch to its own user,
        # who cannot read the temporary directory.
        f"user {getpass.getuser()}\nlistener {port} 127.0.0.1\nallow_anonymous true\n"
        f"cafile {pki}/ca.pem\ncertfile {pki}/server.pem\nkeyfile {pki}/server.key\n"
    )
    process = serve(["mosquitto", "-c", str(conf)], port)
    yield port
    stop(process)


@pytest.fixture(scope="module")
def nats_tls(pki: Path) -> Iterator[int]:
    if shutil.which("nats-server") is None:
        pytest.skip("nats-server is not installed")
    port = free_port()
    command = ["nats-server", "-a", "127.0.0.1", "-p", str(port), "--tls",
               "--tlscert", f"{pki}/server.pem", "--tlskey", f"{pki}/server.key"]  # fmt: skip
    process = serve(command, port)
    yield port
    stop(process)


async def test_mqtts_trusts_the_cafile_and_publishes(mosquitto: int, pki: Path) -> None:
    url = f"mqtts://127.0.0.1:{mosquitto}?cafile={pki}/ca.pem"
    async with create_publisher(url, publish_timeout=5) as publisher:
        [outcome] = await publisher.publish_batch([make_message("t", {"n": 1})])
        assert outcome.published, outcome


async def test_mqtts_takes_a_client_certificate(mosquitto: int, pki: Path) -> None:
    publisher = MqttPublisher(
        f"mqtts://127.0.0.1:{mosquitto}",
        cafile=str(pki / "ca.pem"),
        certfile=str(pki / "client.pem"),
        keyfile=str(pki / "client.key"),
        publish_timeout=5,
    )
    async with publisher:
        assert publisher.connected


@pytest.mark.parametrize("cafile", [None, "other.pem"], ids=["system CAs", "another CA"])
async def test_mqtts_still_verifies_the_broker(mosquitto: int, pki: Path, cafile: str) -> None:
    url = f"mqtts://127.0.0.1:{mosquitto}" + (f"?cafile={pki / cafile}" if cafile else "")
    with pytest.raises(BrokerUnavailableError, match="CERTIFICATE_VERIFY_FAILED"):
        await create_publisher(url, publish_timeout=5).connect()


async def test_nats_tls_trusts_the_cafile(nats_tls: int, pki: Path) -> None:
    url = f"nats://127.0.0.1:{nats_tls}?tls=true&cafile={pki}/ca.pem"
    async with NatsPublisher(url, publish_timeout=5) as publisher:
        assert publisher.connected


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("cafile=/nonexistent/ca.pem", "mqtt option cafile: cannot load '/nonexistent/ca.pem'"),
        ("cafile={pki}/ca.key", "mqtt option cafile: cannot load"),
        ("certfile={pki}/ca.pem", "mqtt option certfile/keyfile: cannot load"),
        ("keyfile={pki}/client.key", "keyfile needs certfile"),
    ],
    ids=["missing", "not a certificate", "no key", "key without certificate"],
)
def test_a_bad_tls_file_is_a_config_error_naming_the_option(
    pki: Path, query: str, expected: str
) -> None:
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(")) as caught:
        create_publisher(f"mqtts://user:s3cret@127.0.0.1:8883?{query.format(pki=pki)}")
    assert "s3cret" not in str(caught.value)
    assert "PRIVATE KEY" not in str(caught.value)


def test_an_encrypted_key_is_refused_without_a_prompt(pki: Path, tmp_path: Path) -> None:
    openssl("pkey", "-in", f"{pki}/client.key", "-aes256", "-passout", "pass:pw",
            "-out", f"{tmp_path}/encrypted.key")  # fmt: skip
    query = f"certfile={pki}/client.pem&keyfile={tmp_path}/encrypted.key"
    with pytest.raises(ConfigError, match="an encrypted key is not supported"):
        create_publisher(f"nats://127.0.0.1:4222?tls=true&{query}")


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("mqtt://127.0.0.1:1883?cafile={pki}/ca.pem", "TLS needs an mqtts:// URL"),
        ("nats://127.0.0.1:4222?cafile={pki}/ca.pem", "nats option cafile needs tls=true"),
    ],
)
def test_a_tls_file_without_tls_is_a_config_error(pki: Path, url: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        create_publisher(url.format(pki=pki))


@pytest.mark.parametrize("path", ["/nonexistent/ca.pem", "{pki}/ca.key"])
def test_a_webhook_ca_bundle_that_cannot_be_loaded_is_a_config_error(pki: Path, path: str) -> None:
    path = path.format(pki=pki)
    with pytest.raises(ConfigError, match=f"webhook option verify: cannot load .*{path}"):
        create_publisher("https://hooks.example/in", verify=path)


@pytest.fixture
def https_receiver(pki: Path) -> Iterator[int]:
    """An HTTPS endpoint with the private CA's certificate, answering 204."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(pki / "server.pem", pki / "server.key")
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()
    thread.join()


async def test_a_webhook_trusts_its_ca_bundle(https_receiver: int, pki: Path) -> None:
    url = f"https://127.0.0.1:{https_receiver}/in"
    async with create_publisher(url, verify=str(pki / "ca.pem"), publish_timeout=5) as publisher:
        [outcome] = await publisher.publish_batch([make_message("t", {"n": 1})])
        assert outcome.published, outcome
