"""Smoke run of bench/pgmodes.py at tiny sizes: every mode measured, every figure there.

No timing assertions: at these sizes the numbers mean nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from outboxer.streamtesting import PG_BIN

ROOT = Path(__file__).resolve().parents[2]


def test_bench_measures_every_mode(tmp_path: Path) -> None:
    assert (PG_BIN / "initdb").exists()
    out = tmp_path / "pgmodes.json"
    args = ["--runs", "1", "--messages", "300", "--seconds", "0.3", "--writers", "1"]
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "pgmodes.py"), *args, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    figures = json.loads(out.read_text())["results"]
    assert set(figures) == {"bare", "table", "log", "wal", "debezium"}
    for mode, phases in figures.items():
        assert phases["write"]["commits_per_s"] > 0
        assert phases["write"]["wal_bytes_per_tx"] > 0
        if mode in ("table", "log", "wal"):
            assert phases["drain"]["messages"] == 300, mode
    for mode in ("bare", "table", "log", "wal", "debezium"):
        assert mode in result.stdout
