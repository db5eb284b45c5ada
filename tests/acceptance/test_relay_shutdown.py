"""``outboxer relay`` stops within ``shutdown_timeout`` even when its broker stalls: the
batches still publishing are cut short and their rows go back to the queue, none left
PROCESSING (once, SIGTERM waited for them without limit; an orchestrator's SIGKILL then
left them in flight until their lease expired, and charged them an attempt)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

import outboxer
from tests.acceptance.test_cli import OUTBOXER, statuses


@contextlib.contextmanager
def stalling_receiver() -> Iterator[tuple[str, threading.Event]]:
    """An HTTP endpoint that accepts connections and requests and never answers; the event
    is set once a request came in."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    port = server.getsockname()[1]
    requested = threading.Event()
    done = threading.Event()
    held: list[socket.socket] = []

    def serve() -> None:
        while not done.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            held.append(conn)  # kept open, never answered
            conn.settimeout(0.2)
            with contextlib.suppress(OSError):
                if conn.recv(65536):
                    requested.set()

    thread = threading.Thread(target=serve, name="stalling-receiver", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}/hook", requested
    finally:
        done.set()
        thread.join(5)
        for conn in held:
            conn.close()
        server.close()


def relay(pg_url: str, broker: str, log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            *OUTBOXER,
            "relay",
            "--db",
            pg_url,
            "--broker",
            broker,
            "--publish-timeout",
            "120",
            "--poll-interval",
            "0.1",
            "--concurrency",
            "2",
            "--batch-size",
            "5",
        ],
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
        env={**os.environ, **env},
    )


def attempts(pg_url: str) -> set[int]:
    with psycopg.connect(pg_url) as conn:
        return {row[0] for row in conn.execute("SELECT attempts FROM outboxer.outbox")}


def enqueue(pg_url: str, count: int) -> None:
    with psycopg.connect(pg_url) as conn:
        outboxer.enqueue_many(
            conn, [{"topic": "t", "payload": {"n": n}, "key": f"k{n}"} for n in range(count)]
        )


@pytest.mark.parametrize("how", ["deadline", "second signal"])
def test_a_relay_whose_broker_stalls_exits_within_its_shutdown_timeout(
    pg_url: str, tmp_path: Path, how: str
) -> None:
    enqueue(pg_url, 10)
    log = tmp_path / "relay.log"
    with stalling_receiver() as (broker, requested):
        process = relay(pg_url, broker, log, {"OUTBOXER_SHUTDOWN_TIMEOUT": "2"})
        try:
            assert requested.wait(30), log.read_text()
            assert statuses(pg_url).get("PROCESSING", 0) > 0
            started = time.monotonic()
            process.send_signal(signal.SIGTERM)
            if how == "second signal":
                time.sleep(0.3)
                process.send_signal(signal.SIGTERM)
            code = process.wait(15)
            took = time.monotonic() - started
        finally:
            if process.poll() is None:
                process.kill()
                process.wait(10)
    text = log.read_text()
    assert code == 0, text
    assert took < (1.5 if how == "second signal" else 5), (took, text)
    if how == "deadline":
        assert took >= 1.5, "the batches had their shutdown_timeout to finish"
    assert statuses(pg_url) == {"PENDING": 10}, text
    assert attempts(pg_url) == {0}, "cut short: no attempt counted"
