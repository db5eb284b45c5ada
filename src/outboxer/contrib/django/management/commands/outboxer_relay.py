"""``manage.py outboxer_relay``: ``outboxer relay`` with the project's settings.

Settings come from ``settings.OUTBOXER`` (see ``outboxer.contrib.django.conf``); the
options here override them for one run. SIGTERM/SIGINT stop it cleanly as they stop the
CLI's, even while it starts.
"""

from __future__ import annotations

import asyncio
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from outboxer.cli import run_relay
from outboxer.contrib.django import conf
from outboxer.contrib.django.management import command_errors, stopped_cleanly


class Command(BaseCommand):
    help = "Publish committed outbox messages to the broker (outboxer relay)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--database", help="alias of the outbox's database")
        parser.add_argument("--broker", help="broker URL of the default destination")
        parser.add_argument("--concurrency", help="loops per destination")
        parser.add_argument("--http", metavar="HOST:PORT", help="serve the HTTP API here")
        parser.add_argument("--relay-id", help="name of this relay in locked_by")
        parser.add_argument(
            "--exit-when-idle", action="store_true", default=None, help="drain, then exit"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        names = ("database", "broker", "concurrency", "http", "relay_id", "exit_when_idle")
        with stopped_cleanly(), command_errors():
            settings = conf.settings_with(**{name: options[name] for name in names})
            asyncio.run(run_relay(settings))
