"""A guard: every `outboxer` subcommand, given hostile arguments, OUTBOXER_* variables and
outboxer.toml files, answers with a message and exit 0, 1 or 2: never a traceback, never
a Python error's name for bad input, never a password it was given, never a half-written
enqueue. Databases are a real SQLite file; daemons run with --exit-when-idle."""

from __future__ import annotations

import contextlib
import io
import itertools
import logging
import os
import sqlite3
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from outboxer.cli import main

SECRET = "hunter2"
#: Python's own errors: the fallback naming one of these means a bad value slipped past
#: the boundary (a database or broker refusing is a runtime error, exit 1, and allowed).
BUG_SHAPED = (
    "ValueError",
    "TypeError",
    "KeyError",
    "IndexError",
    "AttributeError",
    "OverflowError",
    "RecursionError",
    "UnicodeEncodeError",
    "UnicodeDecodeError",
    "AssertionError",
)

HOSTILE_TEXT = st.sampled_from(
    [
        "",
        " ",
        "-1",
        "0",
        "1.5",
        "nan",
        "NaN",
        "inf",
        "-inf",
        "1e400",
        "1e-320",
        "99999999999999999999999",
        "-5m",
        "9999999999d",
        "1e308s",
        "abc",
        "true",
        "=",
        "a=b",
        "\x00",
        "a\x00b",
        "\x01\n\x7f",
        "\ud800",
        os.fsdecode(b"\xff\xfe"),
        "x" * 5000,
        "not-a-uuid",
        "2024-13-45",
        "99999-01-01",
        "0001-01-01T00:00:00+14:00",
        f"postgresql://app:{SECRET}@127.0.0.1:99999/test",
        f"postgresql://app:{SECRET}@[::1/x",
        f"mysql://root:{SECRET}@127.0.0.1:abc/test",
        f"ftp://u:{SECRET}@h/%zz",
        f"amqp://u:{SECRET}@127.0.0.1:0/%ff",
        "sqlite:///%00",
        "file://\x00",
        "[" * 3000,
    ]
)


def _commands(db: str) -> dict[str, list[str]]:
    """Each subcommand with the arguments that make it run to completion against ``db``."""
    handler = "tests.consumer_handlers:record"
    return {
        "relay": ["relay", "--db", db, "--broker", "memory://clifuzz-r", "--exit-when-idle"],
        "schema apply": ["schema", "apply", "--db", db],
        "schema sql": ["schema", "sql"],
        "status": ["status", "--db", db],
        "cleanup": ["cleanup", "--db", db],
        "messages": ["messages", "--db", db],
        "requeue": ["requeue", "--db", db, "--dry-run"],
        "purge": ["purge", "--db", db, "--dry-run", "--all"],
        "replay": ["replay", "--db", db, "--dry-run", "--all"],
        "enqueue": ["enqueue", "--db", db, "--topic", "t", "--payload", "{}"],
        "keys generate": ["keys", "generate"],
        "keys rotate": ["keys", "rotate", "--db", db],
        "keys shred": ["keys", "shred", "subject"],
        "claim-check sweep": ["claim-check", "sweep", "--db", db],
        "consume": [
            "consume",
            "--db",
            db,
            "--broker",
            "memory://clifuzz-c",
            "--group",
            "g",
            "--exit-when-idle",
            handler,
        ],
        "dead-letters list": ["dead-letters", "list", "--db", db, "--group", "g"],
        "dead-letters purge": ["dead-letters", "purge", "--db", db, "--group", "g"],
        "stream-relay": [
            "stream-relay",
            "--db",
            db,
            "--broker",
            "memory://clifuzz-s",
            "--exit-when-idle",
        ],
    }


FLAGS = [
    "--config",
    "--db",
    "--database",
    "--broker",
    "--schema",
    "--table",
    "--batch-size",
    "--claim-max-bytes",
    "--lock-timeout",
    "--max-attempts",
    "--poll-interval",
    "--backoff-base",
    "--backoff-multiplier",
    "--backoff-jitter",
    "--published-retention",
    "--cleanup-batch",
    "--concurrency",
    "--publish-timeout",
    "--shutdown-timeout",
    "--relay-id",
    "--http",
    "--http-token",
    "--encryption-key-file",
    "--encryption-current-key",
    "--subject-keys",
    "--claim-check-store",
    "--claim-check-threshold",
    "--claim-check-sweep-grace",
    "--rotation-batch",
    "--partition-interval",
    "--partitions-ahead",
    "--limit",
    "--id",
    "--topic",
    "--key",
    "--destination",
    "--older-than",
    "--created-after",
    "--created-before",
    "--error",
    "--to",
    "--payload",
    "--header",
    "--subject",
    "--group",
    "--prefetch",
    "--option",
    "--async-driver",
    "--mode",
    "--retention-days",
    "--bogus-flag",
]
ENV_NAMES = [
    "CONFIG",
    "DB",
    "DATABASES",
    "BROKER",
    "SCHEMA",
    "TABLE",
    "BATCH_SIZE",
    "POLL_INTERVAL",
    "LOCK_TIMEOUT",
    "MAX_ATTEMPTS",
    "BACKOFF_JITTER",
    "PUBLISHED_RETENTION",
    "ENCRYPTION_KEYS",
    "ENCRYPTION_KEY_FILE",
    "CLAIM_CHECK_STORE",
    "HTTP",
    "HTTP_TOKEN",
    "DESTINATIONS",
    "RELAY_ID",
    "EXIT_WHEN_IDLE",
]
TOML_DOCUMENTS = st.sampled_from(
    [
        None,
        "[[[",
        "batch_size = ",
        "batch_size = -1",
        "batch_size = 1e400",
        "batch_size = nan",
        'batch_size = "abc"',
        "poll_interval = inf",
        'poll_interval = "nan"',
        "poll_interval = true",
        "unknown_key = 1",
        "db = 1",
        "db = [1, 2]",
        f'db = "postgresql://app:{SECRET}@127.0.0.1:99999/x"',
        'schema = "\\u0000"',
        "databases = 1",
        "[databases]\na = 1",
        "destinations = 1",
        "[destinations.a]\nbroker = 1",
        "backoff_jitter = 2.0",
        'lock_timeout = "1e400s"',
        "outboxer = 5",
        "[consumer]\nprefetch = -1",
        "exit_when_idle = 'yes'",
    ]
)


#: Flags and variables that take a file or directory name, which an error shows as given so
#: the operator sees which file: a "URL" passed there is a file name, not a credential.
PATH_FLAGS = frozenset({"--config", "--encryption-key-file", "--subject-keys", "--dir"})
PATH_VARIABLES = frozenset({"OUTBOXER_CONFIG", "OUTBOXER_ENCRYPTION_KEY_FILE"})


def _names_a_file_with_the_secret(extra: list[str], environment: dict[str, str]) -> bool:
    flagged = any(
        flag in PATH_FLAGS and SECRET in value for flag, value in itertools.pairwise(extra)
    )
    return flagged or any(SECRET in environment.get(name, "") for name in PATH_VARIABLES)


def _settable(text: str) -> bool:
    """Whether an environment can hold ``text``: no NUL, and bytes the OS can store."""
    try:
        os.fsencode(text)
    except UnicodeEncodeError:
        return False
    return "\x00" not in text


@st.composite
def _invocations(draw: st.DrawFn) -> tuple[str, list[str], dict[str, str], str | None]:
    command = draw(st.sampled_from(sorted(_commands("DB"))))
    extra: list[str] = []
    for _ in range(draw(st.integers(0, 2))):
        flag = draw(st.sampled_from(FLAGS))
        # A flag without its value as well as one with a hostile value.
        extra += (
            [flag] if draw(st.booleans()) and flag != "--config" else [flag, draw(HOSTILE_TEXT)]
        )
    environment: dict[str, str] = {}
    if draw(st.booleans()):
        value = draw(HOSTILE_TEXT.filter(_settable))
        environment["OUTBOXER_" + draw(st.sampled_from(ENV_NAMES))] = value
    return command, extra, environment, draw(TOML_DOCUMENTS)


def _outbox_rows(path: Path) -> int:
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return int(conn.execute("SELECT count(*) FROM outbox").fetchone()[0])


def test_no_hostile_invocation_ends_in_a_traceback_a_python_error_or_a_secret() -> None:
    with tempfile.TemporaryDirectory() as directory:
        database = Path(directory) / "outbox.db"
        db = f"sqlite:///{database}"
        assert main(["schema", "apply", "--db", db]) == 0
        commands = _commands(db)
        root = logging.getLogger()

        @settings(
            max_examples=600,  # ~10 s: a guard; the regressions are test_audit10_clifuzz_bad_input
            derandomize=True,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(_invocations())
        def check(invocation: tuple[str, list[str], dict[str, str], str | None]) -> None:
            command, extra, environment, toml = invocation
            argv = [*commands[command], *extra]
            workdir = Path(tempfile.mkdtemp(dir=directory))
            if toml is not None:
                (workdir / "outboxer.toml").write_text(toml, encoding="utf-8")
            before = _outbox_rows(database)
            out, err = io.StringIO(), io.StringIO()
            handlers = list(root.handlers)
            with pytest.MonkeyPatch.context() as patch:
                patch.chdir(workdir)
                for name in [key for key in os.environ if key.startswith("OUTBOXER_")]:
                    patch.delenv(name)
                for name, value in environment.items():
                    patch.setenv(name, value)
                try:
                    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                        try:
                            code: object = main(argv)
                        except SystemExit as exc:
                            code = exc.code
                finally:
                    # basicConfig keeps the first handler: each run gets its own stderr.
                    root.handlers[:] = handlers
            shown = out.getvalue() + err.getvalue()
            context = f"argv={argv!r} env={environment!r} toml={toml!r}: {err.getvalue()!r}"
            assert code in (0, 1, 2), context
            assert "Traceback" not in shown, context
            if not _names_a_file_with_the_secret(extra, environment):
                assert SECRET not in shown, context
            if code != 0:
                last = err.getvalue().rstrip("\n").rsplit("\n", 1)[-1]
                assert last.startswith("outboxer"), context
                assert not any(f"{name}:" in last for name in BUG_SHAPED), context
                if command == "enqueue":
                    assert _outbox_rows(database) == before, context

        check()
