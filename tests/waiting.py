"""Waiting in tests on something that may hang: a condition with a deadline, a call in a
daemon thread given a few seconds (a hung call fails the test instead of hanging it)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


def wait_for(condition: Callable[[], bool], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def within(seconds: float, what: str, run: Callable[[], object]) -> object:
    """What ``run()`` returned or raised, in a daemon thread given ``seconds`` to end."""
    outcome: list[object] = []

    def work() -> None:
        try:
            outcome.append(run())
        except BaseException as exc:  # the test reads it
            outcome.append(exc)

    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"{what} hung"
    return outcome[0]
