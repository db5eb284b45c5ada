"""Outage: the relay's back-off from a database or broker it cannot reach."""

from __future__ import annotations

import logging

import pytest

from outboxer.brokers import create_publisher
from outboxer.relay import OUTAGE_BACKOFF, Outage, Relay
from outboxer.stores import create_store


def relay() -> Relay:
    return Relay(create_store("sqlite:///unused.db"), {"default": create_publisher("memory://")})


async def test_each_failure_counts_reports_and_waits_then_over_clears_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    idle = relay()
    outage = Outage(
        idle,
        "database",
        "claim failed",
        log_as="destination default: claim failed",
        counts=[idle.stats, idle.destination_stats["default"]],
    )
    idle.stop()  # the back-off's wait ends at once: a stopping relay does not wait it out
    with caplog.at_level(logging.WARNING, logger="outboxer.relay"):
        assert await outage.back_off(ConnectionError("refused")) is True
        assert await outage.back_off(ConnectionError("refused")) is True
    assert outage.failures == 2 and idle.stats.store_errors == 2
    assert idle.destination_stats["default"].store_errors == 2
    assert "database: claim failed (refused)" in idle.health_problems()
    low, high = OUTAGE_BACKOFF.bounds(2)
    [first, second] = [r.getMessage() for r in caplog.records]
    assert first.startswith("destination default: claim failed (refused); retrying in ")
    assert low - 0.05 <= float(second.rsplit(" ", 1)[1].rstrip("s")) <= high + 0.05
    assert outage.over() == 2
    assert outage.failures == 0 and not [p for p in idle.health_problems() if "claim" in p]


async def test_a_broker_outage_counts_no_store_error() -> None:
    idle = relay()
    outage = Outage(idle, "broker default", "unreachable", log_as="broker unreachable")
    idle.stop()
    await outage.back_off(OSError("down"))
    assert idle.stats.store_errors == 0 and outage.failures == 1
    assert outage.count() == pytest.approx(OUTAGE_BACKOFF.nominal(2), rel=0.26)
