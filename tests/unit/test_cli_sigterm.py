"""SIGTERM while a daemon command is still starting stops it cleanly (exit 0), as SIGINT does."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from outboxer import cli


@pytest.fixture
def restore_sigterm() -> Iterator[None]:
    before = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, before)


def test_sigterm_before_the_relay_took_the_signal_over_exits_zero(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, restore_sigterm: None
) -> None:
    reached: list[str] = []

    async def starting(settings: object) -> None:
        reached.append("starting")
        os.kill(os.getpid(), signal.SIGTERM)  # before any loop.add_signal_handler
        await asyncio.sleep(5)
        reached.append("not stopped")

    monkeypatch.setattr(cli, "run_relay", starting)
    code = cli.main(["relay", "--db", f"sqlite:///{tmp_path / 'o.db'}", "--broker", "memory://t"])
    assert code == cli.EXIT_OK
    assert reached == ["starting"]


def test_other_commands_keep_the_default_sigterm(
    tmp_path: Path, restore_sigterm: None, capsys: pytest.CaptureFixture[str]
) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    cli.main(["schema", "sql", "--db", f"sqlite:///{tmp_path / 'o.db'}"])
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_ctrl_c_in_a_one_shot_command_is_not_reported_as_success(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A purge or replay cut short may have done part of its work: exit 130, not 0."""

    async def interrupted(args: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_purge", interrupted)
    code = cli.main(["purge", "--all", "--db", f"sqlite:///{tmp_path / 'o.db'}"])
    assert code == cli.EXIT_INTERRUPTED == 130
    assert "outboxer purge: interrupted" in capsys.readouterr().err
