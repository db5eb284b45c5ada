"""Which partitions the upkeep of a partitioned outbox makes, and what it names them."""

from __future__ import annotations

import datetime as dt

from outboxer.stores.pgpartitions import MAX_CREATED_PER_ROUND, align, partition_name, plan_ranges

HOUR = 3600.0
DAY = 86400.0


def at(text: str) -> dt.datetime:
    return dt.datetime.fromisoformat(text).replace(tzinfo=dt.UTC)


def test_names_say_where_a_partition_starts() -> None:
    assert partition_name("outbox", at("2025-11-23 00:00")) == "outbox_p20251123"
    assert partition_name("outbox", at("2025-11-23 13:00")) == "outbox_p20251123_1300"
    assert partition_name("outbox", at("2025-11-23 13:00:05")) == "outbox_p20251123_130005"
    local = dt.datetime(2025, 11, 23, 1, 0, tzinfo=dt.timezone(dt.timedelta(hours=1)))
    assert partition_name("outbox", local) == "outbox_p20251123", "named in UTC"


def test_slots_count_from_the_epoch() -> None:
    assert align(at("2025-11-23 17:45"), DAY) == at("2025-11-23 00:00")
    assert align(at("2025-11-23 17:45"), 6 * HOUR) == at("2025-11-23 12:00")


def test_first_partitions_start_at_now_and_reach_ahead() -> None:
    ranges = plan_ranges([], DAY, at("2025-11-23 17:45"), 3, None)
    assert ranges == [
        (at(f"2025-11-{d} 00:00"), at(f"2025-11-{d + 1} 00:00")) for d in range(23, 27)
    ]


def test_new_partitions_continue_the_newest_and_cover_the_default_rows() -> None:
    existing = [
        (at("2025-11-22 00:00"), at("2025-11-23 00:00")),
        (at("2025-11-23 00:00"), at("2025-11-24 00:00")),
    ]
    assert plan_ranges(existing, DAY, at("2025-11-23 17:45"), 1, None) == [
        (at("2025-11-24 00:00"), at("2025-11-25 00:00"))
    ]
    # Rows in the default partition from the 20th to the 26th: backward and forward.
    span = (at("2025-11-20 10:00"), at("2025-11-26 01:00"))
    ranges = plan_ranges(existing, DAY, at("2025-11-23 17:45"), 1, span)
    assert sorted(ranges) == [
        (at(f"2025-11-{d} 00:00"), at(f"2025-11-{d + 1} 00:00")) for d in (20, 21, 24, 25, 26)
    ]


def test_a_changed_width_continues_from_the_newest_upper_bound() -> None:
    existing = [(at("2025-11-23 00:00"), at("2025-11-24 00:00"))]
    ranges = plan_ranges(existing, 6 * HOUR, at("2025-11-23 20:00"), 1, None)
    assert ranges == [(at("2025-11-24 00:00"), at("2025-11-24 06:00"))]


def test_one_round_makes_a_bounded_number() -> None:
    span = (at("1999-01-01 00:00"), at("1999-01-02 00:00"))
    existing = [(at("2025-11-23 00:00"), at("2025-11-24 00:00"))]
    ranges = plan_ranges(existing, DAY, at("2025-11-23 20:00"), 1, span)
    assert len(ranges) == MAX_CREATED_PER_ROUND
    assert ranges[0] == (at("2025-11-24 00:00"), at("2025-11-25 00:00")), "the nearest first"
