"""`outboxer --help`'s summary names every command it has."""

from __future__ import annotations

import argparse

from outboxer.cli import build_parser


def test_the_summary_names_every_command() -> None:
    parser = build_parser()
    [commands] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    summary = " ".join((parser.description or "").split())
    missing = [name for name in commands.choices if name not in summary]
    assert not missing, f"--help's summary does not name {missing}: {summary!r}"
