"""``--log-format json``: the real command logs one JSON object per line; text stays as it was."""

from __future__ import annotations

import json
import re
import sqlite3
from pathlib import Path

import outboxer
from outboxer.stores.sqlite import sqlite_path
from tests.acceptance.test_cli import cli

TEXT_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR) [\w.]+: ")


def drain(sqlite_url: str, tmp_path: Path, *extra: str) -> list[str]:
    """Enqueue one message, run a relay until idle, return its stderr lines."""
    conn = sqlite3.connect(sqlite_path(sqlite_url))
    with conn:
        outboxer.enqueue(conn, "order.placed", {"n": 1}, key="k")
    conn.close()
    out = tmp_path / "events.jsonl"
    result = cli(
        "relay", "--db", sqlite_url, "--broker", f"file://{out}", "--exit-when-idle", *extra
    )
    assert result.returncode == 0, result.stderr
    assert len(out.read_text().splitlines()) == 1
    return result.stderr.splitlines()


def test_json_lines(sqlite_url: str, tmp_path: Path) -> None:
    lines = drain(sqlite_url, tmp_path, "--log-format", "json")
    entries = [json.loads(line) for line in lines]  # every line is one JSON object
    assert {"time", "level", "logger", "message"} <= set(entries[0])
    started = [entry for entry in entries if " started: destinations " in entry["message"]]
    assert started and started[0]["logger"] == "outboxer.relay"
    assert started[0]["level"] == "INFO"


def test_text_lines_by_default(sqlite_url: str, tmp_path: Path) -> None:
    lines = drain(sqlite_url, tmp_path)
    assert lines and all(TEXT_LINE.match(line) for line in lines), lines
    assert any(" INFO outboxer.relay: relay " in line for line in lines)


def test_an_unknown_log_format_is_a_usage_error() -> None:
    result = cli("status", "--log-format", "xml")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "--log-format: invalid choice: 'xml'" in result.stderr
