"""The ``outboxer`` command: relay, serve, schema, status, cleanup, messages, requeue, purge,
replay, enqueue, keys, claim-check, demo, consume, dead-letters and stream-relay."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import select
import signal
import sqlite3
import sys
import uuid
from collections.abc import Callable, Coroutine, Iterator, Sequence
from typing import Any, NoReturn

from outboxer import __version__, admin, consume_cli, payload_admin, stream_cli
from outboxer.config import (
    ENV_PREFIX,
    Settings,
    Whole,
    add_flags,
    flags_from_args,
    load_settings,
)
from outboxer.errors import AdminRequestError, ConfigError, OutboxerError, PayloadError
from outboxer.logjson import JsonFormatter
from outboxer.malloc import tune_malloc
from outboxer.redact import RedactingFilter, TextFormatter, get_logger, printable, redact_text
from outboxer.relay import cleanup
from outboxer.relay_group import RelayGroup
from outboxer.stores import create_store

logger = get_logger("outboxer.cli")

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
#: A shell's status for a process that wrote to a pipe nobody reads (128 + SIGPIPE).
EXIT_BROKEN_PIPE = 141
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
        # argparse quotes the offending argument as given: a mistyped --db URL may carry a
        # password, and a control character or newline would break the one-line message.
        shown = printable(redact_text(message))
        self.exit(EXIT_USAGE, f"{self.prog}: {shown} (see {self.prog} --help)\n")


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
        "the HTTP API without a relay (health, metrics, status, requeue, purge, replay)",
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
    _add_command(
        schema_commands,
        "migrate-partitioned",
        _asynchronous(_schema_migrate_partitioned),
        "move the default outbox table to the partitioned layout, in one transaction "
        "(PostgreSQL; stop the relays first: README, Partitioned outbox)",
        settings_of="schema migrate-partitioned",
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
        "make ABANDONED (or FAILED) messages PENDING again, due now, attempts reset",
    )
    _add_filter_flags(
        requeue,
        statuses=admin.REQUEUEABLE,
        status_help="default ABANDONED",
        destination_help="default: every configured one",
    )

    purge = _add_command(
        commands,
        "purge",
        _asynchronous(_purge),
        "delete the messages a filter matches (never PROCESSING ones), in one transaction",
    )
    _add_filter_flags(
        purge,
        statuses=STATUSES,
        status_help="default every status but PROCESSING, which a relay holds and purge refuses",
        everything="purge every message: the only way without a filter",
    )

    replay = _add_command(
        commands,
        "replay",
        _asynchronous(_replay),
        "copy PUBLISHED messages as new PENDING ones (header replay-of), in one transaction",
    )
    _add_filter_flags(
        replay,
        destination_help="the originals' destination",
        everything="replay every PUBLISHED message: the only way without a filter",
    )
    replay.add_argument(
        "--to",
        metavar="DESTINATION",
        help="the copies' destination, a configured one; default: each original's own",
    )

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

    keys = commands.add_parser("keys", help="encryption keys: generate, rotate, usage, shred")
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
    usage = _add_command(
        keys_commands,
        "usage",
        _keys_usage,
        "count the stored messages under each key id, in every table that can hold them "
        "(read-only); with --retiring, exit 1 while that key is still needed",
        settings_of="keys usage",
    )
    usage.add_argument(
        "--retiring",
        action="append",
        default=[],
        metavar="KEY_ID",
        help="a key to take out of the ring: exit 1, naming where, while a stored message "
        "is under it (repeatable)",
    )
    usage.add_argument("--json", action="store_true", help="machine-readable output")
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
    stream_cli.add_commands(commands, _add_command)  # stream-relay (log and WAL modes)
    return parser


def _add_filter_flags(
    parser: argparse.ArgumentParser,
    *,
    statuses: Sequence[str] = (),
    status_help: str = "",
    destination_help: str = "",
    everything: str | None = None,
) -> None:
    """The flags of an admin.MessageFilter (criteria combine with AND, repeats with OR),
    and --dry-run."""
    parser.add_argument(
        "--id", action="append", dest="ids", metavar="UUID", help="message id (repeatable)"
    )
    parser.add_argument(
        "--topic", action="append", dest="topics", metavar="TOPIC", help="(repeatable)"
    )
    parser.add_argument("--key", action="append", dest="keys", metavar="KEY", help="(repeatable)")
    parser.add_argument(
        "--destination", action="append", help=f"(repeatable) {destination_help}".strip()
    )
    if statuses:
        parser.add_argument(
            "--status", action="append", choices=statuses, help=f"(repeatable) {status_help}"
        )
    parser.add_argument(
        "--older-than", metavar="DURATION", help="created longer ago than this (90m, 7d, …)"
    )
    parser.add_argument(
        "--created-after", metavar="TIME", help="created at or after this ISO 8601 time (UTC)"
    )
    parser.add_argument(
        "--created-before", metavar="TIME", help="created before this ISO 8601 time (UTC)"
    )
    parser.add_argument(
        "--error", metavar="TEXT", help="last error contains this text (case-sensitive)"
    )
    if everything is not None:
        parser.add_argument("--all", action="store_true", dest="everything", help=everything)
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print how many messages it would change; change none",
    )


def _message_filter(args: argparse.Namespace) -> admin.MessageFilter:
    """The filter the flags describe; AdminRequestError (exit 2) naming a bad flag."""

    def listed(values: list[str] | None) -> tuple[str, ...] | None:
        return tuple(values) if values else None

    return admin.MessageFilter(
        ids=tuple(uuid.UUID(_message_id(text, "--id")) for text in args.ids) if args.ids else None,
        topics=listed(args.topics),
        keys=listed(args.keys),
        destinations=listed(args.destination),
        statuses=listed(getattr(args, "status", None)),
        older_than=(
            admin.parse_age(args.older_than, "--older-than")
            if args.older_than is not None
            else None
        ),
        created_after=(
            admin.parse_time(args.created_after, "--created-after")
            if args.created_after is not None
            else None
        ),
        created_before=(
            admin.parse_time(args.created_before, "--created-before")
            if args.created_before is not None
            else None
        ),
        error=args.error,
    )


def _report(result: admin.AdminResult, heading: str = "") -> int:
    for line in result.lines():
        # A dry run names the destinations found in the table: an application's text.
        print(printable(f"{heading}{line}"))
    return EXIT_OK


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
    """``outboxer relay``: the relay of each database and, with ``settings.http``, the HTTP
    API, until SIGTERM."""
    relays = RelayGroup.from_settings(settings)
    server = None
    if settings.http:
        from outboxer.http import start_http_api

        server = await start_http_api(settings, relays)
    relays.install_signal_handlers()
    try:
        await relays.run()
    finally:
        if server is not None:
            await server.close()


def _databases(settings: Settings) -> dict[str, Settings]:
    """The settings of each database a command works on (one, unless several are named)."""
    return settings.database_settings()


class PartlyDoneError(OutboxerError):
    """A command over several databases failed on one after earlier ones were done (each
    commits on its own): exit 1, naming the database, whatever the error's own kind."""


@contextlib.contextmanager
def _each_database(settings: Settings, name: str, done: list[str]) -> Iterator[None]:
    """Runs one database's part of a command over several; a failure once earlier ones are
    done says which failed and which are done, so a script does not read exit 2 ("nothing
    done") or a bare error as the whole command's outcome."""
    try:
        yield
    except Exception as exc:
        if not done:
            raise
        raise PartlyDoneError(
            f"database {name}: {redact_text(f'{type(exc).__name__}: {exc}')}; done before it:"
            f" {', '.join(done)} (see above)"
        ) from exc
    done.append(name)


def _heading(settings: Settings, name: str) -> str:
    """``database NAME: `` before a line about one of several databases; else nothing."""
    return f"database {name}: " if settings.several_databases else ""


async def _serve(args: argparse.Namespace) -> int:
    from outboxer.http import serve

    await serve(_settings(args))
    return EXIT_OK


async def _schema_apply(args: argparse.Namespace) -> int:
    settings = _settings(args)
    for name, own in _databases(settings).items():
        store = _store(own)
        partitions: list[Any] = []
        if store.dialect != "postgres":
            if settings.partitioned:
                raise ConfigError(f"--partitioned needs PostgreSQL; --db is {store.dialect}")
            async with store:
                applied = await store.apply_schema()
        else:
            async with store:
                applied = await store.apply_schema(
                    partitioned=settings.partitioned,
                    partition_interval=settings.partition_interval,
                    partitions_ahead=settings.partitions_ahead,
                )
                partitions = await store.partitions()
        if partitions:
            print(
                _heading(settings, name)
                + f"partitioned by created_at: {len(partitions) - 1} partition(s) and a default"
            )
        print(
            _heading(settings, name)
            + (f"applied: {', '.join(applied)}" if applied else "schema is up to date")
        )
    return EXIT_OK


async def _schema_migrate_partitioned(args: argparse.Namespace) -> int:
    settings = _settings(args)
    store = _store(settings)
    if store.dialect != "postgres":
        raise ConfigError(f"the partitioned outbox needs PostgreSQL; --db is {store.dialect}")
    report = await store.migrate_to_partitioned(
        partition_interval=settings.partition_interval,
        partitions_ahead=settings.partitions_ahead,
    )
    print(
        f"{settings.schema}.{settings.table} is partitioned by created_at: moved "
        f"{report.moved} unfinished or abandoned message(s); the PUBLISHED history stays in "
        f"{settings.schema}.{report.kept_as} (drop it once past retention)"
    )
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
    print(store.schema_sql(partitioned=settings.partitioned), end="")
    return EXIT_OK


def _format_age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.1f}s"


async def _status(args: argparse.Namespace) -> int:
    settings = _settings(args)
    if not settings.several_databases:
        async with _store(settings) as store:
            report = await store.status_report()
        if args.json:
            print(json.dumps(report, indent=2))
        else:
            _print_status(report, "")
        return EXIT_OK
    # One section per database; one that does not answer says why, and the others still show.
    reports: dict[str, dict[str, Any]] = {}
    for name, own in _databases(settings).items():
        try:
            async with _store(own) as store:
                reports[name] = await store.status_report()
        except (OSError, OutboxerError) as exc:  # unreachable, refused, or no such table
            reports[name] = {"error": redact_text(str(exc) or type(exc).__name__)}
        except Exception as exc:  # noqa: BLE001 -- a driver's own error: the database failed
            reports[name] = {"error": redact_text(f"{type(exc).__name__}: {exc}")}
    if args.json:
        print(json.dumps({"databases": reports}, indent=2))
    else:
        for name, report in reports.items():
            print(f"database {name}:")
            if "error" in report:
                print(f"  unavailable: {printable(report['error'])}")
            else:
                _print_status(report, "  ")
    return EXIT_ERROR if any("error" in report for report in reports.values()) else EXIT_OK


def _print_status(report: dict[str, Any], indent: str) -> None:
    if not report["destinations"]:
        print(f"{indent}the outbox is empty")
    for entry in report["destinations"]:
        counts: dict[str, int] = entry["counts"]
        # An application's name for it, as stored: any text but a NUL.
        print(f"{indent}destination {printable(entry['destination'])}:")
        for status in ("PENDING", "PROCESSING", "FAILED", "PUBLISHED", "ABANDONED"):
            if status == "PUBLISHED" and entry.get("published_estimated"):
                # A big table: an estimate (the other counts are exact).
                shown = "~" + str(counts.get(status, 0))
                print(f"{indent}  {status:<11} {shown:>10}  (estimated)")
            else:
                print(f"{indent}  {status:<11} {counts.get(status, 0):>10}")
        print(f"{indent}  oldest pending  {_format_age(entry['oldest_pending_age_seconds'])}")
        print(f"{indent}  retry rate      {float(entry['retry_rate']) * 100:.1f}%")
        print(f"{indent}  abandoned       {entry['abandoned']}")
    if partitions := report.get("partitions"):
        print(
            f"{indent}partitions: {partitions['count']} from {partitions['from']} to "
            f"{partitions['to']}, {partitions['default_partition_rows']} row(s) in the default "
            "partition"
        )
    if lag := report["oldest_transaction_age_seconds"]:
        print(f"{indent}oldest open writing transaction: {_format_age(lag)}")


async def _cleanup(args: argparse.Namespace) -> int:
    settings = _settings(args)
    for name, own in _databases(settings).items():
        async with _store(own) as store:
            deleted = await cleanup(store, own, max_batches=1_000_000)
        print(f"{_heading(settings, name)}deleted {deleted} finished message(s)")
    return EXIT_OK


async def _messages(args: argparse.Namespace) -> int:
    limit = _usage(MESSAGES_LIMIT.parse, args.limit, "--limit")
    settings = _settings(args)
    rows: list[dict[str, object]] = []
    for name, own in _databases(settings).items():
        async with _store(own) as store:
            found = await store.list_messages(args.status or ["ABANDONED"], limit - len(rows))
        rows += (
            [{**row, "database": name} for row in found] if settings.several_databases else found
        )
        if len(rows) >= limit:
            break
    if args.json:
        print(json.dumps(rows, default=str, indent=2))
    else:
        for row in rows:
            where = f"{row['database']}/" if "database" in row else ""
            print(
                printable(
                    f"{row['id']}  {row['status']:<10} {where}{row['destination']:<10} "
                    f"{row['topic']:<24} key={row['key']} attempts={row['attempts']} "
                    f"error={row['last_error']}"
                )
            )
    return EXIT_OK


def _message_id(text: str, name: str) -> str:
    try:
        return str(uuid.UUID(text))
    except ValueError:
        raise UsageError(f"{name} {text!r} is not a message id (a UUID)") from None


async def _requeue(args: argparse.Namespace) -> int:
    where = _message_filter(args)
    settings = _settings(args)
    code, done = EXIT_OK, list[str]()
    for name, own in _databases(settings).items():
        with _each_database(settings, name, done):
            async with _store(own) as store:
                result = await admin.requeue(
                    store, where, destinations=own.destination_names, dry_run=args.dry_run
                )
            code = _report(result, _heading(settings, name))
    return code


async def _purge(args: argparse.Namespace) -> int:
    where = _message_filter(args)
    settings = _settings(args)
    code, done = EXIT_OK, list[str]()
    for name, own in _databases(settings).items():
        with _each_database(settings, name, done):
            async with _store(own) as store:
                result = await admin.purge(
                    store, where, everything=args.everything, dry_run=args.dry_run
                )
            code = _report(result, _heading(settings, name))
    return code


async def _replay(args: argparse.Namespace) -> int:
    where = _message_filter(args)
    settings = _settings(args)
    databases = _databases(settings)
    if args.to is not None:
        # Every database before any: each commits on its own, so a destination the last
        # one lacks would otherwise be refused after the first ones were changed.
        for name, own in databases.items():
            try:
                admin.check_destination(args.to, own.destination_names)
            except AdminRequestError as exc:
                raise AdminRequestError(f"{_heading(settings, name)}{exc}") from None
    copier = admin.copier_from_settings(settings)
    code, done = EXIT_OK, list[str]()
    try:
        for name, own in databases.items():
            with _each_database(settings, name, done):
                async with _store(own) as store:
                    result = await admin.replay(
                        store,
                        where,
                        to=args.to,
                        everything=args.everything,
                        copier=copier,
                        known_destinations=own.destination_names,
                        dry_run=args.dry_run,
                    )
                code = _report(result, _heading(settings, name))
    finally:
        copier.close()
    return code


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
        except RecursionError:
            raise UsageError("--payload nests arrays or objects too deeply to decode") from None
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
    from outboxer.claimcheck import ClaimCheckStoreError, ObjectReadTimeoutError, close_store

    settings = _settings(args)
    ring = payload_admin.require_keyring(settings)
    # One ClaimCheck for the whole run: its put timeout (claim_check_put_timeout) and cap
    # bound every row's put; claim_check_read_timeout bounds each read and delete.
    claim_check = payload_admin.claim_check(settings)
    committed = 0  # rows of committed batches (``result`` counts the one in progress too)

    def progress(done: payload_admin.RotationResult) -> None:
        nonlocal committed
        committed = done.rotated
        logger.info("re-encrypted %d message(s) so far", done.rotated)

    try:
        with payload_admin.payload_table(
            settings.require_db(), schema=settings.schema, table=settings.table
        ) as table:
            result = table.rotate(
                ring,
                batch=settings.rotation_batch,
                claim_check=claim_check,
                progress=progress,
                call_timeout=settings.claim_check_read_timeout,
            )
    except (ClaimCheckStoreError, ObjectReadTimeoutError) as exc:
        # The store, not a row: stopped rather than wait (and leave a thread) on every row.
        setting = " (claim_check_read_timeout)" if isinstance(exc, ObjectReadTimeoutError) else ""
        _fail(
            f"outboxer keys rotate: stopped: {exc}{setting}; {committed} message(s) "
            "re-encrypted in committed batches keep the new key (the batch in progress "
            "rolled back): run it again once the claim-check store answers"
        )
        return EXIT_ERROR
    finally:
        if claim_check is not None:
            close_store(claim_check.store, timeout=settings.claim_check_read_timeout)
    print(f"re-encrypted {result.rotated} message(s) under key {ring.current_key_id}")
    if result.orphaned and claim_check is not None:
        # Exit 0 still: every row is done, so a rerun would find nothing to do; removing
        # these objects is the sweep's work, as after a crash between commit and delete.
        _fail(
            f"outboxer keys rotate: warning: {result.orphaned} claim-check object(s) no row "
            f"refers to any more were not deleted from {claim_check.store!r} (see the log "
            "above); `outboxer claim-check sweep` deletes them once older than "
            "claim_check_sweep_grace"
        )
    if result.skipped:
        print(f"{result.skipped} message(s) were claimed or re-keyed meanwhile: run it again")
    if result.shredded:
        print(f"{result.shredded} message(s) of shredded subjects stay unreadable")
    for failure in result.failed:
        _fail(f"outboxer keys rotate: cannot re-encrypt message {failure}")
    log_table = f"{settings.schema}.{settings.table}_log"
    if result.log_relayed:
        print(
            f"{sum(result.log_relayed.values())} relayed log-mode message(s) in {log_table} "
            f"stay under key(s) {_by_key(result.log_relayed)} until retention drops their "
            "partitions: replaying them (a reader's seek) needs those keys"
        )
    if result.log_unrelayed:
        # The log is append-only: its rows are never re-encrypted. Success here would let
        # the operator retire a key that the log's relay still needs for these.
        _fail(
            f"outboxer keys rotate: {sum(result.log_unrelayed.values())} log-mode message(s) "
            f"in {log_table} not yet relayed by every reader are under key(s) "
            f"{_by_key(result.log_unrelayed)}; the log is append-only and is not "
            "re-encrypted: keep those keys in the ring until its readers have relayed them "
            "(no reader registered counts as none relayed), then run this again"
        )
    return EXIT_ERROR if result.failed or result.log_unrelayed else EXIT_OK


def _by_key(counts: dict[str, int]) -> str:
    return ", ".join(f"{key_id} ({count})" for key_id, count in sorted(counts.items()))


def _keys_usage(args: argparse.Namespace) -> int:
    from outboxer.crypto import check_key_id

    retiring = [
        _usage(lambda value, _: check_key_id(value), key, "--retiring") for key in args.retiring
    ]
    settings = _settings(args)
    ring = payload_admin.keyring(settings)
    reports: dict[str, dict[str, Any]] = {}
    for name, own in _databases(settings).items():
        try:
            places = payload_admin.key_usage(own.require_db(), schema=own.schema, table=own.table)
            reports[name] = {"places": [vars(place) for place in places]}
        except ConfigError:
            raise
        except (OSError, OutboxerError) as exc:  # unreachable, refused
            reports[name] = {"error": redact_text(str(exc) or type(exc).__name__)}
        except Exception as exc:  # noqa: BLE001 -- a driver's own error: the database failed
            reports[name] = {"error": redact_text(f"{type(exc).__name__}: {exc}")}
    # Where each retiring key is still needed, and why it cannot go otherwise.
    blockers: dict[str, list[str]] = {}
    for key_id in retiring:
        reasons = blockers.setdefault(key_id, [])
        if ring is not None and key_id == ring.current_key_id:
            reasons.append("it is the ring's current key: new messages are encrypted under it")
        for name, report in reports.items():
            for place in report.get("places", ()):
                count = place["keys"].get(key_id, 0)
                if count:
                    where = f"database {name}: " if settings.several_databases else ""
                    reasons.append(
                        f"{where}{count} in {place['table']} ({place['place']}: "
                        f"{payload_admin.KEY_PLACES[place['place']][1]})"
                    )
    unavailable = [name for name, report in reports.items() if "error" in report]
    in_use = [key_id for key_id, reasons in blockers.items() if reasons]
    if args.json:
        document: dict[str, Any] = {
            "ring": None
            if ring is None
            else {"key_ids": ring.key_ids, "current": ring.current_key_id},
            "retiring": {
                key_id: {"in_use": bool(reasons), "reasons": reasons}
                for key_id, reasons in blockers.items()
            },
        }
        if settings.several_databases:
            document["databases"] = reports
        else:
            document.update(next(iter(reports.values())))
        print(json.dumps(document, indent=2))
    else:
        for name, report in reports.items():
            indent = ""
            if settings.several_databases:
                print(f"database {name}:")
                indent = "  "
            if "error" in report:
                print(f"{indent}unavailable: {printable(report['error'])}")
                continue
            _print_key_usage(report["places"], ring, indent)
        for key_id, reasons in blockers.items():
            if not reasons and not unavailable:
                print(f"key {key_id}: no stored message needs it; it can leave the ring")
    for key_id in in_use:
        _fail(
            f"outboxer keys usage: key {key_id} cannot be retired yet: "
            + "; ".join(blockers[key_id])
        )
    if unavailable:
        _fail(
            f"outboxer keys usage: database(s) {', '.join(unavailable)} did not answer: "
            "its messages are not counted"
        )
    return EXIT_ERROR if in_use or unavailable else EXIT_OK


def _print_key_usage(places: list[dict[str, Any]], ring: Any, indent: str) -> None:
    totals: dict[str, int] = {}
    for place in places:
        for key_id, count in place["keys"].items():
            totals[key_id] = totals.get(key_id, 0) + count
    if not totals:
        print(f"{indent}no stored message is encrypted")
    for key_id in sorted(totals):
        note = ""
        if ring is not None:
            if key_id == ring.current_key_id:
                note = " (current)"
            elif not ring.has_key(key_id):
                note = " (NOT in the ring: these cannot be decrypted)"
        print(printable(f"{indent}key {key_id}{note}: {totals[key_id]} message(s)"))
        for place in places:
            count = place["keys"].get(key_id, 0)
            if count:
                print(printable(f"{indent}  {place['place']} ({place['table']}): {count}"))
    if ring is not None:
        for key_id in ring.key_ids:
            if key_id not in totals:
                current = " (current)" if key_id == ring.current_key_id else ""
                print(f"{indent}key {key_id}{current}: 0 message(s)")


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

    try:
        os.fsencode(args.dir)
    except UnicodeEncodeError:
        raise UsageError(f"--dir {args.dir!r} is not a usable path") from None
    if "\x00" in args.dir:
        raise UsageError(f"--dir {args.dir!r} is not a usable path (it has a NUL)")
    return run_demo(args.dir)


def _fail(text: str) -> None:
    """``text`` on one line of stderr, secrets masked (driver messages span several lines)."""
    one_line = " ".join(line.strip() for line in text.splitlines())
    print(printable(redact_text(one_line)), file=sys.stderr)


def _configure_logging(level: str, log_format: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JsonFormatter() if log_format == "json" else TextFormatter(TEXT_LOG_FORMAT)
    )
    logging.basicConfig(level=getattr(logging, level), handlers=[handler])
    # Drivers log too (aio-pika, asyncpg, httpx): their lines pass the same redaction.
    redacting = RedactingFilter()
    for root_handler in logging.getLogger().handlers:
        root_handler.addFilter(redacting)


#: Commands that run until signalled: SIGTERM stops them cleanly (exit 0) at any moment.
DAEMONS = frozenset({"relay", "consume", "serve", "stream-relay"})


def _stop_before_started(signum: int, frame: object) -> None:
    """SIGTERM while a daemon is still starting (before its event loop took the signal
    over): nothing is claimed or held yet, so stop as SIGINT would, cleanly."""
    raise KeyboardInterrupt


def _stdout_gone() -> bool:
    """Whether standard output's reader went away (a pipe into ``head``, a pager quit):
    then stdout is pointed at /dev/null, or the interpreter's own flush at exit would
    report the broken pipe again. A broken pipe to a broker or a database is no such
    thing: stdout still flushes."""
    try:
        descriptor = sys.stdout.fileno()
        poller = select.poll()
        poller.register(descriptor, select.POLLOUT)
        # A pipe's write end whose read end is closed polls as an error (so does a socket).
        gone = any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError):  # no descriptor (replaced, closed): not a reader gone
        return False
    if gone:
        os.dup2(os.open(os.devnull, os.O_WRONLY), descriptor)
    return gone


#: What each driver says when a table or schema is missing: PostgreSQL's SQLSTATEs (asyncpg
#: and psycopg both carry ``sqlstate``), MySQL's error numbers (PyMySQL and aiomysql put it
#: first in ``args``), and SQLite's text.
_MISSING_SQLSTATES = frozenset({"42P01", "3F000", "42883"})  # table, schema, function
_MISSING_MYSQL_ERRORS = frozenset({1146})  # ER_NO_SUCH_TABLE


def _schema_missing(exc: BaseException) -> bool:
    """Whether ``exc``, or an error it was raised from, says the outbox schema is not there:
    an operator's command pointed at the right server before `schema apply` ran, or at the
    wrong database."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if getattr(current, "sqlstate", None) in _MISSING_SQLSTATES:
            return True
        first = current.args[0] if current.args else None
        if type(first) is int and first in _MISSING_MYSQL_ERRORS:
            return True
        if isinstance(current, sqlite3.OperationalError) and str(current).startswith(
            "no such table"
        ):
            return True
        current = current.__cause__ or current.__context__
    return False


def _failed_for_missing_schema(command: str, exc: BaseException) -> int:
    _fail(
        f"outboxer {command}: {exc}: the outbox schema is not applied in this database: "
        "run `outboxer schema apply` with the same --db first"
    )
    return EXIT_USAGE


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command in DAEMONS:
        # An orchestrator may stop a process the moment it starts; without this, SIGTERM's
        # default action kills it (exit -15) until the relay's own handler is installed.
        signal.signal(signal.SIGTERM, _stop_before_started)
        tune_malloc()  # small socket reads without a system call each (see outboxer.malloc)
    _configure_logging(args.log_level, getattr(args, "log_format", "text"))
    run: Command = args.func
    try:
        return run(args)
    except (UsageError, PayloadError, AdminRequestError) as exc:  # PayloadError: enqueue's …
        _fail(f"outboxer {args.command}: {exc}")
        return EXIT_USAGE
    except ConfigError as exc:
        _fail(f"outboxer: configuration error: {exc}")
        return EXIT_USAGE
    except OutboxerError as exc:
        if _schema_missing(exc):
            return _failed_for_missing_schema(args.command, exc)
        _fail(f"outboxer: {exc}")
        return EXIT_ERROR
    except KeyboardInterrupt:
        if args.command in DAEMONS:  # Ctrl-C is how a foreground relay is stopped
            return EXIT_OK
        # A purge, replay or key rotation cut short may have done part of its work: a
        # script must not read that as success (130: the shell's code for SIGINT).
        _fail(f"outboxer {args.command}: interrupted; it may have done part of its work")
        return EXIT_INTERRUPTED
    except Exception as exc:  # a database that refuses, a disk that is full, or a bug
        if isinstance(exc, BrokenPipeError) and _stdout_gone():
            return EXIT_BROKEN_PIPE  # `outboxer status | head`: the reader had enough
        logger.debug("outboxer %s failed", args.command, exc_info=True)
        if _schema_missing(exc):
            return _failed_for_missing_schema(args.command, exc)
        _fail(
            f"outboxer: {type(exc).__name__}: {exc} (run with --log-level DEBUG for the traceback)"
        )
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
