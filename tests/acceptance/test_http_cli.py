"""The HTTP API of the real ``outboxer relay`` and ``outboxer serve`` commands, in subprocesses."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest

import outboxer
from tests.acceptance.test_cli import OUTBOXER, cli
from tests.services import free_port

TOKEN = "t0ken-for-the-acceptance-test"


def request(
    url: str, *, data: bytes | None = None, headers: dict[str, str] | None = None
) -> tuple[int, str]:
    """(status, body) of one request; an error status is an answer too, a refused connection is (0, reason)."""
    try:
        with urllib.request.urlopen(
            urllib.request.Request(url, data=data, headers=headers or {}), timeout=5
        ) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError as exc:
        return 0, str(exc)


def wait_until(check: Callable[[], bool], what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout}s")
        time.sleep(0.1)


def published_count(base: str) -> float:
    status, text = request(base + "/metrics")
    for line in text.splitlines() if status == 200 else []:
        if line.startswith(
            'outboxer_messages_published_total{database="default",destination="default"} '
        ):
            return float(line.split()[1])
    return -1


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_relay_serves_metrics_while_it_publishes_and_stops_on_sigterm(
    sqlite_url: str, tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    port, out, log = free_port(), tmp_path / "events.jsonl", tmp_path / "relay.log"
    base = f"http://127.0.0.1:{port}"
    with log.open("ab") as sink:
        relay = subprocess.Popen(
            [
                *OUTBOXER,
                "relay",
                "--db",
                sqlite_url,
                "--broker",
                f"file://{out}",
                "--http",
                f"127.0.0.1:{port}",
                "--poll-interval",
                "0.1",
            ],
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    processes.append(relay)
    wait_until(lambda: request(base + "/health")[0] == 200, "the relay answers /health with 200")
    assert published_count(base) == 0
    enqueued = cli(
        "enqueue", "--db", sqlite_url, "--topic", "order.placed", "--payload", '{"n": 1}'
    )
    assert enqueued.returncode == 0, enqueued.stderr
    wait_until(lambda: published_count(base) == 1, "outboxer_messages_published_total reaches 1")
    relay.send_signal(signal.SIGTERM)
    assert relay.wait(20) == 0, log.read_text()[-3000:]
    assert request(base + "/health")[0] == 0, "the API stopped with the relay"
    assert json.loads(out.read_text().splitlines()[0])["payload"] == {"n": 1}
    assert f"HTTP API listening on {base}" in log.read_text()


def test_serve_requeues_with_the_token_from_the_environment(
    pg_url: str, tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    with psycopg.connect(pg_url) as conn:
        message = outboxer.enqueue(conn, "t", {"n": 1})
        conn.execute("UPDATE outboxer.outbox SET status = 'ABANDONED', attempts = 10")
    port, log = free_port(), tmp_path / "serve.log"
    base = f"http://127.0.0.1:{port}"
    with log.open("ab") as sink:
        serve = subprocess.Popen(
            [*OUTBOXER, "serve", "--db", pg_url, "--http", f"127.0.0.1:{port}"],
            env={**os.environ, "OUTBOXER_HTTP_TOKEN": TOKEN},
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    processes.append(serve)
    wait_until(lambda: request(base + "/health")[0] == 200, "serve answers /health with 200")
    status, text = request(base + "/messages")
    assert status == 200 and [m["id"] for m in json.loads(text)["messages"]] == [str(message.id)]
    body, json_type = b'{"statuses": ["ABANDONED"]}', {"Content-Type": "application/json"}
    assert request(base + "/messages/requeue", data=body, headers=json_type)[0] == 401
    status, text = request(
        base + "/messages/requeue",
        data=body,
        headers={**json_type, "Authorization": f"Bearer {TOKEN}"},
    )
    assert (status, json.loads(text)) == (200, {"requeued": 1})
    status, text = request(base + "/status")
    assert json.loads(text)["destinations"][0]["counts"] == {"PENDING": 1}
    status, text = request(base + "/metrics")
    assert 'outboxer_messages{database="default",destination="default",status="PENDING"} 1' in text
    assert "outboxer_messages_published_total" not in text, "serve has no relay counters"
    serve.send_signal(signal.SIGTERM)
    assert serve.wait(20) == 0, log.read_text()[-3000:]
    assert TOKEN not in log.read_text(), "the token is never logged"


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (
            ["relay", "--db", "sqlite:///x.db", "--broker", "memory://", "--http", "8080"],
            {},
            "--http must be HOST:PORT",
        ),
        (
            ["relay", "--db", "sqlite:///x.db", "--broker", "memory://", "--http", "0.0.0.0:0"],
            {},
            "set --http-token to expose requeue on a non-loopback address",
        ),
        (
            ["serve", "--db", "sqlite:///x.db"],
            {"OUTBOXER_HTTP": "localhost"},
            "OUTBOXER_HTTP must be HOST:PORT",
        ),
        (["serve", "--db", "sqlite:///x.db"], {}, "no HTTP address"),
        (
            ["serve", "--db", "sqlite:///x.db"],
            {"OUTBOXER_HTTP": ""},
            "OUTBOXER_HTTP is set but empty",
        ),
        (
            ["serve", "--db", "sqlite:///x.db", "--http", "127.0.0.1:99999"],
            {},
            "--http must be HOST:PORT",
        ),
    ],
)
def test_bad_http_settings_are_a_clear_error(
    args: list[str], env: dict[str, str], message: str
) -> None:
    result = cli(*args, env=env)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr


def test_a_port_in_use_is_a_clear_error(sqlite_url: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = cli("serve", "--db", sqlite_url, "--http", f"127.0.0.1:{port}")
    assert result.returncode == 2
    assert (
        f"cannot listen on 127.0.0.1:{port}" in result.stderr and "Traceback" not in result.stderr
    )


def test_without_the_http_extra_serve_says_what_to_install(sqlite_url: str) -> None:
    blocker = (
        "import sys\n"
        "class Blocker:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.partition('.')[0] in ('starlette', 'uvicorn'):\n"
        "            raise ImportError(name)\n"
        "sys.meta_path.insert(0, Blocker())\n"
        "from outboxer.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", blocker, "serve", "--db", sqlite_url, "--http", "127.0.0.1:0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert "pip install 'outboxer[http]'" in result.stderr and "Traceback" not in result.stderr
