"""``outboxer consume`` and ``outboxer dead-letters``: the consumer runner from the command line.

Settings come, strongest first, from flags, ``OUTBOXER_*`` environment variables and the
settings file, as for the relay. The relay's settings the consumer shares (``db``,
``broker``, ``schema``, ``table``, ``concurrency``, ``max_attempts``, ``backoff_*``,
``abandoned_blocks_key``, ``http``, ``http_token``, ``exit_when_idle``) keep their names;
the consumer's own live in the file's ``[consumer]`` table::

    db = "postgresql://localhost/shipping"
    broker = "amqp://guest:guest@localhost/"

    [consumer]
    group = "shipping"
    topics = ["order.*"]
    handler = "shipping.events:apply"
    options = { queue_type = "quorum" }
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tomllib
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from outboxer.config import (
    DEFAULT_CONFIG_FILE,
    ENV_PREFIX,
    Settings,
    int_option,
    load_settings,
    parse_duration,
)
from outboxer.errors import ConfigError

#: The relay's settings that ``consume`` takes as well (flag names as the relay's).
SHARED = (
    "db",
    "schema",
    "table",
    "broker",
    "concurrency",
    "max_attempts",
    "backoff_base",
    "backoff_multiplier",
    "backoff_max",
    "backoff_jitter",
    "abandoned_blocks_key",
    "exit_when_idle",
    "http",
    "http_token",
)


@dataclass(frozen=True)
class _Setting:
    """One consumer setting: its ``[consumer]`` key (also the flag's dest), environment
    variable, how a text value is read, and its help."""

    name: str
    env: str
    parse: Callable[[object, str], Any]
    help: str


def _text(value: object, name: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{name} must be a non-empty string")
    return value.strip()


def _topics(value: object, name: str) -> list[str]:
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not all(isinstance(t, str) for t in items):
        raise ConfigError(f"{name} must be a list of topic patterns")
    return [topic.strip() for topic in items if topic.strip()]


def _options(value: object, name: str) -> dict[str, str]:
    if isinstance(value, Mapping):
        return {str(k): str(v) for k, v in value.items()}
    pairs = value.split(",") if isinstance(value, str) else value
    options = {}
    for pair in pairs if isinstance(pairs, list | tuple) else []:
        option, sep, text = str(pair).partition("=")
        if not sep or not option:
            raise ConfigError(f"{name} needs NAME=VALUE, got {pair!r}")
        options[option.strip()] = text
    return options


CONSUMER_SETTINGS = (
    _Setting("group", "GROUP", _text, "consumer group: inbox name, queue, durable, group id"),
    _Setting("topics", "TOPICS", _topics, "topic pattern to consume (repeatable)"),
    _Setting("handler", "HANDLER", _text, "module:function called for each message"),
    _Setting(
        "batch",
        "CONSUMER_BATCH",
        lambda v, n: int_option(v, n, 1, 10_000),
        "messages of different keys applied per transaction (default 100)",
    ),
    _Setting(
        "prefetch",
        "PREFETCH",
        lambda v, n: int_option(v, n, 1, 1_000_000),
        "messages held at most, unacked (default 2 x concurrency x batch, at least 100)",
    ),
    _Setting(
        "shutdown_timeout",
        "SHUTDOWN_TIMEOUT",
        parse_duration,
        "seconds handlers in flight get to finish on SIGTERM (default 30)",
    ),
    _Setting(
        "name",
        "CONSUMER_NAME",
        _text,
        "this process's stable name in its group (Redis consumer, MQTT client; default host name)",
    ),
    _Setting("async_driver", "ASYNC_DRIVER", _text, "asyncpg or psycopg, for async handlers"),
    _Setting("options", "CONSUMER_OPTIONS", _options, "receiver option NAME=VALUE (repeatable)"),
)


@dataclass(frozen=True)
class ConsumeSettings:
    settings: Settings
    values: dict[str, Any] = field(default_factory=dict)

    def require(self, name: str) -> Any:
        if self.values.get(name) is None:
            flag = "the handler argument" if name == "handler" else f"--{name}"
            raise ConfigError(
                f"no {name}: pass {flag}, set {ENV_PREFIX}{name.upper()} or [consumer] {name}"
            )
        return self.values[name]


def _config_path(given: str | None, environ: Mapping[str, str]) -> str | None:
    path = given or environ.get(ENV_PREFIX + "CONFIG")
    if path is None and Path(DEFAULT_CONFIG_FILE).is_file():
        return DEFAULT_CONFIG_FILE
    return path


def load_consume_settings(
    flags: Mapping[str, object],
    *,
    environ: Mapping[str, str] | None = None,
    config_file: str | None = None,
) -> ConsumeSettings:
    """The relay's shared settings (``load_settings``) and the consumer's own."""
    environ = os.environ if environ is None else environ
    path = _config_path(config_file, environ)
    table: Mapping[str, Any] = {}
    if path is not None:
        try:
            document = tomllib.loads(Path(path).read_text("utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
        table = dict(document.get("outboxer", document)).get("consumer", {})
        if not isinstance(table, Mapping):
            raise ConfigError(f"{path}: [consumer] must be a table")
        unknown = set(table) - {s.name for s in CONSUMER_SETTINGS}
        if unknown:
            known = sorted(s.name for s in CONSUMER_SETTINGS)
            raise ConfigError(
                f"{path}: unknown [consumer] settings {sorted(unknown)}; known: {known}"
            )
    values: dict[str, Any] = {}
    for setting in CONSUMER_SETTINGS:
        given = flags.get(setting.name)
        if given is not None and given != []:
            values[setting.name] = setting.parse(given, f"--{setting.name.replace('_', '-')}")
        elif environ.get(ENV_PREFIX + setting.env):
            values[setting.name] = setting.parse(
                environ[ENV_PREFIX + setting.env], ENV_PREFIX + setting.env
            )
        elif setting.name in table:
            values[setting.name] = setting.parse(table[setting.name], f"{path}: {setting.name}")
    shared = {name: flags[name] for name in SHARED if flags.get(name) is not None}
    settings = load_settings(shared, environ=environ, config_file=path)
    return ConsumeSettings(settings, values)


# ----- argparse ------------------------------------------------------------------------------


def _database_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--db", help="the consumer's database URL (env OUTBOXER_DB)")
    parser.add_argument(
        "--config", help="TOML settings file (env OUTBOXER_CONFIG; default ./outboxer.toml)"
    )
    parser.add_argument("--schema", help="schema of the inbox and dead letters (default outboxer)")
    parser.add_argument(
        "--table", help="outbox table whose migrations are checked (default outbox)"
    )
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )


def add_commands(commands: Any) -> None:
    """Register ``consume`` and ``dead-letters`` on the ``outboxer`` command's subparsers."""
    consume = commands.add_parser(
        "consume", help="apply a consumer group's messages to your database, once each"
    )
    _database_flags(consume)
    consume.add_argument("handler", nargs="?", help="module:function (env OUTBOXER_HANDLER)")
    consume.add_argument("--broker", help="broker URL (env OUTBOXER_BROKER)")
    consume.add_argument("--group", help="consumer group (env OUTBOXER_GROUP)")
    consume.add_argument(
        "--topic",
        action="append",
        dest="topics",
        metavar="PATTERN",
        help="topic pattern to consume, repeatable (env OUTBOXER_TOPICS, comma-separated)",
    )
    consume.add_argument("--concurrency", help="transactions in parallel (default 4)")
    for setting in CONSUMER_SETTINGS:
        if setting.name in ("group", "topics", "handler"):
            continue
        flag = "--" + setting.name.replace("_", "-")
        if setting.name == "options":
            consume.add_argument(
                "--option", action="append", dest="options", metavar="NAME=VALUE", help=setting.help
            )
        else:
            consume.add_argument(flag, help=f"{setting.help} (env {ENV_PREFIX}{setting.env})")
    consume.add_argument("--max-attempts", help="attempts before a dead letter (default 10)")
    consume.add_argument("--backoff-base", help="first retry delay in seconds (default 1)")
    consume.add_argument("--backoff-multiplier", help="growth per attempt (default 2)")
    consume.add_argument("--backoff-max", help="longest retry delay in seconds (default 300)")
    consume.add_argument("--backoff-jitter", help="± fraction of jitter (default 0.25)")
    consume.add_argument(
        "--abandoned-blocks-key",
        choices=["true", "false"],
        help="hold a key's later messages behind its dead letter (default false)",
    )
    consume.add_argument(
        "--exit-when-idle",
        action="store_const",
        const=True,
        help="stop once the broker has nothing more to deliver",
    )
    consume.add_argument("--http", metavar="HOST:PORT", help="serve /health and /metrics here")
    consume.add_argument("--http-token", metavar="TOKEN", help="bearer token of the API's POSTs")

    letters = commands.add_parser("dead-letters", help="list, replay or purge dead letters")
    actions = letters.add_subparsers(dest="dead_letters_command", required=True)
    listing = actions.add_parser("list", help="the dead letters, oldest first")
    _database_flags(listing)
    listing.add_argument("--group", help="only this consumer group")
    listing.add_argument("--limit", type=int, default=100)
    listing.add_argument("--json", action="store_true", help="machine-readable output")
    replay = actions.add_parser("replay", help="apply dead letters again through the handler")
    _database_flags(replay)
    replay.add_argument("handler", nargs="?", help="module:function (env OUTBOXER_HANDLER)")
    replay.add_argument("--group", help="consumer group (env OUTBOXER_GROUP)")
    replay.add_argument(
        "--id", action="append", dest="ids", help="message id (repeatable); default all"
    )
    replay.add_argument(
        "--abandoned-blocks-key",
        choices=["true", "false"],
        help="a dead letter that fails again holds back its key's later ones (default false)",
    )
    purge = actions.add_parser("purge", help="delete dead letters for good")
    _database_flags(purge)
    purge.add_argument("--group", help="consumer group (env OUTBOXER_GROUP)")
    purge.add_argument("--id", action="append", dest="ids", help="message id (repeatable)")
    purge.add_argument("--all", action="store_true", help="every dead letter of the group")


def _flags(args: argparse.Namespace) -> dict[str, object]:
    names = {*SHARED, *(s.name for s in CONSUMER_SETTINGS)}
    return {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}


def run(args: argparse.Namespace) -> int | None:
    """Run ``args.command`` if it is one of this module's; None otherwise."""
    if args.command == "consume":
        return asyncio.run(_consume(args))
    if args.command == "dead-letters":
        return asyncio.run(_dead_letters(args))
    return None


def _consumer(loaded: ConsumeSettings, **overrides: Any) -> Any:
    from outboxer.consumer import Consumer

    settings, values = loaded.settings, loaded.values
    destination = settings.destinations.get("default")
    options: dict[str, Any] = {}
    if destination is not None:
        options.update(destination.options)
    options.update(values.get("options", {}))
    arguments: dict[str, Any] = {
        "db": settings.require_db(),
        "broker": destination.broker if destination is not None else None,
        "group": loaded.require("group"),
        "handler": loaded.require("handler"),
        "topics": values.get("topics"),
        "concurrency": settings.concurrency,
        "batch": values.get("batch", 100),
        "prefetch": values.get("prefetch"),
        "max_attempts": settings.max_attempts,
        "backoff": settings.backoff,
        "abandoned_blocks_key": settings.abandoned_blocks_key,
        "schema": settings.schema,
        "table": settings.table,
        "shutdown_timeout": values.get("shutdown_timeout", 30.0),
        "name": values.get("name"),
        "broker_options": options,
        "async_driver": values.get("async_driver"),
        "exit_when_idle": settings.exit_when_idle,
    }
    arguments.update(overrides)
    if not arguments["broker"] and "broker" not in overrides:
        raise ConfigError("no broker: pass --broker URL or set OUTBOXER_BROKER")
    return Consumer(**arguments)


def _importable_here() -> None:
    """Handlers are imported like ``python -m`` would: from the current directory too (the
    ``outboxer`` script's own directory is what Python puts first)."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())


async def _consume(args: argparse.Namespace) -> int:
    _importable_here()
    loaded = load_consume_settings(_flags(args), config_file=args.config)
    consumer = _consumer(loaded)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, consumer.stop)
    server = None
    if loaded.settings.http:
        from outboxer.consumer import consumer_metrics
        from outboxer.http import start_http_api

        server = await start_http_api(
            loaded.settings, extra_metrics=lambda: consumer_metrics([consumer])
        )
    try:
        await consumer.run_async()
    finally:
        if server is not None:
            await server.close()
    return 0


async def _dead_letters(args: argparse.Namespace) -> int:
    loaded = load_consume_settings(_flags(args), config_file=args.config)
    action = args.dead_letters_command
    if action == "replay":
        _importable_here()
        consumer = _consumer(loaded, broker=None)  # replaying needs no broker
        counts = await consumer.replay_dead_letters(args.ids)
        print(", ".join(f"{name} {count}" for name, count in counts.items()))
        return 0 if counts["failed"] == 0 else 1
    from outboxer.consumer_db import session_factory

    settings = loaded.settings
    executor = ThreadPoolExecutor(1)
    session = session_factory(
        settings.require_db(), settings.schema, is_async=False, async_driver=None
    )(executor)
    await session.open()
    try:
        if action == "list":
            letters = await session.dead_letters(loaded.values.get("group"), args.limit)
            _print_letters([letter.as_dict() for letter in letters], as_json=args.json)
            return 0
        group = loaded.require("group")
        if args.all == bool(args.ids):
            raise ConfigError("purge needs --id ID (repeatable) or --all, not both")
        from outboxer.consumer import parse_message_id

        if args.all:
            deleted = await session.run("purge_consumer", {"consumer": group})
        else:
            deleted = 0
            for value in args.ids:
                deleted += await session.run(
                    "delete", session.id_params(group, parse_message_id(value))
                )
        print(f"purged {deleted} dead letter(s)")
        return 0
    finally:
        await session.close()
        executor.shutdown(wait=False)


def _print_letters(rows: Sequence[dict[str, Any]], *, as_json: bool) -> None:
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    if not rows:
        print("no dead letters")
    for row in rows:
        state = "held" if row["held"] else f"attempts={row['attempts']}"
        print(
            f"{row['message_id']}  {row['consumer']:<16} {row['topic']:<24} key={row['key']} "
            f"{state} at {row['failed_at']} error={row['error']}"
        )


__all__ = ["CONSUMER_SETTINGS", "ConsumeSettings", "add_commands", "load_consume_settings", "run"]
