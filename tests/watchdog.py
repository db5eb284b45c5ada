"""A last-resort watchdog for hung tests, loaded by tests/conftest.py (``pytest_plugins``).

pytest-timeout fails a test that runs past its timeout (``timeout`` in pyproject.toml, or the
test's own mark), but its SIGALRM cannot stop a test hung where the alarm's exception is
swallowed: an event loop's close waiting on a task that ignores its cancellation, a join on
a thread that never ends. CI then waited for ever on that worker. This watchdog dumps every
thread's stack and ends the process once a test has outlived its timeout by
``WATCHDOG_GRACE`` seconds, so the run fails naming the test (pytest-xdist reports the
worker crashed while running it and replaces it) instead of hanging.
"""

from __future__ import annotations

import faulthandler
import os
import sys
from collections.abc import Generator
from typing import Any

import pytest

#: Seconds beyond the test's timeout. OUTBOXER_TEST_WATCHDOG_GRACE changes it (its own test).
WATCHDOG_GRACE = float(os.environ.get("OUTBOXER_TEST_WATCHDOG_GRACE", "120"))


def _dump_file(config: pytest.Config) -> Any:
    """pytest's own copy of the real stderr: the test's captured one dies with the process."""
    from _pytest.faulthandler import fault_handler_stderr_fd_key

    return config.stash.get(fault_handler_stderr_fd_key, None) or sys.__stderr__


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(
    item: pytest.Item, nextitem: pytest.Item | None
) -> Generator[None, Any, Any]:
    marker = item.get_closest_marker("timeout")
    limit = marker.args[0] if marker is not None and marker.args else None
    if limit is None:
        limit = item.config.getini("timeout") or 0
    if not float(limit):  # no timeout asked for: no watchdog either
        return (yield)
    # pytest-timeout's one timer covers setup, call and teardown, as this one does.
    faulthandler.dump_traceback_later(
        float(limit) + WATCHDOG_GRACE, exit=True, file=_dump_file(item.config)
    )
    try:
        return (yield)
    finally:
        faulthandler.cancel_dump_traceback_later()
