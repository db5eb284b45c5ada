"""Which partitions the upkeep makes in a gap retention left between two partitions."""

from __future__ import annotations

import datetime as dt

from outboxer.stores.pgpartitions import plan_ranges

HOUR = 3600.0
DAY = 86400.0


def at(text: str) -> dt.datetime:
    return dt.datetime.fromisoformat(text).replace(tzinfo=dt.UTC)


def day(n: int) -> tuple[dt.datetime, dt.datetime]:
    return (at(f"2025-11-{n:02} 00:00"), at(f"2025-11-{n + 1:02} 00:00"))


NOW = at("2025-11-23 17:45")
#: The 3rd kept (an unfinished row), the 4th to the 21st dropped by retention.
EXISTING = [day(3), day(22), day(23), day(24)]


def test_a_gap_gets_partitions_for_the_slots_of_the_default_rows_only() -> None:
    span = (at("2025-11-10 08:00"), at("2025-11-15 09:00"))
    slots = [at("2025-11-10 00:00"), at("2025-11-15 00:00")]
    assert sorted(plan_ranges(EXISTING, DAY, NOW, 1, span, slots)) == [day(10), day(15)]


def test_a_gap_without_default_rows_stays_a_gap() -> None:
    assert plan_ranges(EXISTING, DAY, NOW, 1, None, []) == []
    outside = [at("2025-11-01 00:00")]  # before the oldest: the backward step covers it
    span = (at("2025-11-01 08:00"), at("2025-11-01 08:00"))
    assert sorted(plan_ranges(EXISTING, DAY, NOW, 1, span, outside)) == [day(1), day(2)]


def test_gap_ranges_step_from_the_gap_start_and_end_at_the_next_partition() -> None:
    """Partitions not on the slots of the Unix epoch (hand-made, a changed width): each slot
    gets every step of the gap it overlaps; the last step ends where the next one begins."""
    existing = [
        (at("2025-11-03 06:00"), at("2025-11-04 06:00")),
        (at("2025-11-06 12:00"), at("2025-11-07 12:00")),
    ]
    span = (at("2025-11-06 01:00"), at("2025-11-06 01:00"))
    ranges = plan_ranges(existing, DAY, at("2025-11-07 00:00"), 0, span, [at("2025-11-06 00:00")])
    assert sorted(ranges) == [
        (at("2025-11-05 06:00"), at("2025-11-06 06:00")),
        (at("2025-11-06 06:00"), at("2025-11-06 12:00")),
    ]


def test_hourly_slots_in_a_daily_gap() -> None:
    existing = [day(3), day(5)]
    slots = [at("2025-11-04 13:00")]
    span = (at("2025-11-04 13:10"), at("2025-11-04 13:20"))
    assert plan_ranges(existing, DAY, at("2025-11-05 01:00"), 0, span, slots) == [day(4)]
    assert plan_ranges(existing, HOUR, at("2025-11-05 01:00"), 0, span, slots) == [
        (at("2025-11-04 13:00"), at("2025-11-04 14:00"))
    ]
