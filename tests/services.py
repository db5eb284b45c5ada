"""Where the real services live, and what a test does when one is missing.

Under ``CI=true`` a missing service fails the test; locally it skips with the reason.
Tests that stop a service start it again with the same command ``scripts/services.sh`` uses.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

HOST = "127.0.0.1"
PORTS = {
    "postgresql": 5432,
    "mariadb": 3306,
    "redis": 6379,
    "rabbitmq": 5672,
    "mosquitto": 1883,
    "nats": 4222,
}
START = {
    "postgresql": "pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql | head -n1) main start",
    "redis": 'redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no --dir /var/lib/redis --logfile /var/log/redis/ci.log',
    "rabbitmq": "rabbitmq-server -detached",
    "mosquitto": "mosquitto -d -c /etc/mosquitto/mosquitto.conf",
    "nats": "start-stop-daemon --start --oknodo --background --exec /usr/sbin/nats-server -- -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server -l /var/log/nats-server.log",
    "mariadb": "start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd",
}
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def free_port() -> int:
    """A loopback TCP port nobody listens on right now, chosen by the OS. (A port drawn at
    random can be the ephemeral port of some client's connection, and the server that then
    binds it exits at start: a flaky test.)"""
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return int(probe.getsockname()[1])


def port_open(port: int, host: str = HOST, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def require(name: str) -> None:
    """Fail (CI) or skip (locally) the calling test unless service ``name`` answers.

    Asked three times, a second each: on a loaded box a service's accept queue can be full
    for a moment (the kernel then drops the SYN and resends it a second later), and a lone
    half-second try failed a CI run's test on a RabbitMQ that was up all along."""
    for _ in range(3):
        if port_open(PORTS[name], timeout=1.0):
            return
    message = f"{name} is not reachable on {HOST}:{PORTS[name]} (run scripts/services.sh)"
    if IN_CI:
        pytest.fail(message)
    pytest.skip(message)


def start(name: str, timeout: float = 90.0) -> None:
    """Start a service this test stopped, and wait until its port answers."""
    subprocess.run(START[name], shell=True, check=False, capture_output=True)
    deadline = time.monotonic() + timeout
    while not port_open(PORTS[name]):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} did not come back on port {PORTS[name]}")
        time.sleep(0.2)


def stop(pid: int | None, port: int, timeout: float = 15.0) -> None:
    """Stop a service by pid (SIGTERM) and wait until its port is closed; tests start it again."""
    import os
    import signal

    if pid is None:
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while port_open(port) and time.monotonic() < deadline:
        time.sleep(0.05)


@contextlib.contextmanager
def private_mosquitto(config: str, files: dict[str, str] | None = None) -> Iterator[int]:
    """A Mosquitto of its own on a free port, running ``config`` (its lines after the
    listener; ``{folder}`` stands for the folder ``files`` are written to); yields the port.

    Not under pytest's tmp_path (mode 0700): mosquitto drops root for its own user."""
    require("mosquitto")
    folder = Path(tempfile.mkdtemp(prefix="outboxer-mosquitto-"))
    try:
        port = free_port()
        for name, text in (files or {}).items():
            (folder / name).write_text(text)
            (folder / name).chmod(0o644)
        (folder / "mosquitto.conf").write_text(
            f"listener {port} {HOST}\nallow_anonymous true\npersistence false\nlog_dest none\n"
            + config.format(folder=folder)
        )
        (folder / "mosquitto.conf").chmod(0o644)
        folder.chmod(0o755)
        broker = subprocess.Popen(
            ["mosquitto", "-c", str(folder / "mosquitto.conf")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 10
            while not port_open(port):
                assert time.monotonic() < deadline and broker.poll() is None, (
                    "mosquitto did not start"
                )
                time.sleep(0.05)
            yield port
        finally:
            broker.terminate()
            broker.wait(10)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
