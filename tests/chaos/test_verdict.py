"""The chaos suite's own checks fail when they should (no servers: made-up deliveries)."""

from __future__ import annotations

import pytest

from tests.chaos.harness import Delivery, Secrets, Workload, check_deliveries, going_back


def workload() -> Workload:
    """Key a: a0, a1, a2; key b: b0; one rolled-back message."""
    made = Workload()
    made.committed = {"a0": ("a", 0), "a1": ("a", 1), "a2": ("a", 2), "b0": ("b", 0)}
    made.rolled_back = {"gone"}
    return made


def delivered(*ids: str, redelivered: frozenset[str] = frozenset()) -> list[Delivery]:
    key_n = {**workload().committed, "gone": ("a", None)}
    return [
        Delivery(i, key_n[i][0], key_n[i][1], float(at), i in redelivered)
        for at, i in enumerate(ids)
    ]


def test_a_clean_run_passes_and_counts_duplicates() -> None:
    verdict = check_deliveries(
        workload(), delivered("a0", "b0", "a1", "a1", "a2"), in_flight_at_faults={"a1"}
    )
    assert (verdict.messages, verdict.deliveries, verdict.duplicates) == (4, 5, 1)


@pytest.mark.parametrize(
    ("ids", "in_flight", "complaint"),
    [
        (("a0", "a1", "b0"), set(), "never delivered"),
        (("a0", "a1", "a2", "b0", "gone"), set(), "rolled-back"),
        (("a0", "a2", "a1", "b0"), set(), "per-key order"),
        (("a0", "a1", "a1", "a2", "b0"), set(), "no fault had in flight"),
        (("a0", "a1", "a1", "a2", "b0"), {"a2"}, "no fault had in flight"),
    ],
)
def test_each_broken_promise_fails(
    ids: tuple[str, ...], in_flight: set[str], complaint: str
) -> None:
    with pytest.raises(AssertionError, match=complaint):
        check_deliveries(workload(), delivered(*ids), in_flight_at_faults=in_flight)


def test_a_broker_redelivery_is_no_relay_duplicate() -> None:
    deliveries = delivered("a0", "a1", "a1", "a2", "b0", redelivered=frozenset({"a1"}))
    deliveries[1] = Delivery("a1", "a", 1, 1.0, False)  # the first copy came fresh
    verdict = check_deliveries(workload(), deliveries, in_flight_at_faults=set())
    assert (verdict.duplicates, verdict.broker_redeliveries) == (0, 1)


def test_a_key_going_back_is_seen_even_when_first_deliveries_keep_order() -> None:
    assert going_back(workload(), delivered("a0", "a1", "a0", "a2")) == ["a: 0 after 1"]
    assert going_back(workload(), delivered("a0", "a0", "a1", "a1", "a2")) == []


def test_secrets_are_found_in_urls_and_in_their_quoted_form() -> None:
    secrets = Secrets.of(
        "postgresql://app:p%40ss@db/x", "https://hooks/x?secret=s3&n=1", plain=["tok-9f3a"]
    )
    assert secrets.values == ("tok-9f3a", "p@ss", "s3")
    assert secrets.found_in("connect postgresql://app:p%40ss@db") == ["p%40ss"]
    assert secrets.found_in("url https://hooks/x?secret=***&n=1 token ***") == []
