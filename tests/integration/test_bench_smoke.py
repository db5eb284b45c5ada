"""CI smoke run of the bench (``bench/run.py --quick``): it runs end to end and emits every figure.

No timing assertions: the sizes are tiny and the numbers mean nothing. What is checked is
that every section ran, every figure the harness promises is in the JSON with a median,
min and max, every target has a verdict, and the run deleted what it created (databases,
exchanges, queues, streams).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import psycopg
import pytest

from tests.conftest import MYSQL_ADMIN, PG_ADMIN, mysql_connect
from tests.services import require

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"


def _bench_run_module() -> ModuleType:
    """bench/run.py as a module (its siblings are imported from bench/, as when run as a script)."""
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("outboxer_bench_run", BENCH / "run.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


@pytest.mark.timeout(420)
def test_quick_bench_runs_end_to_end_and_emits_every_figure(tmp_path: Path) -> None:
    for service in ("postgresql", "rabbitmq", "redis", "mariadb"):
        require(service)
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "run.py"), "--quick", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
        env={**os.environ, "OUTBOXER_BENCH_PG": PG_ADMIN, "OUTBOXER_BENCH_MYSQL": MYSQL_ADMIN},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads(out.read_text())
    bench = _bench_run_module()

    expected = [name for figures in bench.FIGURES.values() for name, _ in figures]
    assert set(bench.FIGURES) == set(bench.SECTIONS)
    missing = [name for name in expected if name not in data["figures"]]
    assert not missing, f"figures missing from the JSON: {missing}"
    for name in expected:
        figure = data["figures"][name]
        for stat in ("median", "min", "max"):
            value = figure[stat]
            assert isinstance(value, int | float) and math.isfinite(value), (name, stat, value)
        assert figure["min"] <= figure["median"] <= figure["max"], name
        assert len(figure["runs"]) >= 1, name
        assert name in proc.stdout, f"{name} is not in the printed table"

    verdicts = {target["figure"]: target for target in data["targets"]}
    assert set(verdicts) == {target.figure for target in bench.TARGETS}
    assert all(isinstance(target["pass"], bool) for target in verdicts.values())

    assert "left_on_brokers" not in data["meta"], data["meta"]["left_on_brokers"]
    run_id = data["meta"]["run_id"]
    with psycopg.connect(PG_ADMIN) as conn:
        left = conn.execute(
            "SELECT datname FROM pg_database WHERE datname LIKE %s", (f"outboxer_bench_{run_id}_%",)
        ).fetchall()
    assert left == [], f"the bench left databases behind: {left}"
    with mysql_connect(MYSQL_ADMIN, autocommit=True) as conn:
        cursor = conn.cursor()
        cursor.execute("SHOW DATABASES LIKE %s", (f"outboxer_bench_{run_id}_%",))
        left = cursor.fetchall()
    assert not left, f"the bench left MariaDB databases behind: {left}"


@pytest.mark.timeout(180)
def test_status_bench_runs_end_to_end_and_drops_what_it_made(tmp_path: Path) -> None:
    """``bench/status.py`` on tiny tables: every figure, the estimates flagged, nothing left."""
    for service in ("postgresql", "mariadb"):
        require(service)
    out = tmp_path / "status.json"
    sizes = [
        "--rows",
        "25000",
        "--mysql-rows",
        "25000",
        "--sqlite-rows",
        "25000",
        "--backlog",
        "300",
    ]
    calls = ["--repeat", "1", "--controls", "1", "--json", str(out)]
    proc = subprocess.run(
        [sys.executable, str(BENCH / "status.py"), *sizes, *calls],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=170,
        check=False,
        env={**os.environ, "OUTBOXER_BENCH_PG": PG_ADMIN, "OUTBOXER_BENCH_MYSQL": MYSQL_ADMIN},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads(out.read_text())
    for dialect in ("postgres", "mariadb", "sqlite"):
        figures = data[dialect]
        assert "status" in figures and "control: status, GROUP BY over the table" in figures
        for name, numbers in figures["estimates"].items():
            assert numbers["flagged"] and numbers["others_equal"], (dialect, name, numbers)
    run_id = data["meta"]["run_id"]
    with psycopg.connect(PG_ADMIN) as conn:
        left = conn.execute(
            "SELECT datname FROM pg_database WHERE datname LIKE %s", (f"outboxer_bench_{run_id}_%",)
        ).fetchall()
    assert left == [], f"the bench left databases behind: {left}"
    with mysql_connect(MYSQL_ADMIN, autocommit=True) as conn:
        cursor = conn.cursor()
        cursor.execute("SHOW DATABASES LIKE %s", (f"outboxer_bench_{run_id}_%",))
        assert not cursor.fetchall(), "the bench left MariaDB databases behind"
