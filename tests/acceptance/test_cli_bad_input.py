"""Bad input to the real ``outboxer`` command: exit 2, one clear line, no traceback, nothing done."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import psycopg
import pytest

import outboxer
from outboxer.stores.sqlite import sqlite_path
from tests.acceptance.test_cli import cli

ROWS = "SELECT id, status, attempts, locked_by, last_error FROM outbox ORDER BY seq"


@pytest.fixture
def one_pending(sqlite_url: str) -> str:
    """A SQLite outbox holding one PENDING message."""
    conn = sqlite3.connect(sqlite_path(sqlite_url))
    with conn:
        outboxer.enqueue(conn, "t", {"n": 1})
    conn.close()
    return sqlite_url


def rows(sqlite_url: str) -> list[Any]:
    conn = sqlite3.connect(sqlite_path(sqlite_url))
    try:
        return conn.execute(ROWS).fetchall()
    finally:
        conn.close()


def assert_usage_error(result: Any, fragment: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert fragment in result.stderr, result.stderr


def write(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


@pytest.mark.parametrize(
    ("args", "env", "fragment"),
    [
        (["relay", "--http", "127.0.0.1:²"], {}, "--http must be HOST:PORT"),
        (["relay", "--lock-timeout", "nan"], {}, "--lock-timeout must be a duration"),
        (["relay", "--lock-timeout", "1e400"], {}, "--lock-timeout must be a duration"),
        (["relay", "--backoff-max", "1" + "0" * 20], {}, "--backoff-max must be at most 30d"),
        (["relay", "--batch-size", "٣"], {}, "--batch-size must be a whole number"),
        (["relay"], {"OUTBOXER_POLL_INTERVAL": "inf"}, "OUTBOXER_POLL_INTERVAL must be a"),
        (["relay", "--table", "outbox\n"], {}, "--table: table name 'outbox\\n'"),
        (["relay", "--broker", "amqp://h:99999/"], {}, "--broker: the port '99999'"),
        (["relay", "--http", "127.0.0.1:0"], {"OUTBOXER_HTTP_TOKEN": ""}, "is set but empty"),
        (["relay", "--http", "127.0.0.1:0", "--http-token", "t0ken"], {}, "too short"),
        (["cleanup", "--published-retention", "nan"], {}, "--published-retention must be a"),
        (["status", "--table", "outbox\n"], {}, "--table: table name"),
        (["requeue", "--schema", "x;"], {}, "--schema: schema name"),
        (["enqueue", "--topic", "t", "--payload", "{"], {}, "--payload is not JSON"),
        (["enqueue", "--topic", "t", "--payload", "1", "--header", "h"], {}, "NAME=VALUE"),
        (["enqueue", "--topic", "", "--payload", "{}"], {}, "outboxer enqueue: topic"),
        (["messages", "--limit", "0"], {}, "--limit must be between 1 and 10000"),
        (["requeue", "--id", "junk"], {}, "--id 'junk' is not a message id"),
    ],
)
def test_bad_flags_and_variables_exit_2_with_one_line_and_touch_nothing(
    one_pending: str, args: list[str], env: dict[str, str], fragment: str
) -> None:
    before = rows(one_pending)
    command, *rest = args
    flags = [command, "--db", one_pending, *rest]
    if command == "relay":
        flags += [] if "--broker" in rest else ["--broker", "memory://"]
        flags += ["--exit-when-idle"]
    assert_usage_error(cli(*flags, env=env), fragment)
    assert rows(one_pending) == before


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        (b'db = "sqlite:///caf\xe9.db"\n', "is not UTF-8 text"),
        (b"outboxer = 1\n", "outboxer must be a table ([outboxer]) of settings, not an integer"),
        (b"[destinations]\nx = 1\n", "destination 'x' must be a table with a broker URL"),
        (b"batch_size = true\n", "batch_size must be a whole number, not a boolean"),
        (b"lock_timeout = nan\n", "lock_timeout must be a finite duration"),
        (b'db = "postgresql://h:abc/db"\n', "db: the port 'abc'"),
    ],
)
def test_bad_config_files_exit_2_with_one_line(
    tmp_path: Path, content: bytes, fragment: str
) -> None:
    config = write(tmp_path / "outboxer.toml", content)
    assert_usage_error(cli("status", "--config", config), fragment)


def test_a_directory_as_the_config_file_exits_2(tmp_path: Path) -> None:
    assert_usage_error(cli("status", "--config", str(tmp_path)), "is a directory")
    assert_usage_error(cli("status", env={"OUTBOXER_CONFIG": str(tmp_path)}), "is a directory")


def test_an_unknown_destination_option_exits_2_naming_the_known_ones(
    one_pending: str, tmp_path: Path
) -> None:
    before = rows(one_pending)
    config = write(
        tmp_path / "outboxer.toml",
        b'[destinations.x]\nbroker = "file:///dev/null"\noptions = { nope = 1 }\n',
    )
    result = cli("relay", "--db", one_pending, "--config", config, "--exit-when-idle")
    assert_usage_error(result, "unknown option(s) nope for the broker 'file:///dev/null'")
    assert "known: none" in result.stderr
    assert rows(one_pending) == before


def test_a_non_numeric_port_in_the_database_url_exits_2() -> None:
    assert_usage_error(cli("status", "--db", "postgresql://h:abc/db"), "--db: the port 'abc'")


def test_messages_and_requeue_validate_their_arguments_on_postgresql(pg_url: str) -> None:
    with psycopg.connect(pg_url) as conn:
        message = outboxer.enqueue(conn, "t", {"n": 1})
        conn.execute("UPDATE outboxer.outbox SET status = 'ABANDONED', attempts = 10")
    for limit in ("-1", "0", "10001", "ten", "²"):
        assert_usage_error(cli("messages", "--db", pg_url, "--limit", limit), "--limit must be")
    assert_usage_error(
        cli("requeue", "--db", pg_url, "--id", str(message.id), "--id", "junk"),
        "--id 'junk' is not a message id",
    )
    with psycopg.connect(pg_url) as conn:
        assert conn.execute("SELECT status, attempts FROM outboxer.outbox").fetchall() == [
            ("ABANDONED", 10)
        ], "a bad id among good ones requeues nothing"
    listed = cli("messages", "--db", pg_url, "--limit", "10000")
    assert listed.returncode == 0 and str(message.id) in listed.stdout, listed.stderr


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        ([], "the following arguments are required: COMMAND"),
        (["relay", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["schema"], "the following arguments are required"),
        (["messages", "--status", "LOST"], "argument --status: invalid choice: 'LOST'"),
        (["enqueue", "--payload", "{}"], "the following arguments are required: --topic"),
    ],
)
def test_usage_errors_are_one_line_with_a_pointer_to_help(args: list[str], fragment: str) -> None:
    result = cli(*args)
    assert_usage_error(result, fragment)
    assert "--help" in result.stderr


def test_version() -> None:
    result = cli("--version")
    assert (result.returncode, result.stdout.strip()) == (0, f"outboxer {outboxer.__version__}")


def test_an_unexpected_error_is_one_line_unless_debugging(tmp_path: Path) -> None:
    """An error outboxer does not wrap (here the demo's folder is a file): exit 1, one
    line, and the traceback only with --log-level DEBUG."""
    a_file = write(tmp_path / "a-file", b"")
    quiet = cli("demo", "--dir", a_file)
    assert quiet.returncode == 1, quiet.stderr
    [line] = quiet.stderr.strip().splitlines()
    assert line.startswith("outboxer: FileExistsError: ")
    assert line.endswith("(run with --log-level DEBUG for the traceback)")
    loud = cli("demo", "--dir", a_file, "--log-level", "DEBUG")
    assert loud.returncode == 1 and "Traceback" in loud.stderr and "FileExistsError" in loud.stderr


def test_hostile_topic_key_and_error_text_reach_the_terminal_escaped(sqlite_url: str) -> None:
    """Topics, keys and error text are data from applications and remote servers: an ESC
    would clear the operator's screen and retitle the window, a newline would forge a line."""
    conn = sqlite3.connect(sqlite_path(sqlite_url))
    with conn:
        outboxer.enqueue(conn, "order\x1b[2J\x1b]0;owned\x07", {"n": 1}, key="k\nFAKE ABANDONED")
        conn.execute(
            "UPDATE outbox SET status = 'ABANDONED', last_error = ?",
            ("refused \u202egnp.exe\u202c\r\n\x9b31m",),
        )
    conn.close()
    result = cli("messages", "--db", sqlite_url)
    assert result.returncode == 0, result.stderr
    (line,) = result.stdout.splitlines()
    assert not any(ch in line for ch in "\x1b\x07\r\x9b\u202e\u202c")
    assert "order\\x1b[2J\\x1b]0;owned\\x07" in line
    assert "key=k\\x0aFAKE ABANDONED" in line
    assert "refused \\u202egnp.exe\\u202c\\x0d\\x0a\\x9b31m" in line
