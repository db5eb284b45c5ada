"""A Backoff built in Python (``Consumer(backoff=...)``, ``StreamRelay(backoff=...)``) gets
the checks a setting gets: NaN passed every comparison of the old checks (its delays were
NaN), and an infinite cap let the delay grow to inf (a retry that never came)."""

from __future__ import annotations

import math

import pytest

from outboxer import Backoff, ConfigError


@pytest.mark.parametrize(
    "kwargs",
    [
        {"base": math.nan},
        {"multiplier": math.nan},
        {"cap": math.nan},
        {"jitter": math.nan},
        {"cap": math.inf},
        {"multiplier": math.inf},
    ],
)
def test_non_finite_backoff_values_are_config_errors(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError, match="finite"):
        Backoff(**kwargs)
