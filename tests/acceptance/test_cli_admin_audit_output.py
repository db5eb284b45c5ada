"""The admin commands' reports on a terminal, with names an application chose: a
destination name is any storable text (enqueue refuses only a NUL or a lone surrogate), so
``purge --dry-run`` and ``status`` must print it with its control characters escaped, as
``outboxer messages`` prints topics, keys and errors."""

from __future__ import annotations

import psycopg

import outboxer
from tests.acceptance.test_cli import cli

#: Clears the screen and retitles the window, then forges a report line.
HOSTILE = "evil\x1b]0;owned\x07\x1b[2J\nwould purge 0 message(s)\u202e"


def test_dry_run_and_status_escape_a_hostile_destination_name(pg_url: str) -> None:
    with psycopg.connect(pg_url) as conn:
        outboxer.enqueue(conn, "order.placed", {"n": 1}, destinations=[HOSTILE])

    dry = cli("purge", "--db", pg_url, "--topic", "order.placed", "--dry-run")
    status = cli("status", "--db", pg_url)

    for result in (dry, status):
        assert result.returncode == 0, result.stderr
        assert "\x1b" not in result.stdout and "\x07" not in result.stdout
        assert "\u202e" not in result.stdout
        assert "evil\\x1b]0;owned\\x07\\x1b[2J\\x0awould purge 0 message(s)\\u202e" in (
            result.stdout
        )
    assert dry.stdout.splitlines()[0] == "would purge 1 message(s); dry run, nothing changed"
    assert len(dry.stdout.splitlines()) == 2, "one line per destination and status"
