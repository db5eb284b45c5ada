"""``manage.py outboxer_status [--json]``: ``outboxer status`` for the project's outbox."""

from __future__ import annotations

import contextlib
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from outboxer import cli
from outboxer.contrib.django import conf
from outboxer.contrib.django.management import command_errors


class Command(BaseCommand):
    help = "Counts per status, oldest pending age, retry rate and abandoned messages."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--json", action="store_true", help="print the report as JSON")
        parser.add_argument("--database", help="alias of the outbox's database")

    def handle(self, *args: Any, **options: Any) -> None:
        with command_errors():
            current = conf.settings_with(database=options["database"])
        argv = ["status", "--db", current.require_db(), "--schema", current.schema]
        argv += ["--table", current.table, *(["--json"] if options["json"] else [])]
        with contextlib.redirect_stdout(self.stdout):
            code = cli.main(argv)
        if code:
            raise CommandError(f"outboxer status failed (exit {code})", returncode=code)
