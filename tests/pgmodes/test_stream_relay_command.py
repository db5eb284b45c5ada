"""``outboxer stream-relay`` as a real process: log mode on the shared PostgreSQL, Redis as
the broker. A message Redis refuses for good is dead-lettered, the rest arrive in key
order; /health and /metrics answer; ``status``, ``dead-letters list``, ``replay`` and
``purge`` see and mend what happened. (The relay, ``status --json`` and ``replay`` run as
processes; the other commands in this process, to keep the test short.)"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest

from outboxer.cli import main
from outboxer.enqueue import Outbox
from tests.services import free_port as _free_port
from tests.services import require

OUTBOXER = [sys.executable, "-m", "outboxer.cli"]


def _outboxer(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*OUTBOXER, *args], capture_output=True, text=True, timeout=60, check=False
    )


def _here(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``outboxer ARGS`` in this process: exit status, stdout, stderr."""
    try:
        code = main(list(args))
    except SystemExit as exit_:  # argparse's own refusals
        code = int(exit_.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def _until(done: Callable[[], bool], timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()
    except OSError:
        return 0, ""


@pytest.fixture
def redis_prefix() -> Iterator[tuple[object, str]]:
    require("redis")
    import redis

    client = redis.Redis(host="127.0.0.1", port=6379)
    prefix = f"outboxer-stream-test-{uuid.uuid4().hex[:8]}:"
    yield client, prefix
    for key in client.scan_iter(f"{prefix}*"):
        client.delete(key)
    client.close()


def test_stream_relay_command_end_to_end(
    pg_url: str,
    redis_prefix: tuple[object, str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import redis

    client, prefix = redis_prefix
    assert isinstance(client, redis.Redis)
    broker = f"redis://127.0.0.1:6379/0?stream_prefix={prefix}"
    stream = ["--mode", "log", "--db", pg_url]
    client.set(f"{prefix}refused", "a string, not a stream: XADD answers WRONGTYPE")
    port = _free_port()
    log = tmp_path / "relay.log"
    with log.open("w") as err:
        relay = subprocess.Popen(
            [
                *OUTBOXER,
                "stream-relay",
                *stream,
                "--broker",
                broker,
                "--apply-schema",
                "--http",
                f"127.0.0.1:{port}",
                "--probe-interval",
                "100ms",
                "--batch-size",
                "3",
            ],
            stderr=err,
        )
    try:

        def applied() -> bool:
            with psycopg.connect(pg_url, autocommit=True) as conn:
                found = conn.execute("SELECT to_regclass('outboxer.outbox_log_offsets')")
                return (found.fetchone() or (None,))[0] is not None

        assert _until(applied), log.read_text()
        with psycopg.connect(pg_url) as conn:
            for n in range(9):
                topic = "refused" if n == 4 else "orders"
                Outbox(mode="log").enqueue(conn, topic, {"n": n}, key=f"k{n % 3}")
        assert _until(lambda: client.xlen(f"{prefix}orders") >= 8), log.read_text()
        entries = client.xrange(f"{prefix}orders")
        arrived = [(f[b"key"].decode(), json.loads(f[b"payload"])["n"]) for _, f in entries]
        assert sorted(n for _, n in arrived) == [0, 1, 2, 3, 5, 6, 7, 8]
        for key in ("k0", "k1", "k2"):
            mine = [n for k, n in arrived if k == key]
            assert mine == sorted(mine), arrived

        base = f"http://127.0.0.1:{port}"
        labels = 'destination="default",mode="log"'

        def scraped() -> bool:
            status, text = _get(f"{base}/metrics")
            return (
                status == 200
                and f"outboxer_stream_dead_letters_total{{{labels}}} 1.0" in text
                and f"outboxer_stream_entries_behind{{{labels}}} 0.0" in text
            )

        assert _until(scraped), _get(f"{base}/metrics")[1][-3000:]
        _, text = _get(f"{base}/metrics")
        assert f"outboxer_stream_messages_published_total{{{labels}}} 8.0" in text
        assert f"outboxer_stream_messages_failed_total{{{labels}}} 1.0" in text
        health, body = _get(f"{base}/health")
        assert (health, json.loads(body)["status"]) == (200, "ok")
        status_code, body = _get(f"{base}/status")
        assert status_code == 200 and json.loads(body)["dead_letters"] == 1
    finally:
        relay.send_signal(signal.SIGTERM)
        assert relay.wait(15) == 0, log.read_text()
    assert "Traceback" not in log.read_text()

    shown = _outboxer("stream-relay", "status", *stream, "--json")
    assert shown.returncode == 0, shown.stderr
    [report] = json.loads(shown.stdout)["streams"]
    assert report["destination"] == "default"
    assert (report["entries_behind"], report["dead_letters"], report["failing"]) == (0, 1, 0)
    code, out, _ = _here(capsys, "stream-relay", "status", *stream)
    assert code == 0 and "log reader default:" in out and "dead letters        1" in out

    code, out, err = _here(capsys, "stream-relay", "dead-letters", "list", *stream, "--json")
    assert code == 0, err
    [letter] = json.loads(out)
    assert (letter["topic"], letter["key"], letter["attempts"], letter["held"]) == (
        "refused",
        "k1",
        1,
        False,
    )
    assert "WRONGTYPE" in letter["error"]

    client.delete(f"{prefix}refused")  # the operator mends the broker, then replays
    replayed = _outboxer("stream-relay", "dead-letters", "replay", *stream, "--broker", broker)
    assert replayed.returncode == 0, replayed.stderr
    assert replayed.stdout.strip() == "replayed 1, failed 0, skipped 0"
    [(_, fields)] = client.xrange(f"{prefix}refused")
    assert fields[b"id"].decode() == letter["message_id"]
    code, out, _ = _here(capsys, "stream-relay", "dead-letters", "list", *stream)
    assert (code, out.strip()) == (0, "no dead letters")

    code, _, err = _here(capsys, "stream-relay", "dead-letters", "purge", *stream)
    assert code == 2 and "--id" in err
    code, out, _ = _here(capsys, "stream-relay", "dead-letters", "purge", *stream, "--all")
    assert (code, out.strip()) == (0, "purged 0 dead letter(s)")


@pytest.mark.parametrize(
    "args",
    [
        ["stream-relay", "--db", "postgresql://x/db", "--broker", "memory://a"],  # no --mode
        ["stream-relay", "status", "--mode", "log"],  # no --db
        ["stream-relay", "--mode", "log", "--db", "postgresql://x/db"],  # no broker
        ["stream-relay", "dead-letters", "list", "--mode", "log", "--db", "sqlite:///x.db"],
        [
            "stream-relay",
            "dead-letters",
            "purge",
            "--mode",
            "wal",
            "--db",
            "postgresql://x/d",
            "--id",
            "nope",
        ],
        ["stream-relay", "--mode", "wal", "--retention-days", "2", "--db", "postgresql://x/db"],
    ],
)
def test_stream_relay_command_refuses_bad_input_with_one_line(
    args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = _here(capsys, *args)
    assert code == 2, err
    assert "Traceback" not in err
    assert err.strip().count("\n") == 0, err
