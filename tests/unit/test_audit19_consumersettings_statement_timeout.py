"""``statement_timeout`` is a declared consumer setting like ``handler_timeout``: a
``Consumer(statement_timeout=...)`` keyword checked at construction, and ``outboxer consume
--statement-timeout``, ``OUTBOXER_CONSUMER_STATEMENT_TIMEOUT`` and ``[consumer]
statement_timeout`` (strongest first) reaching ``Consumer.statement_timeout``, for
``dead-letters replay`` too. Before, it was an attribute to set after construction, checked
only when the first session was made; the command line could not set it."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from outboxer.cli import build_parser, main
from outboxer.consume_cli import _load, build_consumer
from outboxer.consumer import Consumer
from outboxer.errors import ConfigError
from outboxer.receivers.base import Delivery
from outboxer.stores.mysql import STATEMENT_TIMEOUT

HANDLER = f"{__name__}:handler"
VARIABLE = "OUTBOXER_CONSUMER_STATEMENT_TIMEOUT"


def handler(message: Delivery, conn: Any) -> None:
    """The handler the commands below name."""


def _consumer(tmp_path: Path, **kwargs: Any) -> Consumer:
    return Consumer(
        db=f"sqlite:///{tmp_path / 'c.db'}",
        broker="memory://audit19",
        group="g",
        handler=handler,
        **kwargs,
    )


@pytest.mark.parametrize(
    "bad", [0, 0.0, -1, -0.5, math.nan, math.inf, -math.inf, True, False, "30"]
)
def test_a_bad_statement_timeout_is_refused_at_construction(tmp_path: Path, bad: object) -> None:
    with pytest.raises(ConfigError, match="statement_timeout must be a positive number"):
        _consumer(tmp_path, statement_timeout=bad)


@pytest.mark.parametrize(("given", "kept"), [(None, None), (0.25, 0.25), (3, 3.0)])
def test_the_keyword_is_the_bound_of_every_session(
    tmp_path: Path, given: float | None, kept: float | None
) -> None:
    consumer = _consumer(tmp_path, statement_timeout=given)
    assert consumer.statement_timeout == kept
    with ThreadPoolExecutor(1) as threads:
        assert consumer._new_session(threads).statement_timeout == kept


def test_the_attribute_still_sets_it_and_is_still_checked_when_a_session_is_made(
    tmp_path: Path,
) -> None:
    consumer = _consumer(tmp_path)
    assert consumer.statement_timeout == STATEMENT_TIMEOUT
    with ThreadPoolExecutor(1) as threads:
        consumer.statement_timeout = 0.75
        assert consumer._new_session(threads).statement_timeout == 0.75
        consumer.statement_timeout = True  # not one second
        with pytest.raises(ConfigError, match="statement_timeout"):
            consumer._new_session(threads)


# ----- the command line: the real parser and settings loader --------------------------------


@pytest.fixture
def environ(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in (VARIABLE, "OUTBOXER_CONFIG", "OUTBOXER_DB", "OUTBOXER_BROKER"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _built(tmp_path: Path, *argv: str, command: tuple[str, ...] = ("consume",)) -> Consumer:
    """The Consumer ``outboxer COMMAND ARGV`` builds (its settings file in ``tmp_path``)."""
    args = build_parser().parse_args(
        [
            *command,
            "--config",
            str(tmp_path / "outboxer.toml"),
            "--db",
            f"sqlite:///{tmp_path / 'c.db'}",
            "--group",
            "g",
            *argv,
            HANDLER,
        ]
    )
    settings, own = _load(args)
    if command == ("consume",):
        return build_consumer(settings, own, broker="memory://audit19")
    return build_consumer(settings, own, broker=None)


def test_flag_beats_variable_beats_the_consumer_table_beats_the_default(
    tmp_path: Path, environ: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "outboxer.toml"
    config.write_text("")
    assert _built(tmp_path).statement_timeout == STATEMENT_TIMEOUT
    config.write_text('[consumer]\nstatement_timeout = "2s"\n')
    assert _built(tmp_path).statement_timeout == 2.0
    environ.setenv(VARIABLE, "1500ms")
    assert _built(tmp_path).statement_timeout == 1.5
    assert _built(tmp_path, "--statement-timeout", "250ms").statement_timeout == 0.25
    assert _built(tmp_path, "--statement-timeout", "0.5").statement_timeout == 0.5
    assert _built(tmp_path, "--statement-timeout", "5m").statement_timeout == 300.0


def test_dead_letters_replay_takes_it_too(tmp_path: Path, environ: pytest.MonkeyPatch) -> None:
    (tmp_path / "outboxer.toml").write_text("[consumer]\nstatement_timeout = 3\n")
    replaying = ("dead-letters", "replay")
    assert _built(tmp_path, command=replaying).statement_timeout == 3.0
    built = _built(tmp_path, "--statement-timeout", "4s", command=replaying)
    assert built.statement_timeout == 4.0


@pytest.mark.parametrize(
    ("where", "value", "message"),
    [
        ("flag", "0", "--statement-timeout must be greater than zero"),
        ("flag", "nan", "--statement-timeout must be a duration"),
        ("flag", "31d", "--statement-timeout must be at most 30d"),
        ("variable", "-1", f"{VARIABLE} must be a duration"),
        ("variable", "0.1ms", f"{VARIABLE} must be at least 1ms"),
        ("file", "true", "[consumer]: statement_timeout must be a duration, not a boolean"),
        ("file", "0", "[consumer]: statement_timeout must be greater than zero"),
        ("file", "inf", "[consumer]: statement_timeout must be a finite duration"),
    ],
)
def test_a_bad_value_is_a_usage_error_naming_where_it_was_written(
    tmp_path: Path,
    environ: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    where: str,
    value: str,
    message: str,
) -> None:
    config = tmp_path / "outboxer.toml"
    config.write_text(f"[consumer]\nstatement_timeout = {value}\n" if where == "file" else "")
    if where == "variable":
        environ.setenv(VARIABLE, value)
    flags = ["--statement-timeout", value] if where == "flag" else []
    code = main(
        [
            "consume",
            "--config",
            str(config),
            "--db",
            f"sqlite:///{tmp_path / 'c.db'}",
            "--broker",
            "memory://audit19",
            "--group",
            "g",
            *flags,
            HANDLER,
        ]
    )
    assert code == 2
    assert message in capsys.readouterr().err
