"""An S3-compatible server for tests: moto's server mode, a subprocess on 127.0.0.1.

Import the fixtures into a test module (``from tests.s3 import s3_server, s3_store``). The
server is started once per pytest process on a free port and stopped (by its pid) at the end;
each test gets a fresh bucket.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from outboxer.claimcheck import S3ObjectStore
from tests.services import free_port as _free_port

HOST = "127.0.0.1"
CREDENTIALS = {"access_key_id": "testing", "secret_access_key": "testing-secret"}
REGION = "us-east-1"


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """The endpoint URL of a moto S3 server started for this pytest process."""
    moto_server = Path(sys.executable).with_name("moto_server")
    if not moto_server.exists():
        pytest.fail("moto_server is missing: install the dev group (moto[server])")
    port = _free_port()
    process = subprocess.Popen(
        [str(moto_server), "-H", HOST, "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "MOTO_ALLOW_NONEXISTENT_REGION": "true"},
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            with socket.create_connection((HOST, port), timeout=0.5):
                break
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                pytest.fail(f"moto_server did not start on {HOST}:{port}")
            time.sleep(0.1)
    try:
        yield f"http://{HOST}:{port}"
    finally:
        os.kill(process.pid, signal.SIGTERM)
        process.wait(timeout=10)


def s3_url(endpoint: str, bucket: str, prefix: str = "claims") -> str:
    return (
        f"s3://{bucket}/{prefix}?endpoint_url={endpoint}&region={REGION}"
        f"&access_key_id={CREDENTIALS['access_key_id']}"
        f"&secret_access_key={CREDENTIALS['secret_access_key']}"
    )


@pytest.fixture(scope="session")
def s3_client(s3_server: str) -> Iterator[Any]:
    """One boto3 client for the test server (a client takes a second to make on this box)."""
    store = S3ObjectStore("any", endpoint_url=s3_server, region=REGION, **CREDENTIALS)
    yield store.client
    store.close()


@pytest.fixture
def s3_bucket(s3_client: Any) -> str:
    """A fresh, empty bucket on the test server."""
    bucket = f"outboxer-{uuid.uuid4().hex[:12]}"
    s3_client.create_bucket(Bucket=bucket)
    return bucket


@contextmanager
def silent_listener() -> Iterator[str]:
    """``host:port`` of a listener that accepts connections and never answers (an object
    store that hangs), closed with every connection it accepted at the end."""
    listener = socket.socket()
    listener.bind((HOST, 0))
    listener.listen(64)
    accepted: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:  # closed at the end
                return
            accepted.append(connection)

    threading.Thread(target=accept, daemon=True).start()
    host, port = listener.getsockname()
    try:
        yield f"{host}:{port}"
    finally:
        listener.close()
        for connection in accepted:
            connection.close()
