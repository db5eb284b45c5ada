"""A consumer ``statement_timeout`` the settings allow (up to 30 days) connects to
PostgreSQL: its TCP keepalives, derived from it, stay within what the kernel takes.

Half a bound of a day (43200 s) was asked of TCP_KEEPIDLE, past Linux's 32767: libpq failed
every connect with "setsockopt(TCP_KEEPIDLE) failed: Invalid argument", so `outboxer consume
--statement-timeout 1d` (or `dead-letters list`, or Django on PostgreSQL) could not reach
its database at all; asyncpg's and PyMySQL's sockets were left without keepalives (a
warning per connection)."""

from __future__ import annotations

import pytest

from outboxer.cli import main


@pytest.mark.parametrize("bound", ["1d", "30d"])
def test_dead_letters_list_connects_with_a_long_statement_timeout(
    pg_url: str, bound: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        ["dead-letters", "list", "--db", pg_url, "--group", "g", "--statement-timeout", bound]
    )
    out, err = capsys.readouterr()
    assert (code, out.strip()) == (0, "no dead letters"), err
