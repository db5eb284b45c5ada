"""The real ``outboxer relay`` serving two databases named in a TOML file (PostgreSQL and
SQLite) to the real Redis, with its HTTP API; ``schema apply``, ``enqueue`` and ``status``
on the same file."""

from __future__ import annotations

import contextlib
import json
import signal
import sqlite3
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import redis

import outboxer
from tests.acceptance.test_cli import OUTBOXER, cli
from tests.acceptance.test_http_cli import free_port, request, wait_until
from tests.services import require

REDIS = "redis://127.0.0.1:6379/0"


@pytest.fixture
def stream_prefix() -> Iterator[str]:
    require("redis")
    prefix = f"outboxer-test:{uuid.uuid4().hex[:8]}:"
    yield prefix
    client = redis.Redis.from_url(REDIS)
    try:
        keys = list(client.scan_iter(match=f"{prefix}*"))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


def published(base: str, database: str) -> float:
    status, text = request(base + "/metrics")
    wanted = f'outboxer_messages_published_total{{database="{database}",destination="default"}} '
    for line in text.splitlines() if status == 200 else []:
        if line.startswith(wanted):
            return float(line.split()[1])
    return -1


def test_one_relay_process_serves_the_databases_of_its_file(
    pg_url: str, tmp_path: Path, stream_prefix: str
) -> None:
    lite = f"sqlite:///{tmp_path / 'lite.db'}"  # no schema yet: schema apply makes it
    config = tmp_path / "outboxer.toml"
    config.write_text(
        f'broker = "{REDIS}?stream_prefix={stream_prefix}"\n'
        "poll_interval = 0.1\n"
        "concurrency = 2\n"
        f'[databases.pg]\nurl = "{pg_url}"\n'
        f'[databases.lite]\nurl = "{lite}"\nbatch_size = 3\n'
    )
    applied = cli("schema", "apply", "--config", str(config))
    assert applied.returncode == 0, applied.stderr
    assert "database pg: schema is up to date" in applied.stdout
    assert "database lite: applied: " in applied.stdout

    sent = cli(
        "enqueue", "--config", str(config), "--database", "lite",
        "--topic", "t", "--key", "k", "--payload", json.dumps({"db": "lite", "n": 0}),
    )  # fmt: skip
    assert sent.returncode == 0, sent.stderr
    with contextlib.closing(sqlite3.connect(tmp_path / "lite.db")) as conn:
        for n in range(1, 4):
            outboxer.enqueue(conn, "t", {"db": "lite", "n": n}, key="k")
        conn.commit()
    with psycopg.connect(pg_url) as conn:
        for n in range(5):
            outboxer.enqueue(conn, "t", {"db": "pg", "n": n}, key="k")

    port, log = free_port(), tmp_path / "relay.log"
    base = f"http://127.0.0.1:{port}"
    with log.open("ab") as sink:
        relay = subprocess.Popen(
            [*OUTBOXER, "relay", "--config", str(config), "--http", f"127.0.0.1:{port}"],
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_until(
            lambda: published(base, "pg") == 5 and published(base, "lite") == 4,
            "both databases published, each counted under its name",
        )
        status, text = request(base + "/health")
        health = json.loads(text)
        assert status == 200, text
        assert health["databases"] == {
            "pg": {"database": "ok", "relay": "ok"},
            "lite": {"database": "ok", "relay": "ok"},
        }
        report = cli("status", "--config", str(config))
        assert report.returncode == 0, report.stderr
        assert "database pg:\n  destination default:\n    PENDING" in report.stdout
        assert "database lite:\n  destination default:\n    PENDING" in report.stdout
        relay.send_signal(signal.SIGTERM)
        assert relay.wait(20) == 0, log.read_text()[-3000:]
    finally:
        if relay.poll() is None:
            relay.kill()
            relay.wait()
    text = log.read_text()
    assert "database pg: relay " in text and "database lite: relay " in text
    assert "databases pg, lite, 1 publisher(s) shared" in text
    entries = redis.Redis.from_url(REDIS).xrange(stream_prefix + "t")
    by_database: dict[str, list[int]] = {}
    for _, fields in entries:
        payload = json.loads(fields[b"payload"])
        by_database.setdefault(payload["db"], []).append(payload["n"])
    assert by_database == {"lite": [0, 1, 2, 3], "pg": [0, 1, 2, 3, 4]}


def test_status_answers_for_each_database_and_one_down_fails_the_command(
    sqlite_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from outboxer.cli import main
    from tests.integration.test_http_api import closed_port

    down = f"postgresql://postgres@127.0.0.1:{closed_port()}/nowhere"
    config = tmp_path / "outboxer.toml"
    config.write_text(f'[databases.lite]\nurl = "{sqlite_url}"\n[databases.down]\nurl = "{down}"\n')
    assert main(["status", "--config", str(config), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)["databases"]
    assert report["lite"] == {"destinations": [], "oldest_transaction_age_seconds": None}
    assert "cannot connect to PostgreSQL" in report["down"]["error"]
    assert main(["status", "--config", str(config), "--database", "lite"]) == 0
    assert capsys.readouterr().out == "the outbox is empty\n", "one database: the old output"
    assert main(["enqueue", "--config", str(config), "--topic", "t", "--payload", "{}"]) == 2
    assert "choose one with --database NAME" in capsys.readouterr().err


def test_the_environment_names_the_databases_of_a_relay(tmp_path: Path, stream_prefix: str) -> None:
    """OUTBOXER_DB holds NAME=URL entries separated by spaces, as a repeated --db: a
    container configured by its environment alone serves several databases."""
    urls = {name: f"sqlite:///{tmp_path / name}.db" for name in ("north", "south")}
    env = {
        "OUTBOXER_DB": " ".join(f"{name}={url}" for name, url in urls.items()),
        "OUTBOXER_BROKER": f"{REDIS}?stream_prefix={stream_prefix}",
    }
    applied = cli("schema", "apply", env=env)
    assert applied.returncode == 0, applied.stderr
    assert "database north: applied: " in applied.stdout
    assert "database south: applied: " in applied.stdout
    for name in urls:
        with contextlib.closing(sqlite3.connect(tmp_path / f"{name}.db")) as conn:
            for n in range(3):
                outboxer.enqueue(conn, "t", {"db": name, "n": n}, key="k")
            conn.commit()
    ran = cli("relay", "--exit-when-idle", "--poll-interval", "0.1", env=env)
    assert ran.returncode == 0, ran.stderr
    assert "database north: relay " in ran.stderr and "database south: relay " in ran.stderr
    entries = redis.Redis.from_url(REDIS).xrange(stream_prefix + "t")
    by_database: dict[str, list[int]] = {}
    for _, fields in entries:
        payload = json.loads(fields[b"payload"])
        by_database.setdefault(payload["db"], []).append(payload["n"])
    assert by_database == {"north": [0, 1, 2], "south": [0, 1, 2]}
    report = cli("status", "--database", "south", env=env)
    assert report.returncode == 0 and "PUBLISHED" in report.stdout, report.stdout + report.stderr
