"""Per-test wall-clock timings for keeping the suite under its time budget, loaded by
tests/conftest.py (``pytest_plugins``). Off unless ``OUTBOXER_TEST_TIMINGS`` names a
directory: each pytest process (an xdist worker, the serial phase) then appends one JSON
line per test phase to ``<dir>/<worker>-<pid>.jsonl``, and one of the CPU seconds the test
took in its process and the children it waited for (servers' CPU is not in it); ``scripts/test-timings <dir>`` sums
them per file and per worker and shows how much of the parallel phase was waiting on its
last files (14 s of 751 in a CI run: ``--dist loadfile`` balances the three workers well,
and the phase is CPU-bound on this machine's two cores, so ordering files longest first
would gain little)."""

from __future__ import annotations

import json
import os
import resource
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

_DIRECTORY = os.environ.get("OUTBOXER_TEST_TIMINGS")


def _cpu_seconds() -> float:
    own, children = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _write(line: dict[str, Any]) -> None:
    assert _DIRECTORY
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    path = Path(_DIRECTORY) / f"{worker}-{os.getpid()}.jsonl"
    with path.open("a", encoding="utf-8") as out:
        out.write(json.dumps({"worker": worker, **line}) + "\n")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None]:
    if not _DIRECTORY:
        return (yield)
    before = _cpu_seconds()
    try:
        return (yield)
    finally:
        _write({"test": item.nodeid, "when": "cpu", "cpu": _cpu_seconds() - before})


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # xdist's controller hears every worker's reports again (``report.node`` set): skipped.
    if not _DIRECTORY or getattr(report, "node", None) is not None:
        return
    _write(
        {
            "test": report.nodeid,
            "when": report.when,
            "start": report.start,
            "stop": report.stop,
            "outcome": report.outcome,
        }
    )
