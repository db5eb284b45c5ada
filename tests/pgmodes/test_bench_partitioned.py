"""Smoke run of bench/partitioned.py at tiny sizes: both layouts, every section, every figure.

No timing assertions: at these sizes the numbers mean nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from outboxer.streamtesting import PG_BIN

ROOT = Path(__file__).resolve().parents[2]


def test_bench_measures_both_layouts(tmp_path: Path) -> None:
    assert (PG_BIN / "initdb").exists()
    out = tmp_path / "partitioned.json"
    args = ["--retained", "3000", "--messages", "300", "--seconds", "0.3", "--writers", "1"]
    result = subprocess.run(
        [sys.executable, "partitioned.py", *args, "--writer-seconds", "0.3", "--json", str(out)],
        cwd=ROOT / "bench",
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    figures = json.loads(out.read_text())["results"]
    assert set(figures) == {"table", "partitioned"}
    for layout, phases in figures.items():
        assert phases["write"]["commits_per_s"] > 0, layout
        assert phases["drain"]["messages"] == 300, layout
        retention = phases["retention"]
        assert retention["left"] == 0, f"{layout}: every row past retention went"
        assert retention["deleted"] >= 3000 or layout == "partitioned", layout
    assert figures["partitioned"]["retention"]["vacuum_seconds"] == 0
    assert "retention: cleanup s" in result.stdout
