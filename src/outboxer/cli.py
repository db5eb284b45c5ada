"""The ``outboxer`` command: relay, serve, schema, status, cleanup, messages, requeue, enqueue, demo."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import uuid
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, NoReturn

from outboxer import __version__, consume_cli, payload_admin
from outboxer.config import (
    ENV_PREFIX,
    Settings,
    Whole,
    add_flags,
    flags_from_args,
    load_settings,
)
from outboxer.errors import ConfigError, OutboxerError, PayloadError
from outboxer.logjson import JsonFormatter
from outboxer.redact import RedactingFilter, get_logger, redact_text
from outboxer.relay import Relay, cleanup
from outboxer.stores import create_store

logger = get_logger("outboxer.cli")

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
#: ``text`` for people, ``json`` (one object per line, outboxer.logjson) for log shippers.
LOG_FORMATS = ("text", "json")
TEXT_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
STATUSES = ("PENDING", "PROCESSING", "PUBLISHED", "FAILED", "ABANDONED")
#: The most rows ``outboxer messages`` prints at once.
MESSAGES_LIMIT = Whole(1, 10_000)

Command = Callable[[argparse.Namespace], int]


class UsageError(ConfigError):
    """A command's own argument is wrong (``--limit -1``, ``--id junk``): exit 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line (no usage block) and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _asynchronous(
    command: Callable[[argparse.Namespace], Coroutine[Any, Any, int]],
) -> Command:
    def run(args: argparse.Namespace) -> int:
        return asyncio.run(command(args))

    return run


def _add_command(
    commands: argparse._SubParsersAction[_Parser],
    name: str,
    run: Command,
    help: str,
    *,
    settings_of: str | None = None,
) -> _Parser:
    """A subcommand with ``--config``, ``--log-level``, ``--log-format`` and the flags of the
    settings that ``settings_of`` (default ``name``) takes."""
    parser = commands.add_parser(name, help=help, description=help)
    parser.add_argument(
        "--config",
        metavar="FILE",
        help=f"TOML settings file (env {ENV_PREFIX}CONFIG; default ./outboxer.toml if present)",
    )
    parser.add_argument("--log-level", default="INFO", choices=LOG_LEVELS)
    parser.add_argument(
        "--log-format",
        default="text",
        choices=LOG_FORMATS,
        help="json: one JSON object per line (time, level, logger, message, …); default text",
    )
    add_flags(parser, Settings, settings_of or name)
    parser.set_defaults(func=run)
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="outboxer", description=__doc__)
    parser.add_argument("--version", action="version", version=f"outboxer {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    _add_command(commands, "relay", _asynchronous(_relay), "publish committed outbox messages")
    _add_command(
        commands,
        "serve",
        _asynchronous(_serve),
        "the HTTP API without a relay (health, metrics, status, requeue)",
    )

    schema = commands.add_parser("schema", help="create, upgrade or print the outbox schema")
    schema_commands = schema.add_subparsers(dest="schema_command", required=True)
    _add_command(
        schema_commands,
        "apply",
        _asynchronous(_schema_apply),
        "create or upgrade the schema (idempotent)",
        settings_of="schema apply",
    )
    sql = _add_command(
        schema_commands,
        "sql",
        _schema_sql,
        "print the DDL for your own migration tool",
        settings_of="schema sql",
    )
    sql.add_argument(
        "--dialect",
        choices=sorted(_DIALECT_URLS),
        help="print for this database (default: from --db, else postgres)",
    )

    status = _add_command(
        commands,
        "status",
        _asynchronous(_status),
        "counts per status, oldest pending age, retry rate",
    )
    status.add_argument("--json", action="store_true", help="machine-readable output")

    _add_command(
        commands,
        "cleanup",
        _asynchronous(_cleanup),
        "delete finished messages past their retention",
    )

    messages = _add_command(
        commands,
        "messages",
        _asynchronous(_messages),
        "list messages in a status (default ABANDONED)",
    )
    messages.add_argument("--status", action="append", choices=STATUSES)
    messages.add_argument(
        "--limit",
        default="50",
        metavar="N",
        help=f"the most messages to list ({MESSAGES_LIMIT.allowed()}; default 50)",
    )
    messages.add_argument("--json", action="store_true", help="machine-readable output")

    requeue = _add_command(
        commands,
        "requeue",
        _asynchronous(_requeue),
        "make ABANDONED (or FAILED) messages PENDING again",
    )
    requeue.add_argument(
        "--id",
        action="append",
        dest="ids",
        metavar="UUID",
        help="message id (repeatable); default: all",
    )
    requeue.add_argument("--status", action="append", choices=["ABANDONED", "FAILED"])
    requeue.add_argument("--destination", action="append", help="default: every configured one")

    enqueue = _add_command(
        commands, "enqueue", _enqueue, "add one message (in its own transaction)"
    )
    enqueue.add_argument("--topic", required=True)
    enqueue.add_argument("--key")
    enqueue.add_argument("--payload", required=True, help="JSON text; with --text, sent as text")
    enqueue.add_argument("--text", action="store_true")
    enqueue.add_argument("--header", action="append", default=[], metavar="NAME=VALUE")
    enqueue.add_argument("--destination", action="append")
    enqueue.add_argument(
        "--subject", help="encrypt under this subject's own key (needs encryption keys)"
    )

    keys = commands.add_parser("keys", help="encryption keys: generate, rotate, shred")
    keys_commands = keys.add_subparsers(dest="keys_command", required=True, metavar="COMMAND")
    generate = _add_command(
        keys_commands,
        "generate",
        _keys_generate,
        "print a new random AES-256 key (base64)",
        settings_of="keys generate",
    )
    generate.add_argument(
        "--id", metavar="KEY_ID", help="print KEY_ID=key, an entry of OUTBOXER_ENCRYPTION_KEYS"
    )
    _add_command(
        keys_commands,
        "rotate",
        _keys_rotate,
        "re-encrypt unfinished messages under the current key, in bounded batches",
        settings_of="keys rotate",
    )
    shred = _add_command(
        keys_commands,
        "shred",
        _keys_shred,
        "delete a subject's key: its messages can never be decrypted again",
        settings_of="keys shred",
    )
    shred.add_argument("subject", metavar="SUBJECT")

    claim_check = commands.add_parser("claim-check", help="the claim-check object store")
    claim_check_commands = claim_check.add_subparsers(
        dest="claim_check_command", required=True, metavar="COMMAND"
    )
    _add_command(
        claim_check_commands,
        "sweep",
        _claim_check_sweep,
        "delete objects no row refers to (from rolled-back enqueues), older than the grace",
        settings_of="claim-check sweep",
    )

    demo = commands.add_parser(
        "demo", help="the pattern end to end on SQLite and a JSON-lines file"
    )
    demo.add_argument("--dir", default="outboxer-demo", help="where the demo writes its files")
    demo.add_argument("--log-level", default="WARNING", choices=LOG_LEVELS)
    demo.set_defaults(func=_demo)
    consume_cli.add_commands(commands, _add_command)  # consume, dead-letters
    return parser


#: A URL of each dialect, for printing its DDL without a database.
_DIALECT_URLS = {
    "postgres": "postgresql://localhost/",
    "sqlite": "sqlite:///outboxer.db",
    "mysql": "mysql://localhost/outboxer",
}


def _settings(args: argparse.Namespace) -> Settings:
    return load_settings(flags_from_args(args, Settings), config_file=args.config)


def _store(settings: Settings) -> Any:
    return create_store(settings.require_db(), schema=settings.schema, table=settings.table)


async def _relay(args: argparse.Namespace) -> int:
    await run_relay(_settings(args))
    return EXIT_OK


async def run_relay(settings: Settings) -> None:
    """``outboxer relay``: the relay and, with ``settings.http``, its HTTP API, until SIGTERM."""
    relay = Relay.from_settings(settings)
    server = None
    if settings.http:
        from outboxer.http import start_http_api

        server = await start_http_api(settings, relay)
    relay.install_signal_handlers()
    try:
        await relay.run()
    finally:
        if server is not None:
            await server.close()


async def _serve(args: argparse.Namespace) -> int:
    from outboxer.http import serve

    await serve(_settings(args))
    return EXIT_OK


async def _schema_apply(args: argparse.Namespace) -> int:
    async with _store(_settings(args)) as store:
        applied = await store.apply_schema()
    print(f"applied: {', '.join(applied)}" if applied else "schema is up to date")
    return EXIT_OK


def _schema_sql(args: argparse.Namespace) -> int:
    settings = _settings(args)
    store = create_store(
        settings.db or _DIALECT_URLS[args.dialect or "postgres"],
        schema=settings.schema,
        table=settings.table,
    )
    if args.dialect and store.dialect != args.dialect:
        store = create_store(
            _DIALECT_URLS[args.dialect], schema=settings.schema, table=settings.table
        )
    print(store.schema_sql(), end="")
    return EXIT_OK


def _format_age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.1f}s"


async def _status(args: argparse.Namespace) -> int:
    async with _store(_settings(args)) as store:
        report = await store.status_report()
    if args.json:
        print(json.dumps(report, indent=2))
        return EXIT_OK
    if not report["destinations"]:
        print("the outbox is empty")
    for entry in report["destinations"]:
        counts: dict[str, int] = entry["counts"]
        print(f"destination {entry['destination']}:")
        for status in ("PENDING", "PROCESSING", "FAILED", "PUBLISHED", "ABANDONED"):
            print(f"  {status:<11} {counts.get(status, 0):>10}")
        print(f"  oldest pending  {_format_age(entry['oldest_pending_age_seconds'])}")
        print(f"  retry rate      {float(entry['retry_rate']) * 100:.1f}%")
        print(f"  abandoned       {entry['abandoned']}")
    if lag := report["oldest_transaction_age_seconds"]:
        print(f"oldest open writing transaction: {_format_age(lag)}")
    return EXIT_OK


async def _cleanup(args: argparse.Namespace) -> int:
    settings = _settings(args)
    async with _store(settings) as store:
        deleted = await cleanup(store, settings, max_batches=1_000_000)
    print(f"deleted {deleted} finished message(s)")
    return EXIT_OK


async def _messages(args: argparse.Namespace) -> int:
    limit = _usage(MESSAGES_LIMIT.parse, args.limit, "--limit")
    async with _store(_settings(args)) as store:
        rows = await store.list_messages(args.status or ["ABANDONED"], limit)
    if args.json:
        print(json.dumps(rows, default=str, indent=2))
    else:
        for row in rows:
            print(
                f"{row['id']}  {row['status']:<10} {row['destination']:<10} {row['topic']:<24} "
                f"key={row['key']} attempts={row['attempts']} error={row['last_error']}"
            )
    return EXIT_OK


def _message_id(text: str, name: str) -> str:
    try:
        return str(uuid.UUID(text))
    except ValueError:
        raise UsageError(f"{name} {text!r} is not a message id (a UUID)") from None


async def _requeue(args: argparse.Namespace) -> int:
    ids = [_message_id(text, "--id") for text in args.ids] if args.ids else None
    settings = _settings(args)
    destinations = args.destination or settings.destination_names
    async with _store(settings) as store:
        count = await store.requeue(destinations, args.status or ["ABANDONED"], ids)
    print(f"requeued {count} message(s)")
    return EXIT_OK


def _usage(parse: Callable[[object, str], Any], value: object, name: str) -> Any:
    """``parse(value, name)``, its ConfigError a UsageError."""
    try:
        return parse(value, name)
    except ConfigError as exc:
        raise UsageError(str(exc)) from None


def _enqueue(args: argparse.Namespace) -> int:
    payload: object = args.payload
    if not args.text:
        try:
            payload = json.loads(args.payload)
        except json.JSONDecodeError as exc:
            raise UsageError(
                f"--payload is not JSON ({exc}); pass --text to send it as text"
            ) from None
    headers = {}
    for item in args.header:
        name, sep, value = item.partition("=")
        if not sep:
            raise UsageError(f"--header needs NAME=VALUE, got {item!r}")
        headers[name] = value
    settings = _settings(args)
    outbox = payload_admin.outbox(settings)
    conn = payload_admin.connect(settings.require_db())
    try:  # the CLI owns this transaction: it commits on success
        message = outbox.enqueue(
            conn,
            args.topic,
            payload,
            key=args.key,
            headers=headers,
            destinations=args.destination,
            subject=args.subject,
        )
        conn.commit()
    finally:
        conn.close()
    print(message.id)
    return EXIT_OK


def _keys_generate(args: argparse.Namespace) -> int:
    from outboxer.crypto import check_key_id, generate_key

    key = generate_key()
    if args.id is None:
        print(key)
        return EXIT_OK
    print(f"{_usage(lambda value, _: check_key_id(value), args.id, '--id')}={key}")
    return EXIT_OK


def _keys_rotate(args: argparse.Namespace) -> int:
    settings = _settings(args)
    ring = payload_admin.require_keyring(settings)
    claim_check = payload_admin.claim_check(settings)

    def progress(done: payload_admin.RotationResult) -> None:
        logger.info("re-encrypted %d message(s) so far", done.rotated)

    try:
        with payload_admin.payload_table(
            settings.require_db(), schema=settings.schema, table=settings.table
        ) as table:
            result = table.rotate(
                ring, batch=settings.rotation_batch, claim_check=claim_check, progress=progress
            )
    finally:
        if claim_check is not None:
            claim_check.store.close()
    print(f"re-encrypted {result.rotated} message(s) under key {ring.current_key_id}")
    if result.skipped:
        print(f"{result.skipped} message(s) were claimed or re-keyed meanwhile: run it again")
    if result.shredded:
        print(f"{result.shredded} message(s) of shredded subjects stay unreadable")
    for failure in result.failed:
        _fail(f"outboxer keys rotate: cannot re-encrypt message {failure}")
    return EXIT_ERROR if result.failed else EXIT_OK


def _keys_shred(args: argparse.Namespace) -> int:
    from pathlib import Path

    from outboxer.crypto import FileSubjectKeys, check_subject

    settings = _settings(args)
    subject = check_subject(args.subject)
    if not settings.subject_keys:
        raise ConfigError("keys shred needs subject_keys (OUTBOXER_SUBJECT_KEYS): the directory")
    if not Path(settings.subject_keys).is_dir():
        raise ConfigError(f"subject_keys {settings.subject_keys!r} is not a directory")
    if FileSubjectKeys(settings.subject_keys).delete(subject):
        print(f"shredded subject {subject!r}: its messages can never be decrypted again")
    else:
        print(f"subject {subject!r} has no key (never made, or shredded before)")
    return EXIT_OK


def _claim_check_sweep(args: argparse.Namespace) -> int:
    deleted = payload_admin.sweep_claim_checks(_settings(args))
    if deleted is None:
        raise ConfigError("claim-check sweep needs claim_check_store (OUTBOXER_CLAIM_CHECK_STORE)")
    print(f"deleted {deleted} orphaned claim-check object(s)")
    return EXIT_OK


def _demo(args: argparse.Namespace) -> int:
    from outboxer.demo import run_demo

    return run_demo(args.dir)


def _fail(text: str) -> None:
    """``text`` on one line of stderr, secrets masked (driver messages span several lines)."""
    print(redact_text(" ".join(line.strip() for line in text.splitlines())), file=sys.stderr)


def _configure_logging(level: str, log_format: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_LOG_FORMAT)
    )
    logging.basicConfig(level=getattr(logging, level), handlers=[handler])
    # Drivers log too (aio-pika, asyncpg, httpx): their lines pass the same redaction.
    redacting = RedactingFilter()
    for root_handler in logging.getLogger().handlers:
        root_handler.addFilter(redacting)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _configure_logging(args.log_level, getattr(args, "log_format", "text"))
    run: Command = args.func
    try:
        return run(args)
    except (UsageError, PayloadError) as exc:  # PayloadError: enqueue's check of --topic …
        _fail(f"outboxer {args.command}: {exc}")
        return EXIT_USAGE
    except ConfigError as exc:
        _fail(f"outboxer: configuration error: {exc}")
        return EXIT_USAGE
    except OutboxerError as exc:
        _fail(f"outboxer: {exc}")
        return EXIT_ERROR
    except KeyboardInterrupt:
        return EXIT_OK
    except Exception as exc:  # a database that refuses, a disk that is full, or a bug
        logger.debug("outboxer %s failed", args.command, exc_info=True)
        _fail(
            f"outboxer: {type(exc).__name__}: {exc} (run with --log-level DEBUG for the traceback)"
        )
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
