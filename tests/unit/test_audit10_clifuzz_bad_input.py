"""Bad input at the `outboxer` command line that ended in a Python error's name (exit 1,
"run with --log-level DEBUG for the traceback") instead of a clear message and exit 2, or
that echoed a password:

* `--config` naming a file with a NUL or a lone surrogate: ValueError / UnicodeEncodeError;
* `dead-letters list --limit 99999999999999999999999`: OverflowError from SQLite (PostgreSQL:
  NumericValueOutOfRange);
* `enqueue --payload '[[[…'` nested past the JSON decoder's recursion limit: RecursionError;
* `--claim-check-store 'file://<NUL>'`: ValueError;
* `demo --dir <NUL>`: ValueError;
* a stray argument holding a URL with a password, or a newline: argparse's error quoted it
  as given (the password shown, the message over two lines).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from outboxer.cli import main


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as exc:
        code = int(exc.code or 0)
    captured = capsys.readouterr()
    return code, captured.err


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path}/outbox.db"
    assert main(["schema", "apply", "--db", url]) == 0
    return url


@pytest.mark.parametrize("config", ["\x00", "\ud800", "settings\x00.toml"])
def test_a_config_file_name_no_file_system_can_hold_is_a_configuration_error(
    config: str, sqlite_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    capsys.readouterr()
    code, error = _run(["status", "--db", sqlite_url, "--config", config], capsys)
    assert code == 2, error
    assert error.startswith("outboxer: configuration error: config file name"), error
    assert "ValueError" not in error and "UnicodeEncodeError" not in error


def test_a_dead_letters_limit_past_any_integer_column_is_a_configuration_error(
    sqlite_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    capsys.readouterr()
    argv = ["dead-letters", "list", "--db", sqlite_url, "--group", "g"]
    code, error = _run([*argv, "--limit", "99999999999999999999999"], capsys)
    assert code == 2, error
    assert "--limit must be between 1 and 10000" in error
    assert "OverflowError" not in error


def test_a_payload_nested_too_deeply_is_a_usage_error_and_enqueues_nothing(
    sqlite_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    capsys.readouterr()
    argv = ["enqueue", "--db", sqlite_url, "--topic", "t", "--payload", "[" * 100_000]
    code, error = _run(argv, capsys)
    assert code == 2, error
    assert "--payload nests arrays or objects too deeply" in error
    assert "RecursionError" not in error
    with sqlite3.connect(sqlite_url.removeprefix("sqlite:///")) as conn:
        assert conn.execute("SELECT count(*) FROM outbox").fetchone() == (0,)


@pytest.mark.parametrize("store", ["file://\x00", "file://\ud800", "file:///tmp/a%00b"])
def test_a_claim_check_directory_no_file_system_can_hold_is_a_configuration_error(
    store: str, sqlite_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    capsys.readouterr()
    argv = ["claim-check", "sweep", "--db", sqlite_url, "--claim-check-store", store]
    code, error = _run(argv, capsys)
    assert code == 2, error
    assert "is not a usable directory path" in error
    assert "ValueError" not in error and "UnicodeEncodeError" not in error


@pytest.mark.parametrize("directory", ["\x00", "demo\x00dir", "\ud800"])
def test_a_demo_directory_no_file_system_can_hold_is_a_usage_error(
    directory: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, error = _run(["demo", "--dir", directory], capsys)
    assert code == 2, error
    assert error.startswith("outboxer demo: --dir") and "is not a usable path" in error


@pytest.mark.parametrize(
    "argv",
    [
        ["status", "--json", "postgresql://app:hunter2@db.example/app"],
        ["dead-letters", "list", "--group", "g", "--limit", "postgresql://app:hunter2@db/app"],
        ["schema", "apply", "mysql://root:hunter2@db/app"],
        ["status", "--broker", "x\nsecond line"],
    ],
)
def test_an_argument_error_is_one_line_without_the_password(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    code, error = _run(argv, capsys)
    assert code == 2, error
    assert "hunter2" not in error
    assert error.count("\n") == 1 and error.startswith("outboxer")
