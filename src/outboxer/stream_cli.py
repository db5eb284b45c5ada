"""``outboxer stream-relay``: the relay of log mode and the WAL outbox, its status and its
dead letters.

::

    outboxer stream-relay --mode log|wal [--destination NAME] [--http HOST:PORT] ...
    outboxer stream-relay status --mode log|wal [--destination NAME] [--json]
    outboxer stream-relay dead-letters list|replay|purge --mode log|wal ...

Settings come, strongest first, from flags, ``OUTBOXER_*`` variables and the settings file,
declared once in :mod:`outboxer.config`: the relay's shared ones (``db``, ``broker``,
``max_attempts``, ``backoff_*``, ``abandoned_blocks_key``, ``http`` …) keep their names and
places; the stream relay's own (:class:`outboxer.config.StreamSettings`) live in the file's
``[stream_relay]`` table. A subcommand's flags go after its name
(``outboxer stream-relay status --mode wal``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import time
import uuid
from collections.abc import Callable, Coroutine
from typing import Any
from urllib.parse import urlsplit

from outboxer.config import (
    ENV_PREFIX,
    DestinationSettings,
    Settings,
    StreamSettings,
    add_flags,
    check_url,
    declarations,
    load_stream_settings,
)
from outboxer.errors import ConfigError
from outboxer.message import DEFAULT_DESTINATION
from outboxer.redact import get_logger, printable, redact_url

logger = get_logger("outboxer.stream_cli")

AddCommand = Callable[..., argparse.ArgumentParser]
#: The most dead letters ``dead-letters list`` prints.
LIST_LIMIT = 10_000


def add_commands(commands: Any, add_command: AddCommand) -> None:
    """Register ``stream-relay`` (and its ``status`` and ``dead-letters``) on the ``outboxer``
    command's subparsers; ``add_command`` is the CLI's (``--config``, ``--log-level``, the
    shared settings' flags)."""
    relay = add_command(
        commands,
        "stream-relay",
        _run(_relay),
        "publish a log reader's or a WAL slot's messages (PostgreSQL log and wal modes)",
    )
    add_flags(relay, StreamSettings, "stream-relay")
    relay.set_defaults(stream_command="stream-relay")
    actions = relay.add_subparsers(dest="stream_action", metavar="COMMAND")
    status = _subcommand(
        actions,
        "status",
        _status,
        "per stream: checkpoint, entries behind, oldest unpublished age, dead letters, "
        "slot WAL retained (wal)",
    )
    status.add_argument("--json", action="store_true", help="machine-readable output")
    letters = actions.add_parser(
        "dead-letters",
        help="list, replay or purge a stream's dead letters",
        argument_default=argparse.SUPPRESS,
    )
    letter_actions = letters.add_subparsers(dest="letters_action", required=True, metavar="COMMAND")
    listing = _subcommand(
        letter_actions, "list", _list, "the dead letters, oldest first", "dead-letters list"
    )
    listing.add_argument(
        "--limit", type=int, help=f"the most to list (default 100, at most {LIST_LIMIT})"
    )
    listing.add_argument("--json", action="store_true", help="machine-readable output")
    replay = _subcommand(
        letter_actions,
        "replay",
        _replay,
        "publish dead letters again, oldest first; each one confirmed leaves the table",
        "dead-letters replay",
    )
    replay.add_argument(
        "--id",
        action="append",
        dest="ids",
        metavar="UUID",
        help="message id (repeatable); default: all",
    )
    purge = _subcommand(
        letter_actions, "purge", _purge, "delete dead letters for good", "dead-letters purge"
    )
    purge.add_argument(
        "--id", action="append", dest="ids", metavar="UUID", help="message id (repeatable)"
    )
    purge.add_argument("--all", action="store_true", help="every dead letter of the stream")


def _subcommand(
    actions: Any,
    name: str,
    command: Callable[[argparse.Namespace], Coroutine[Any, Any, int]],
    help: str,
    settings_of: str | None = None,
) -> argparse.ArgumentParser:
    """A subcommand of ``stream-relay``. Its options default to *absent* (SUPPRESS), so that
    one given before the subcommand's name (``stream-relay --mode wal status``) is not reset."""
    full = f"stream-relay {settings_of or name}"
    parser: argparse.ArgumentParser = actions.add_parser(
        name, help=help, description=help, argument_default=argparse.SUPPRESS
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        help=f"TOML settings file (env {ENV_PREFIX}CONFIG; default ./outboxer.toml if present)",
    )
    parser.add_argument("--log-level", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    parser.add_argument("--log-format", choices=("text", "json"))
    add_flags(parser, Settings, full)
    add_flags(parser, StreamSettings, full)
    parser.set_defaults(func=_run(command), stream_command=full)
    return parser


def _run(
    command: Callable[[argparse.Namespace], Coroutine[Any, Any, int]],
) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        return asyncio.run(command(args))

    return run


def _load(args: argparse.Namespace) -> tuple[Settings, StreamSettings]:
    """The settings of the command that runs, from its flags, the environment and the file."""
    command = args.stream_command

    def given(cls: type) -> dict[str, object]:
        return {
            declared.name: getattr(args, declared.name)
            for declared in declarations(cls)
            if command in declared.commands and getattr(args, declared.name, None) is not None
        }

    return load_stream_settings(
        given(Settings), given(StreamSettings), config_file=getattr(args, "config", None)
    )


def _database(settings: Settings) -> str:
    url = settings.require_db()
    check_url(url, "--db")
    if urlsplit(url).scheme not in ("postgresql", "postgres", "postgresql+asyncpg"):
        raise ConfigError(
            f"the stream relay needs PostgreSQL: --db must be a postgresql:// URL; got "
            f"{redact_url(url)!r}"
        )
    return url


def _destination_settings(settings: Settings, destination: str) -> DestinationSettings:
    """The destination's broker and options: ``[destinations.NAME]``, else ``broker``."""
    found = settings.destinations.get(destination) or settings.destinations.get(DEFAULT_DESTINATION)
    if found is None:
        raise ConfigError(
            f"no broker for stream {destination!r}: pass --broker URL, set OUTBOXER_BROKER, "
            f"or name it in outboxer.toml ([destinations.{destination}] broker = ...)"
        )
    return found


def _publishing(settings: Settings, destination: str) -> tuple[Any, Any]:
    """The publisher and payload handling of a stream (its destination's broker, routes,
    options, envelope and payload mode, with the settings' encryption keys)."""
    from outboxer import payload_admin
    from outboxer.brokers import create_publisher
    from outboxer.payload_relay import PayloadHandling

    target = _destination_settings(settings, destination)
    publisher = create_publisher(
        target.broker,
        routes=target.routes,
        publish_timeout=settings.publish_timeout,
        **target.options,
    )
    payload = PayloadHandling(
        destination, target.payload, payload_admin.keyring(settings), target.envelope
    )
    return publisher, payload


def _schema_object(settings: Settings, own: StreamSettings) -> Any:
    """The mode's schema object (PgLog or PgWal), not yet connected."""
    db = _database(settings)
    if own.require_mode() == "log":
        from outboxer.stores.pglog import PgLog

        return PgLog(db, schema=settings.schema, table=settings.table)
    from outboxer.stores.pgwal import PgWal

    return PgWal(db, schema=settings.schema, table=settings.table, slot_prefix=own.slot_prefix)


def _reader(schema_object: Any, own: StreamSettings, destination: str) -> Any:
    if own.mode == "log":
        return schema_object.reader(destination, retention_days=own.retention_days)
    return schema_object.reader(destination)


# ----- the relay ------------------------------------------------------------------------------


async def _relay(args: argparse.Namespace) -> int:
    from outboxer.streamrelay import StreamRelay

    settings, own = _load(args)
    mode = own.require_mode()
    destination = own.destination or DEFAULT_DESTINATION
    publisher, payload = _publishing(settings, destination)
    schema_object = _schema_object(settings, own)
    if own.apply_schema or own.create_slot:
        async with schema_object:
            applied = await schema_object.apply_schema()
            if own.create_slot and await schema_object.create_slot(destination):
                applied.append(f"slot {schema_object.slot_name(destination)}")
        if applied:
            logger.info("applied: %s", ", ".join(applied))
    source = _reader(schema_object, own, destination)
    relay = StreamRelay(
        source,
        publisher,
        batch_size=own.batch_size,
        poll_interval=own.poll_interval,
        max_attempts=settings.max_attempts,
        backoff=settings.backoff,
        abandoned_blocks_key=settings.abandoned_blocks_key,
        payload=payload,
        probe_interval=own.probe_interval if settings.http else None,
        exit_when_idle=settings.exit_when_idle,
    )
    server = None
    if settings.http:
        from outboxer.stream_api import start_stream_api, stream_metrics

        stream_metrics(relay)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    await source.connect()
    try:
        if settings.http and relay.metrics is not None:
            server = await start_stream_api(
                settings.http, relay, relay.metrics, settings.http_allowed_hosts
            )
        logger.info("%s: relaying (mode %s) to %s", source.name, mode, publisher.safe_url)
        await relay.run(stop)
    finally:
        if server is not None:
            await server.close()
        await publisher.close()
        await source.close()
    return 0


# ----- status ---------------------------------------------------------------------------------


async def stream_status(
    settings: Settings, own: StreamSettings, *, now: float | None = None
) -> dict[str, Any]:
    """Per stream of the mode (or the one named): its checkpoint, entries behind (counted up
    to 100,000), the oldest unpublished message's age, dead letters and failing messages,
    and for the WAL outbox the WAL its slot keeps."""
    from outboxer.stores.pgstream import BACKLOG_LIMIT

    mode = own.require_mode()
    schema_object = _schema_object(settings, own)
    now = time.time() if now is None else now
    streams: list[dict[str, Any]] = []
    async with schema_object:
        conn = schema_object.conn
        letters, failing = await _book_counts(conn, schema_object.names, mode)
        if mode == "log":
            for reader, offset, stored_at in await schema_object.readers():
                if own.destination is not None and reader != own.destination:
                    continue
                backlog = await schema_object.backlog(offset, BACKLOG_LIMIT)
                streams.append(
                    {
                        "destination": reader,
                        "checkpoint": f"{offset.order_xid}/{offset.position}",
                        "checkpoint_age_seconds": round(max(now - stored_at.timestamp(), 0.0), 3),
                        **_backlog_fields(backlog),
                    }
                )
        else:
            prefix = schema_object.slot_prefix + "_"
            for slot in await schema_object.slots():
                destination = slot["slot_name"].removeprefix(prefix)
                if own.destination is not None and destination != own.destination:
                    continue
                stream = {
                    "destination": destination,
                    "slot": slot["slot_name"],
                    "relay_pid": slot["active_pid"],
                    "checkpoint": slot["confirmed_flush_lsn"],
                    "wal_status": slot["wal_status"],
                    "safe_wal_size_bytes": slot["safe_wal_size"],
                }
                if slot["wal_status"] == "lost":
                    # Invalidated: it cannot be peeked (its WAL is gone), and the status
                    # must still show it, the one slot that most needs attention.
                    stream.update(
                        entries_behind=None,
                        entries_behind_capped=False,
                        oldest_unpublished_age_seconds=None,
                        wal_retained_bytes=None,
                        wal_behind_bytes=slot["behind"],
                    )
                else:
                    backlog = await schema_object.reader(destination).backlog(BACKLOG_LIMIT)
                    stream.update(
                        **_backlog_fields(backlog),
                        wal_retained_bytes=backlog.wal_retained_bytes,
                        wal_behind_bytes=backlog.wal_behind_bytes,
                    )
                streams.append(stream)
    for stream in streams:
        counts = letters.get(stream["destination"], {})
        stream["dead_letters"] = counts.get("letters", 0)
        stream["held"] = counts.get("held", 0)
        stream["failing"] = failing.get(stream["destination"], {}).get("failing", 0)
        stream["most_attempts"] = failing.get(stream["destination"], {}).get("most_attempts", 0)
    return {"mode": mode, "streams": streams}


def _backlog_fields(backlog: Any) -> dict[str, Any]:
    return {
        "entries_behind": backlog.entries,
        "entries_behind_capped": backlog.capped,
        "oldest_unpublished_age_seconds": round(backlog.age(), 3),
    }


async def _book_counts(
    conn: Any, names: dict[str, str], mode: str
) -> tuple[dict[str, dict[str, int]], dict[str, dict[str, int]]]:
    """Dead letters and failing messages per destination ({} before the tables exist)."""
    from outboxer.errors import SchemaError
    from outboxer.stores.pgstream import StreamBook

    book = StreamBook(names, mode, "")
    try:
        await book.check(conn)
    except SchemaError:
        return {}, {}
    letters = {
        row["destination"]: {"letters": row["letters"], "held": row["held"]}
        for row in await book.fetch(conn, "letter_counts")
    }
    failing = {
        row["destination"]: {"failing": row["failing"], "most_attempts": row["most_attempts"]}
        for row in await book.fetch(conn, "failure_counts")
    }
    return letters, failing


async def _status(args: argparse.Namespace) -> int:
    from outboxer.cli import _format_age

    settings, own = _load(args)
    report = await stream_status(settings, own)
    if getattr(args, "json", False):
        print(json.dumps(report, indent=2))
        return 0
    if not report["streams"]:
        print(f"no {'log readers' if report['mode'] == 'log' else 'WAL outbox slots'} found")
    for stream in report["streams"]:
        if report["mode"] == "log":
            # Reader names are rows of the offsets table (any --destination): escaped.
            print(f"log reader {printable(stream['destination'])}:")
            age = _format_age(stream["checkpoint_age_seconds"])
            print(f"  checkpoint          {stream['checkpoint']} (stored {age} ago)")
        else:
            relay = f"relay pid {stream['relay_pid']}" if stream["relay_pid"] else "no relay"
            print(
                f"WAL slot {printable(stream['slot'])} "
                f"(destination {printable(stream['destination'])}, {relay}):"
            )
            print(f"  checkpoint          {stream['checkpoint']}")
            print(f"  WAL status          {_wal_status(stream['wal_status'])}")
        behind = (
            "-"  # an invalidated slot cannot be read
            if stream["entries_behind"] is None
            else f"{stream['entries_behind']}{'+' if stream['entries_behind_capped'] else ''}"
        )
        print(f"  entries behind      {behind}")
        print(
            f"  oldest unpublished  {_format_age(stream['oldest_unpublished_age_seconds'] or None)}"
        )
        if report["mode"] == "wal":
            print(f"  WAL retained        {_format_bytes(stream['wal_retained_bytes'])}")
            print(f"  WAL behind          {_format_bytes(stream['wal_behind_bytes'])}")
            if stream["wal_status"] != "lost":
                unlimited = stream["safe_wal_size_bytes"] is None
                print(
                    f"  WAL until invalid   {_format_bytes(stream['safe_wal_size_bytes'])}"
                    f"{' (no max_slot_wal_keep_size)' if unlimited else ''}"
                )
        print(f"  dead letters        {stream['dead_letters']} ({stream['held']} held)")
        print(
            f"  failing             {stream['failing']} (most attempts {stream['most_attempts']})"
        )
    return 0


def _wal_status(status: str | None) -> str:
    if status == "lost":
        return (
            "lost: INVALIDATED, its unread messages are gone; drop the slot and create it "
            "again (--create-slot)"
        )
    if status == "unreserved":
        return "unreserved: about to be invalidated (max_slot_wal_keep_size)"
    return str(status)


def _format_bytes(count: int | None) -> str:
    if count is None:
        return "-"
    size = float(count)
    for unit in ("B", "kB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TB"


# ----- dead letters ---------------------------------------------------------------------------


async def _list(args: argparse.Namespace) -> int:
    from outboxer.stores.pgstream import StreamBook

    settings, own = _load(args)
    limit = getattr(args, "limit", 100)
    if not 1 <= limit <= LIST_LIMIT:
        raise ConfigError(f"--limit must be between 1 and {LIST_LIMIT}, not {limit}")
    mode = own.require_mode()
    schema_object = _schema_object(settings, own)
    async with schema_object:
        book = StreamBook(schema_object.names, mode, own.destination or "")
        await book.check(schema_object.conn)
        letters = await book.letters(
            schema_object.conn, limit, every_destination=own.destination is None
        )
    rows = [letter.as_dict() for letter in letters]
    if getattr(args, "json", False):
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print("no dead letters")
    for row in rows:
        state = "held" if row["held"] else f"attempts={row['attempts']}"
        print(
            printable(
                f"{row['message_id']}  {row['destination']:<16} {row['topic']:<24} "
                f"key={row['key']} {state} at {row['failed_at']} error={_one_line(row['error'])}"
            )
        )
    return 0


def _one_line(text: str) -> str:
    return " ".join(text.split())[:300]


async def _replay(args: argparse.Namespace) -> int:
    from outboxer.streamrelay import replay_dead_letters

    settings, own = _load(args)
    destination = own.destination or DEFAULT_DESTINATION
    ids = [_message_id(value) for value in getattr(args, "ids", None) or []] or None
    publisher, payload = _publishing(settings, destination)
    schema_object = _schema_object(settings, own)
    source = _reader(schema_object, own, destination)
    # attach, not connect: connect takes the reader lock, which a running relay holds.
    await source.attach()
    try:
        counts = await replay_dead_letters(
            source,
            publisher,
            ids=ids,
            abandoned_blocks_key=settings.abandoned_blocks_key,
            payload=payload,
        )
    finally:
        await publisher.close()
        await source.close()
    print(", ".join(f"{name} {count}" for name, count in counts.as_dict().items()))
    return 0 if counts.failed == 0 else 1


async def _purge(args: argparse.Namespace) -> int:
    from outboxer.stores.pgstream import StreamBook

    settings, own = _load(args)
    ids = [_message_id(value) for value in getattr(args, "ids", None) or []]
    purge_all = getattr(args, "all", False)
    if purge_all == bool(ids):
        raise ConfigError("purge needs --id UUID (repeatable) or --all, not both")
    mode = own.require_mode()
    destination = own.destination or DEFAULT_DESTINATION
    schema_object = _schema_object(settings, own)
    async with schema_object:
        book = StreamBook(schema_object.names, mode, destination)
        await book.check(schema_object.conn)
        if purge_all:
            deleted = await book.execute(schema_object.conn, "purge_all")
        else:
            deleted = await book.execute(
                schema_object.conn, "purge_ids", ids=[uuid.UUID(value) for value in ids]
            )
    print(f"purged {deleted} dead letter(s)")
    return 0


def _message_id(text: str) -> str:
    try:
        return str(uuid.UUID(text))
    except ValueError:
        raise ConfigError(f"--id {text!r} is not a message id (a UUID)") from None


__all__ = ["add_commands", "stream_status"]
