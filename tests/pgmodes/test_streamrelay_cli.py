"""python -m outboxer.streamrelay (the alias of ``outboxer stream-relay``, ``--database``
accepted for ``--db``): bad input exits 2 with one line, a missing slot or an unreachable
database exits 1 with one line; never a traceback."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from outboxer.enqueue import Outbox

LOG = ["--mode", "log", "--database", "postgresql://x/db", "--broker", "memory://a"]
BAD_USAGE = [
    ["--mode", "log"],  # no --database, no --broker
    ["--mode", "queue", *LOG[2:]],
    [*LOG, "--batch-size", "0"],
    ["--mode", "log", "--database", "mysql://x/db", "--broker", "memory://a"],
    ["--mode", "log", "--database", "postgresql://x:99999/db", "--broker", "memory://a"],
    ["--mode", "log", "--database", "postgresql://127.0.0.1/db", "--broker", "nope://a"],
    ["--mode", "wal", *LOG[2:], "--retention-days", "3"],
    [*LOG, "--retention-days", "-1"],
]


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "outboxer.streamrelay", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize("args", BAD_USAGE)
def test_bad_input_exits_2_without_traceback(args: list[str]) -> None:
    result = _run(args)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.strip()


def test_missing_slot_exits_1_with_one_line(logical_url: str) -> None:
    result = _run(["--mode", "wal", "--database", logical_url, "--broker", "memory://a"])
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().count("\n") == 0
    assert "does not exist" in result.stderr


def test_unreachable_database_exits_1(tmp_path: object) -> None:
    result = _run(
        [
            "--mode",
            "log",
            "--database",
            "postgresql://postgres@127.0.0.1:1/db",
            "--broker",
            "memory://a",
        ]
    )
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert "cannot connect" in result.stderr


def test_apply_schema_creates_the_log_then_relays(pg_url: str, tmp_path: Path) -> None:
    import psycopg

    out = tmp_path / "out.jsonl"
    args = ["--mode", "log", "--database", pg_url, "--broker", f"file://{out}", "--apply-schema"]
    relay = subprocess.Popen([sys.executable, "-m", "outboxer.streamrelay", *args])
    try:
        deadline = time.monotonic() + 30
        registered = None
        while registered is None and time.monotonic() < deadline:
            time.sleep(0.1)
            with psycopg.connect(pg_url, autocommit=True) as conn:
                exists = conn.execute(
                    "SELECT to_regclass('outboxer.outbox_log_offsets')"
                ).fetchone()
                if exists and exists[0]:
                    registered = conn.execute(
                        "SELECT reader FROM outboxer.outbox_log_offsets"
                    ).fetchone()
        assert registered == ("default",)
        with psycopg.connect(pg_url) as conn:
            Outbox(mode="log").enqueue(conn, "orders", {"n": 1})
        while (
            b"\n" not in (out.read_bytes() if out.exists() else b"") and time.monotonic() < deadline
        ):
            time.sleep(0.1)
        assert json.loads(out.read_text().splitlines()[0])["payload"] == {"n": 1}
    finally:
        relay.send_signal(signal.SIGTERM)
        assert relay.wait(15) == 0
