"""``manage.py outboxer_consume [module:function]``: ``outboxer consume`` on Django's connection.

Settings come from ``settings.OUTBOXER`` (``OUTBOXER["consumer"]`` holds the group, the
handler, the topics …, as ``outboxer.toml``'s ``[consumer]`` table does) and the options
here override them for one run; they are the flags of ``outboxer consume``, but the
database's, which is Django's (``--database`` names the alias). The handler runs on that
alias's Django connection inside ``transaction.atomic()``, with the inbox claim: see
``outboxer.contrib.django.consumer``. SIGTERM/SIGINT stop it cleanly as they stop the
CLI's, even while it starts.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from outboxer.config import Settings, add_flags, flags_from_args
from outboxer.consume_cli import ConsumerSettings, run_consumer
from outboxer.consumer import ConsumerStats
from outboxer.contrib.django import conf
from outboxer.contrib.django.consumer import django_consumer
from outboxer.contrib.django.management import command_errors, stopped_cleanly
from outboxer.errors import ConfigError

#: Django's connection of the alias replaces these (``--database`` names the alias, not
#: one of outboxer's databases), and its handlers are sync: no async driver to choose.
LEFT_OUT = ("db", "database", "schema", "table", "async_driver")


class Command(BaseCommand):
    help = "Apply a consumer group's messages with a handler on Django's connection, once each."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--database", help="alias of the database with the inbox")
        add_flags(parser, ConsumerSettings, "consume", leave_out=LEFT_OUT)
        add_flags(parser, Settings, "consume", leave_out=LEFT_OUT)
        parser.add_argument(
            "handler_argument",
            nargs="?",
            metavar="module:function",
            help='the handler (or --handler, OUTBOXER["consumer"]["handler"])',
        )

    def handle(self, *args: Any, **options: Any) -> None:
        given = argparse.Namespace(**options)
        consumer_flags = flags_from_args(given, ConsumerSettings)
        stats: ConsumerStats | None = None  # None: stopped before it ran
        with stopped_cleanly(), command_errors():
            if options["handler_argument"] is not None:
                if "handler" in consumer_flags:
                    raise ConfigError("give the handler once: as the argument or as --handler")
                consumer_flags["handler"] = options["handler_argument"]
            alias = options["database"] or conf.database_alias()
            shared = flags_from_args(given, Settings)
            shared = {name: value for name, value in shared.items() if name not in LEFT_OUT}
            settings = conf.settings_with(database=alias, **shared)
            consumer = django_consumer(settings, conf.consumer_settings(**consumer_flags), alias)
            stats = asyncio.run(run_consumer(consumer, settings))
        if stats is not None and options["verbosity"] >= 1:
            self.stdout.write(
                f"consumer {consumer.group}: applied {stats.applied}, duplicates "
                f"{stats.duplicates}, dead letters {stats.dead_lettered}, failed attempts "
                f"{stats.failed}"
            )
