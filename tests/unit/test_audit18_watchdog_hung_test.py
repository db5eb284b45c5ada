"""tests/watchdog.py ends a test process hung past its timeout, where pytest-timeout alone
could not (the alarm's exception swallowed), so CI fails instead of waiting for ever."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

HUNG = """
import time

import pytest


@pytest.mark.timeout(1)
def test_swallows_every_alarm():
    end = time.monotonic() + 60
    while time.monotonic() < end:
        try:
            time.sleep(0.05)
        except BaseException:  # what a loop's close waiting on a stubborn task amounts to
            pass
"""


def test_a_test_that_swallows_its_timeout_ends_the_process(tmp_path: Path) -> None:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_hung.py").write_text(HUNG)
    started = time.monotonic()
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "tests.watchdog"]
    command += ["-c", str(tmp_path / "pytest.ini"), "--rootdir", str(tmp_path)]
    done = subprocess.run(
        [*command, str(tmp_path / "test_hung.py")],
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "OUTBOXER_TEST_WATCHDOG_GRACE": "1"},
        capture_output=True,
        text=True,
        timeout=50,
    )
    elapsed = time.monotonic() - started
    assert done.returncode != 0
    assert elapsed < 30, elapsed  # the hung test alone would have run 60 s
    # faulthandler's dump names the hung test's frame.
    assert "test_swallows_every_alarm" in done.stderr, done.stderr[-2000:]
