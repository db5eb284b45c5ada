"""``private_postgres`` removes what it made when its server does not start, and says why.

A start that failed (here: the port is the shared server's) left the initialised data
directory, some 40 MB, in the temp directory, and the error did not say why the server
refused to start: that was in the log inside the directory left behind.
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

import pytest

from outboxer import streamtesting


def _made() -> set[Path]:
    return set(Path(tempfile.gettempdir()).glob("outboxer-logical-pg-*"))


def test_a_server_that_does_not_start_leaves_nothing_and_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if not (streamtesting.PG_BIN / "initdb").exists():
        pytest.skip(f"no PostgreSQL binaries in {streamtesting.PG_BIN}")
    monkeypatch.setattr(streamtesting, "_free_port", lambda: 5432)  # the shared server's
    before = _made()
    with (
        pytest.raises(subprocess.CalledProcessError) as raised,
        streamtesting.private_postgres(),
    ):
        raise AssertionError("started on a port already taken")
    assert _made() == before
    assert "5432" in "\n".join(getattr(raised.value, "__notes__", [])), raised.value
