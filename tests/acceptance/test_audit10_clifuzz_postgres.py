"""`dead-letters list --limit` past a bigint, against PostgreSQL: before, the driver's
NumericValueOutOfRange (exit 1, "run with --log-level DEBUG for the traceback"); now a
configuration error naming the bound (exit 2)."""

from __future__ import annotations

import pytest

from outboxer.cli import EXIT_USAGE, main


@pytest.mark.parametrize("limit", ["99999999999999999999", "10001"])
def test_a_dead_letters_limit_past_the_bound_is_refused_before_the_database(
    pg_url: str, limit: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["dead-letters", "list", "--db", pg_url, "--group", "g", "--limit", limit])
    error = capsys.readouterr().err
    assert code == EXIT_USAGE, error
    assert f"--limit must be between 1 and 10000, not {limit}" in error
    assert "NumericValueOutOfRange" not in error and len(error.strip().splitlines()) == 1


def test_the_bound_itself_lists(pg_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["dead-letters", "list", "--db", pg_url, "--group", "g", "--limit", "10000"])
    assert code == 0, capsys.readouterr().err
    assert capsys.readouterr().out.strip() == "no dead letters"
