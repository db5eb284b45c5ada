"""The CLI as the README's operations section uses it, at a shell: piped into `head`."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.acceptance.test_cli import OUTBOXER


def test_a_reader_that_stops_early_is_not_reported_as_a_failure(sqlite_url: str) -> None:
    """README: "1 any other failure (one line on stderr)". A reader that has read enough is
    no failure of outboxer's: a shell pipeline prints no error for it."""
    read, write = os.pipe()
    os.close(read)  # the reader is gone before anything is written: EPIPE, every time
    try:
        done = subprocess.run(
            [*OUTBOXER, "status", "--db", sqlite_url],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write)
    assert "BrokenPipeError" not in done.stderr and done.stderr == "", done.stderr
    assert done.returncode == 141, "a shell's status for a writer whose reader went away"


def test_status_on_a_mistyped_sqlite_path_creates_nothing(tmp_path: Path) -> None:
    """README, exit codes: a failure is "one line on stderr". A read-only command given a
    wrong path must leave no database behind for the next command (or relay) to find empty;
    the error should say what is missing (`outboxer schema apply`), as the relay's does."""
    missing = tmp_path / "typo" / "outbox.db"
    done = subprocess.run(
        [*OUTBOXER, "status", "--db", f"sqlite:///{missing}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert not missing.parent.exists(), sorted(p.name for p in missing.parent.iterdir())
    assert "schema apply" in done.stderr, done.stderr
