from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from outboxer import Backoff, ConfigError


@given(
    base=st.floats(0.01, 10),
    multiplier=st.floats(1, 5),
    cap_factor=st.floats(1, 1000),
    jitter=st.floats(0, 0.9),
    failures=st.integers(1, 10_000),
    rand=st.floats(0, 1),
)
def test_delay_stays_within_jitter_of_the_capped_exponential(
    base: float, multiplier: float, cap_factor: float, jitter: float, failures: int, rand: float
) -> None:
    backoff = Backoff(base, multiplier, base * cap_factor, jitter)
    low, high = backoff.bounds(failures)
    delay = backoff.delay(failures, rand=lambda: rand)
    assert low - 1e-9 <= delay <= high + 1e-9
    assert delay <= backoff.cap


def test_defaults_double_from_one_second_up_to_five_minutes() -> None:
    backoff = Backoff()
    assert [backoff.nominal(n) for n in range(1, 6)] == [1, 2, 4, 8, 16]
    assert (
        backoff.nominal(9) == 256 and backoff.nominal(10) == 300 and backoff.nominal(10**6) == 300
    )
    assert backoff.bounds(1) == (0.75, 1.25)


def test_jitter_spreads_both_ways() -> None:
    backoff = Backoff(base=10, jitter=0.25)
    assert backoff.delay(1, rand=lambda: 0.0) == 7.5
    assert backoff.delay(1, rand=lambda: 1.0) == 12.5
    assert backoff.delay(1, rand=lambda: 0.5) == 10


@pytest.mark.parametrize(
    "kwargs",
    [
        {"base": 0},
        {"multiplier": 0.5},
        {"base": 10, "cap": 5},
        {"jitter": 1.0},
        {"jitter": -0.1},
    ],
)
def test_bad_settings_are_config_errors(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        Backoff(**kwargs)


def test_delay_after_honours_a_longer_retry_after_up_to_the_cap() -> None:
    backoff = Backoff(base=1, multiplier=2, cap=60, jitter=0)
    assert backoff.delay_after(1, None) == 1
    assert backoff.delay_after(1, 30) == 30
    assert backoff.delay_after(3, 2) == 4  # the backoff is already longer
    assert backoff.delay_after(1, 3600) == 60
    assert backoff.delay_after(1, 0) == 1
