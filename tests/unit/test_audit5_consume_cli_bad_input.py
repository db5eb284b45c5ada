"""Bad input at `outboxer consume`: a configuration error (exit 2) that says what is wrong.

* `--option NAME=VALUE` naming one of the consumer's own settings (group, topics, prefetch,
  name): before, a TypeError about create_receiver's keyword arguments (exit 1);
* a handler module that raises on import: before, a bare "RuntimeError: ..." (exit 1) that
  did not say it came from the handler's module.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from outboxer.cli import main


@pytest.mark.parametrize("option", ["prefetch=5", "name=worker-2", "group=other", "topics=a"])
def test_an_option_the_consumer_sets_itself_is_a_configuration_error(
    option: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        [
            "consume",
            "--db",
            "sqlite:////nonexistent/never-opened.db",
            "--broker",
            "memory://audit5-options",
            "--group",
            "g",
            "--option",
            option,
            "tests.consumer_handlers:record",
        ]
    )
    error = capsys.readouterr().err
    assert code == 2, error
    assert "configuration error" in error and repr(option.split("=")[0]) in error
    assert "TypeError" not in error and "create_receiver" not in error


@pytest.mark.parametrize(
    ("source", "shown"),
    [
        ("raise RuntimeError('cannot reach postgresql://app:hunter2@db/app')", "RuntimeError"),
        ("def broken(:\n", "SyntaxError"),
    ],
)
def test_a_handler_module_failing_on_import_is_a_configuration_error_naming_it(
    source: str,
    shown: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    name = f"audit5_handler_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    code = main(
        [
            "consume",
            "--db",
            "sqlite:////nonexistent/never-opened.db",
            "--broker",
            "memory://audit5-import",
            "--group",
            "g",
            f"{name}:apply",
        ]
    )
    error = capsys.readouterr().err
    assert code == 2, error
    assert f"handler module {name!r} failed on import: {shown}" in error
    assert "hunter2" not in error and "Traceback" not in error
