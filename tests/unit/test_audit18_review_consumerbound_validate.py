"""Consumer.statement_timeout is checked when a session is made: 0 or less fired the
watchdog at every loop turn, NaN cut every round trip at its first tick."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from outboxer.consumer import Consumer
from outboxer.errors import ConfigError


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf])
def test_a_bound_that_is_not_a_positive_number_is_a_config_error(
    tmp_path: Path, bad: float
) -> None:
    consumer = Consumer(
        db=f"sqlite:///{tmp_path / 'c.db'}",
        broker="memory://b",
        group="g",
        handler=lambda d, c: None,
    )
    consumer.statement_timeout = bad
    with ThreadPoolExecutor(1) as threads, pytest.raises(ConfigError, match="statement_timeout"):
        consumer._new_session(threads)


def test_none_and_a_positive_bound_make_sessions(tmp_path: Path) -> None:
    consumer = Consumer(
        db=f"sqlite:///{tmp_path / 'c.db'}",
        broker="memory://b",
        group="g",
        handler=lambda d, c: None,
    )
    with ThreadPoolExecutor(1) as threads:
        for bound in (None, 0.5):
            consumer.statement_timeout = bound
            assert consumer._new_session(threads).statement_timeout == bound
