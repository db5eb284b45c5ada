"""The ``outboxer`` command: relay, serve, schema, status, cleanup, messages, requeue, enqueue, demo."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any

from outboxer import consume_cli
from outboxer.config import Settings, load_settings
from outboxer.errors import ConfigError, OutboxerError
from outboxer.relay import Relay, cleanup
from outboxer.stores import create_store

logger = logging.getLogger("outboxer.cli")

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--db", help="database URL (env OUTBOXER_DB)")
    parser.add_argument(
        "--config", help="TOML settings file (env OUTBOXER_CONFIG; default ./outboxer.toml)"
    )
    parser.add_argument("--schema", help="schema of the outbox table (default outboxer)")
    parser.add_argument("--table", help="outbox table name (default outbox)")
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )


def _http_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--http",
        metavar="HOST:PORT",
        help="serve the HTTP API (health, metrics, status, requeue) here (env OUTBOXER_HTTP)",
    )
    parser.add_argument(
        "--http-token",
        metavar="TOKEN",
        help="bearer token the API's POST endpoints require (env OUTBOXER_HTTP_TOKEN)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="outboxer", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    relay = commands.add_parser("relay", help="publish committed outbox messages to the broker")
    _common(relay)
    relay.add_argument(
        "--broker", help="broker URL of the 'default' destination (env OUTBOXER_BROKER)"
    )
    relay.add_argument("--batch-size", help="rows claimed per batch (default 500)")
    relay.add_argument("--lock-timeout", help="seconds a claim stays locked (default 60)")
    relay.add_argument("--max-attempts", help="attempts before ABANDONED (default 10)")
    relay.add_argument("--poll-interval", help="seconds between polls without NOTIFY (default 1)")
    relay.add_argument(
        "--concurrency", help="claim-publish-settle loops per destination (default 4)"
    )
    relay.add_argument("--backoff-base", help="first retry delay in seconds (default 1)")
    relay.add_argument("--backoff-multiplier", help="growth per attempt (default 2)")
    relay.add_argument("--backoff-max", help="longest retry delay in seconds (default 300)")
    relay.add_argument("--backoff-jitter", help="± fraction of jitter (default 0.25)")
    relay.add_argument("--publish-timeout", help="seconds to wait for broker confirms (default 30)")
    relay.add_argument("--published-retention", help="keep PUBLISHED rows this long (default 7d)")
    relay.add_argument("--abandoned-retention", help="keep ABANDONED rows this long (default 30d)")
    relay.add_argument("--cleanup-interval", help="seconds between retention runs (default 300)")
    relay.add_argument(
        "--abandoned-blocks-key",
        choices=["true", "false"],
        help="whether an abandoned message holds back its key (default false)",
    )
    relay.add_argument(
        "--relay-id", help="name of this relay in locked_by (default host:pid:random)"
    )
    relay.add_argument(
        "--exit-when-idle", action="store_const", const=True, help="publish what is due, then exit"
    )
    _http_flags(relay)

    serve = commands.add_parser(
        "serve", help="the HTTP API without a relay (health, metrics, status, requeue)"
    )
    _common(serve)
    _http_flags(serve)

    schema = commands.add_parser("schema", help="create, upgrade or print the outbox schema")
    schema_commands = schema.add_subparsers(dest="schema_command", required=True)
    apply = schema_commands.add_parser("apply", help="create or upgrade the schema (idempotent)")
    _common(apply)
    sql = schema_commands.add_parser("sql", help="print the DDL for your own migration tool")
    _common(sql)
    sql.add_argument(
        "--dialect",
        choices=sorted(_DIALECT_URLS),
        help="print for this database (default: from --db, else postgres)",
    )

    status = commands.add_parser("status", help="counts per status, oldest pending age, retry rate")
    _common(status)
    status.add_argument("--json", action="store_true", help="machine-readable output")

    clean = commands.add_parser("cleanup", help="delete finished messages past their retention")
    _common(clean)
    clean.add_argument("--published-retention", help="keep PUBLISHED rows this long (default 7d)")
    clean.add_argument("--abandoned-retention", help="keep ABANDONED rows this long (default 30d)")
    clean.add_argument("--inbox-retention", help="keep inbox entries this long (default 30d)")

    messages = commands.add_parser("messages", help="list messages in a status (default ABANDONED)")
    _common(messages)
    messages.add_argument(
        "--status",
        action="append",
        choices=["PENDING", "PROCESSING", "PUBLISHED", "FAILED", "ABANDONED"],
    )
    messages.add_argument("--limit", type=int, default=50)
    messages.add_argument("--json", action="store_true")

    requeue = commands.add_parser(
        "requeue", help="make ABANDONED (or FAILED) messages PENDING again"
    )
    _common(requeue)
    requeue.add_argument(
        "--id", action="append", dest="ids", help="message id (repeatable); default: all"
    )
    requeue.add_argument("--status", action="append", choices=["ABANDONED", "FAILED"])
    requeue.add_argument("--destination", action="append")

    enqueue = commands.add_parser("enqueue", help="add one message (in its own transaction)")
    _common(enqueue)
    enqueue.add_argument("--topic", required=True)
    enqueue.add_argument("--key")
    enqueue.add_argument("--payload", required=True, help="JSON text; with --text, sent as text")
    enqueue.add_argument("--text", action="store_true")
    enqueue.add_argument("--header", action="append", default=[], metavar="NAME=VALUE")
    enqueue.add_argument("--destination", action="append")

    demo = commands.add_parser(
        "demo", help="the pattern end to end on SQLite and a JSON-lines file"
    )
    demo.add_argument("--dir", default="outboxer-demo", help="where the demo writes its files")
    demo.add_argument(
        "--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )
    consume_cli.add_commands(commands)
    return parser


#: A URL of each dialect, for printing its DDL without a database.
_DIALECT_URLS = {
    "postgres": "postgresql://localhost/",
    "sqlite": "sqlite:///outboxer.db",
    "mysql": "mysql://localhost/outboxer",
}


def _settings(args: argparse.Namespace, **extra: Any) -> Settings:
    names = (
        "db",
        "schema",
        "table",
        "broker",
        "batch_size",
        "lock_timeout",
        "max_attempts",
        "poll_interval",
        "concurrency",
        "backoff_base",
        "backoff_multiplier",
        "backoff_max",
        "backoff_jitter",
        "publish_timeout",
        "published_retention",
        "abandoned_retention",
        "cleanup_interval",
        "abandoned_blocks_key",
        "relay_id",
        "exit_when_idle",
        "inbox_retention",
        "http",
        "http_token",
    )
    flags = {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}
    flags.update(extra)
    return load_settings(flags, config_file=getattr(args, "config", None))


def _store(settings: Settings) -> Any:
    return create_store(settings.require_db(), schema=settings.schema, table=settings.table)


async def _relay(args: argparse.Namespace) -> int:
    settings = _settings(args)
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
    return EXIT_OK


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
    async with _store(_settings(args)) as store:
        rows = await store.list_messages(args.status or ["ABANDONED"], args.limit)
    if args.json:
        print(json.dumps(rows, default=str, indent=2))
    else:
        for row in rows:
            print(
                f"{row['id']}  {row['status']:<10} {row['destination']:<10} {row['topic']:<24} "
                f"key={row['key']} attempts={row['attempts']} error={row['last_error']}"
            )
    return EXIT_OK


async def _requeue(args: argparse.Namespace) -> int:
    settings = _settings(args)
    destinations = args.destination or settings.destination_names
    async with _store(settings) as store:
        count = await store.requeue(destinations, args.status or ["ABANDONED"], args.ids)
    print(f"requeued {count} message(s)")
    return EXIT_OK


def _enqueue(args: argparse.Namespace) -> int:
    from outboxer.enqueue import Outbox

    settings = _settings(args)
    payload: object = args.payload
    if not args.text:
        try:
            payload = json.loads(args.payload)
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"--payload is not JSON ({exc}); pass --text to send it as text"
            ) from None
    headers = {}
    for item in args.header:
        name, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--header needs NAME=VALUE, got {item!r}")
        headers[name] = value
    db = settings.require_db()
    outbox = Outbox(schema=settings.schema, table=settings.table)
    dialect = _store(settings).dialect
    if dialect == "sqlite":
        import sqlite3

        from outboxer.stores.sqlite import sqlite_path

        conn: Any = sqlite3.connect(sqlite_path(db))
    elif dialect == "mysql":
        import pymysql

        from outboxer.stores.mysql import mysql_connect_args

        conn = pymysql.connect(**mysql_connect_args(db))
    else:
        import psycopg

        conn = psycopg.connect(db)
    try:  # the CLI owns this transaction: it commits on success
        message = outbox.enqueue(
            conn, args.topic, payload, key=args.key, headers=headers, destinations=args.destination
        )
        conn.commit()
    finally:
        conn.close()
    print(message.id)
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        if (consumed := consume_cli.run(args)) is not None:
            return consumed
        if args.command == "relay":
            return asyncio.run(_relay(args))
        if args.command == "serve":
            return asyncio.run(_serve(args))
        if args.command == "schema":
            return (
                _schema_sql(args)
                if args.schema_command == "sql"
                else asyncio.run(_schema_apply(args))
            )
        if args.command == "status":
            return asyncio.run(_status(args))
        if args.command == "cleanup":
            return asyncio.run(_cleanup(args))
        if args.command == "messages":
            return asyncio.run(_messages(args))
        if args.command == "requeue":
            return asyncio.run(_requeue(args))
        if args.command == "enqueue":
            return _enqueue(args)
        if args.command == "demo":
            from outboxer.demo import run_demo

            return run_demo(args.dir)
    except ConfigError as exc:
        print(f"outboxer: configuration error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except OutboxerError as exc:
        print(f"outboxer: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return EXIT_OK
    raise AssertionError(f"unhandled command {args.command}")


if __name__ == "__main__":
    sys.exit(main())
