"""Exponential backoff with jitter, for failed publishes and for the relay's own outages."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import astuple, dataclass

from outboxer.errors import ConfigError


@dataclass(frozen=True)
class Backoff:
    """Delay before attempt ``n + 1`` after ``n`` failures: ``base * multiplier**(n-1)``,
    capped at ``cap``, then spread by ±``jitter`` (a fraction) so that messages that
    failed together do not all retry in the same instant. Never above ``cap``.
    """

    base: float = 1.0
    multiplier: float = 2.0
    cap: float = 300.0
    jitter: float = 0.25

    def __post_init__(self) -> None:
        # NaN passes every comparison below, and an infinite cap made a delay of inf: a
        # consumer's retry never came, a relay's settle could not store it.
        if not all(math.isfinite(value) for value in astuple(self)):
            raise ConfigError(f"backoff values must be finite numbers; got {self}")
        if self.base <= 0:
            raise ConfigError("backoff base must be positive")
        if self.multiplier < 1:
            raise ConfigError("backoff multiplier must be at least 1")
        if self.cap < self.base:
            raise ConfigError("backoff cap must be at least the base delay")
        if not 0 <= self.jitter < 1:
            raise ConfigError("backoff jitter must be a fraction in [0, 1)")

    def nominal(self, failures: int) -> float:
        """The delay before jitter after ``failures`` (>= 1) failed attempts."""
        exponent = max(failures, 1) - 1
        if exponent == 0 or self.multiplier == 1:
            return min(self.base, self.cap)
        # Compared in logarithms, not by multiplying until past the cap: multiplier**exponent
        # overflows for large counts, and a loop of ``exponent`` steps took 35 ms a failed
        # message at a million attempts (a multiplier of 1 never reaches the cap), blocking
        # the relay's event loop for seconds a batch, past its leases' renewals.
        if exponent * math.log(self.multiplier) >= math.log(self.cap / self.base):
            return self.cap
        return min(self.base * self.multiplier**exponent, self.cap)

    def delay(self, failures: int, rand: Callable[[], float] = random.random) -> float:
        nominal = self.nominal(failures)
        spread = nominal * self.jitter * (2.0 * rand() - 1.0)
        return min(max(nominal + spread, 0.0), self.cap)

    def delay_after(
        self, failures: int, retry_after: float | None, rand: Callable[[], float] = random.random
    ) -> float:
        """``delay(failures)``, but no less than the wait the broker asked for (HTTP
        Retry-After), which is honoured up to ``cap``: a receiver asking for an hour must
        not hold a key back longer than the backoff would at worst."""
        delay = self.delay(failures, rand)
        if retry_after is not None and retry_after > delay:
            return min(retry_after, self.cap)
        return delay

    def bounds(self, failures: int) -> tuple[float, float]:
        """The smallest and largest delay ``delay(failures)`` can return."""
        nominal = self.nominal(failures)
        return nominal * (1 - self.jitter), min(nominal * (1 + self.jitter), self.cap)
