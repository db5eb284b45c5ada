"""An operator's read command pointed at a database where `schema apply` never ran gets the
command to run, as the relay does, not a driver's bare error."""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest

from outboxer.cli import EXIT_USAGE, main

COMMANDS = (["status"], ["messages"], ["dead-letters", "list"])


def _run(capsys: pytest.CaptureFixture[str], command: list[str], url: str) -> tuple[int, str]:
    code = main([*command, "--db", url])
    return code, capsys.readouterr().err


def _assert_tells_to_apply(code: int, err: str) -> None:
    assert code == EXIT_USAGE, err
    assert "run `outboxer schema apply` with the same --db first" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_postgres_without_the_schema(
    pg_url: str, command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("DROP SCHEMA outboxer CASCADE")
    _assert_tells_to_apply(*_run(capsys, command, pg_url))


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_mysql_without_the_schema(
    mysql_empty_url: str, command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    _assert_tells_to_apply(*_run(capsys, command, mysql_empty_url))


def test_sqlite_without_the_schema(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty.db").touch()
    for command in COMMANDS:
        _assert_tells_to_apply(*_run(capsys, command, f"sqlite:///{tmp_path / 'empty.db'}"))


def test_other_failures_keep_their_exit_code(
    pg_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A database that is there but refuses for another reason is not told to apply."""
    code, err = _run(capsys, ["status"], pg_url.rsplit("/", 1)[0] + "/no_such_database_x")
    assert code != EXIT_USAGE and "schema apply" not in err, err
