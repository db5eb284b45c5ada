"""Error text is made storable before any settle: no NUL, valid UTF-8, bounded, cut marked."""

from __future__ import annotations

from outboxer.stores import Failure, storable_error
from outboxer.stores.base import MAX_ERROR_LENGTH


def test_nul_and_lone_surrogates_become_the_replacement_character() -> None:
    assert storable_error("a\x00b\ud800c\udfff") == "a\ufffdb\ufffdc\ufffd"
    assert storable_error("zürich ✓ 😀") == "zürich ✓ 😀", "valid text stays as it is"


def test_long_text_is_cut_to_the_bound_with_a_marker_and_cutting_is_idempotent() -> None:
    cut = storable_error("\x00" + "x" * 1_000_000)
    assert len(cut) == MAX_ERROR_LENGTH
    assert cut.startswith("\ufffdxxx") and cut.endswith(" … [cut: 1000001 characters in all]")
    assert storable_error(cut) == cut
    exact = "y" * MAX_ERROR_LENGTH
    assert storable_error(exact) == exact


def test_a_failure_holds_storable_text_whatever_it_was_given() -> None:
    assert Failure(1, "boom \x00", 1.0, False).error == "boom \ufffd"
