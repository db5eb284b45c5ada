"""``outboxer consume`` and ``outboxer dead-letters``: the consumer runner from the command line.

Settings come, strongest first, from flags, ``OUTBOXER_*`` environment variables and the
settings file, declared once like the relay's (:mod:`outboxer.config`). The relay's settings
the consumer shares (``db``, ``broker``, ``schema``, ``table``, ``max_attempts``,
``backoff_*``, ``abandoned_blocks_key``, ``exit_when_idle``, ``http``, ``http_token``) keep
their names and places; the consumer's own (:class:`ConsumerSettings`) live in the file's
``[consumer]`` table::

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
import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from outboxer.config import (
    LONGEST_INTERVAL,
    SHORTEST_INTERVAL,
    Duration,
    Pairs,
    Settings,
    Text,
    TextList,
    Whole,
    add_flags,
    declared_values,
    file_table,
    flags_from_args,
    format_duration,
    load_settings,
    read_config_file,
    setting,
)
from outboxer.errors import ConfigError, ConsumerShutdownError
from outboxer.redact import get_logger, printable
from outboxer.stores.mysql import STATEMENT_TIMEOUT

if TYPE_CHECKING:
    from outboxer.consumer import Consumer, ConsumerStats

logger = get_logger("outboxer.consume_cli")

CONSUME = ("consume",)
#: Every command that names a group.
GROUPS = ("consume", "dead-letters list", "dead-letters replay", "dead-letters purge")
#: The most dead letters `dead-letters list` prints at once (as `outboxer messages`).
DEAD_LETTERS_LIMIT = 10_000


@dataclass(frozen=True)
class ConsumerSettings:
    """The settings of ``outboxer consume`` (and ``dead-letters``) of their own; the file's
    ``[consumer]`` table holds them."""

    group: str | None = setting(
        kind=Text(200),
        help="consumer group: the inbox's name, the queue, the durable, the Kafka group id",
        commands=GROUPS,
    )
    topics: tuple[str, ...] | None = setting(
        kind=TextList(),
        help="topic (pattern) to consume; repeatable",
        commands=CONSUME,
        repeatable=True,
        flag="--topic",
        default_text="all the broker can name",
    )
    handler: str | None = setting(
        kind=Text(300),
        help="module:function called for each message (or the command's argument)",
        commands=("consume", "dead-letters replay"),
    )
    concurrency: int = setting(
        4,
        kind=Whole(1, 256),
        help="transactions applied in parallel, each on a database connection of its own",
        commands=CONSUME,
        env="OUTBOXER_CONSUMER_CONCURRENCY",
    )
    batch: int = setting(
        100,
        kind=Whole(1, 10_000),
        help="messages of different keys applied in one transaction, at most",
        commands=CONSUME,
        env="OUTBOXER_CONSUMER_BATCH",
    )
    prefetch: int | None = setting(
        kind=Whole(1, 1_000_000),
        help="messages received and not yet acked, at most (the broker's prefetch)",
        commands=CONSUME,
        default_text="2 x concurrency x batch, at least 100",
    )
    shutdown_timeout: float = setting(
        30.0,
        kind=Duration(LONGEST_INTERVAL, positive=True, low=SHORTEST_INTERVAL),
        help="how long handlers in flight get to finish on SIGTERM; then they are cut short "
        "(rolled back, not acked) and the process exits 1 naming their messages, even if a "
        "sync handler never returns (a second SIGTERM or Ctrl-C cuts them short at once)",
        commands=CONSUME,
        # Its own variable: OUTBOXER_SHUTDOWN_TIMEOUT is the relay's (20 s by default).
        env="OUTBOXER_CONSUMER_SHUTDOWN_TIMEOUT",
    )
    handler_timeout: float | None = setting(
        kind=Duration(LONGEST_INTERVAL, positive=True, low=SHORTEST_INTERVAL),
        help="how long one message's handler may run: past it the attempt fails (rolled "
        "back, retried after its backoff, dead-lettered after max_attempts); an async handler "
        "is cancelled, a sync one abandoned in its thread (its transaction ended), and the "
        "process exits 1 once more than concurrency of those still run",
        commands=CONSUME,
        env="OUTBOXER_CONSUMER_HANDLER_TIMEOUT",
        default_text="none (no bound)",
    )
    # None when not given: Consumer's (and Session's) own default then applies, one constant.
    statement_timeout: float | None = setting(
        kind=Duration(LONGEST_INTERVAL, positive=True, low=SHORTEST_INTERVAL),
        help="how long each round trip of the consumer's own on its database may take "
        "(connect, BEGIN, the inbox claim, COMMIT, ROLLBACK, dead letters; not the handler's "
        "statements): past it the connection is cut off and the batch is an outage, not "
        "acked, applied again on a new connection; `dead-letters` exits 1",
        commands=GROUPS,
        env="OUTBOXER_CONSUMER_STATEMENT_TIMEOUT",
        default_text=format_duration(STATEMENT_TIMEOUT),
    )
    name: str | None = setting(
        kind=Text(100),
        help="this process's stable name in its group (Redis consumer, MQTT client id)",
        commands=CONSUME,
        env="OUTBOXER_CONSUMER_NAME",
        default_text="host name",
    )
    async_driver: str | None = setting(
        kind=Text(20),
        help="driver of an async handler's connection: asyncpg or psycopg",
        commands=CONSUME,
        default_text="asyncpg",
    )
    options: Mapping[str, Any] | None = setting(
        kind=Pairs(),
        help="receiver option (queue_type, claim_idle, ack_wait …); repeatable",
        commands=CONSUME,
        repeatable=True,
        flag="--option",
        env="OUTBOXER_CONSUMER_OPTIONS",
    )

    def require(self, name: str) -> Any:
        value = getattr(self, name)
        if value is None:
            where = "the handler argument" if name == "handler" else f"--{name}"
            raise ConfigError(
                f"no {name}: pass {where}, set OUTBOXER_{name.upper()} or [consumer] {name}"
            )
        return value


def load_consume_settings(
    flags: Mapping[str, object],
    consumer_flags: Mapping[str, object],
    *,
    environ: Mapping[str, str] | None = None,
    config_file: str | None = None,
) -> tuple[Settings, ConsumerSettings]:
    """The shared settings (``load_settings``) and the consumer's own (``[consumer]``)."""
    environ = os.environ if environ is None else environ
    settings = load_settings(flags, environ=environ, config_file=config_file)
    file_values, origin = read_config_file(config_file, environ)
    values = declared_values(
        ConsumerSettings,
        consumer_flags,
        environ,
        file_table(file_values, "consumer", origin),
        f"{origin} [consumer]",
    )
    return settings, ConsumerSettings(**values)


# ----- argparse ------------------------------------------------------------------------------

AddCommand = Callable[..., argparse.ArgumentParser]


def add_commands(commands: Any, add_command: AddCommand) -> None:
    """Register ``consume`` and ``dead-letters`` on the ``outboxer`` command's subparsers;
    ``add_command`` is the CLI's (``--config``, ``--log-level``, the shared settings' flags)."""
    consume = add_command(
        commands,
        "consume",
        _run(_consume),
        "apply a consumer group's messages to your database, once each",
    )
    _consumer_flags(consume, "consume")

    letters = commands.add_parser("dead-letters", help="list, replay or purge dead letters")
    actions = letters.add_subparsers(dest="dead_letters_command", required=True)
    listing = add_command(
        actions,
        "list",
        _run(_list),
        "the dead letters, oldest first",
        settings_of="dead-letters list",
    )
    _consumer_flags(listing, "dead-letters list")
    listing.add_argument(
        "--limit",
        type=int,
        default=100,
        help=f"the most to list (default 100, at most {DEAD_LETTERS_LIMIT})",
    )
    listing.add_argument("--json", action="store_true", help="machine-readable output")
    replay = add_command(
        actions,
        "replay",
        _run(_replay),
        "apply dead letters again through the handler, in order",
        settings_of="dead-letters replay",
    )
    replay.epilog = (
        f"exit status: 0 every chosen dead letter replayed (or a duplicate); 1 one failed "
        f"again; {EXIT_SKIPPED} some skipped and still there, none failed (another transaction "
        "held its lock: run the replay again; or it waits behind an earlier dead letter of "
        "its key); 2 bad usage"
    )
    _consumer_flags(replay, "dead-letters replay")
    replay.add_argument("--id", action="append", dest="ids", help="message id (repeatable)")
    purge = add_command(
        actions,
        "purge",
        _run(_purge),
        "delete dead letters for good",
        settings_of="dead-letters purge",
    )
    _consumer_flags(purge, "dead-letters purge")
    purge.add_argument("--id", action="append", dest="ids", help="message id (repeatable)")
    purge.add_argument("--all", action="store_true", help="every dead letter of the group")


def _consumer_flags(parser: argparse.ArgumentParser, command: str) -> None:
    add_flags(parser, ConsumerSettings, command)
    if command in ("consume", "dead-letters replay"):
        parser.add_argument(
            "handler_argument",
            nargs="?",
            metavar="module:function",
            help="the handler (or --handler, OUTBOXER_HANDLER, [consumer] handler)",
        )


def _run(command: Callable[[argparse.Namespace], Any]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        result: int = asyncio.run(command(args))
        return result

    return run


def _load(args: argparse.Namespace) -> tuple[Settings, ConsumerSettings]:
    consumer_flags = flags_from_args(args, ConsumerSettings)
    positional = getattr(args, "handler_argument", None)
    if positional is not None:
        if "handler" in consumer_flags:
            raise ConfigError("give the handler once: as the argument or as --handler")
        consumer_flags["handler"] = positional
    return load_consume_settings(
        flags_from_args(args, Settings), consumer_flags, config_file=args.config
    )


def _importable_here() -> None:
    """Handlers are imported as ``python -m`` would: from the current directory too (the
    ``outboxer`` script's own directory is what Python puts first on the path)."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())


def build_consumer(settings: Settings, own: ConsumerSettings, **overrides: Any) -> Consumer:
    """The ``Consumer`` these settings describe; ``overrides`` replace its arguments."""
    from outboxer import payload_admin
    from outboxer.consumer import Consumer

    destination = settings.destinations.get("default")
    arguments: dict[str, Any] = {
        "db": settings.require_db(),
        "broker": destination.broker if destination is not None else None,
        "group": own.require("group"),
        "handler": own.require("handler"),
        "topics": list(own.topics) if own.topics else None,
        "concurrency": own.concurrency,
        "batch": own.batch,
        "prefetch": own.prefetch,
        "max_attempts": settings.max_attempts,
        "backoff": settings.backoff,
        "abandoned_blocks_key": settings.abandoned_blocks_key,
        "schema": settings.schema,
        "table": settings.table,
        "shutdown_timeout": own.shutdown_timeout,
        "handler_timeout": own.handler_timeout,
        "name": own.name,
        "broker_options": dict(own.options or {}),
        # The default destination's options are the relay's publisher's (a settings file
        # shared with the relay): where it publishes (an exchange, a stream or subject
        # prefix, Kafka's config), which the receiver must read alike, not its own.
        "publisher_options": dict(destination.options) if destination is not None else {},
        "async_driver": own.async_driver,
        "exit_when_idle": settings.exit_when_idle,
        # Payload protection undone before the handler, with the relay's settings.
        "keyring": payload_admin.keyring(settings),
        "object_store": payload_admin.object_store(settings),
        "object_store_timeout": settings.claim_check_read_timeout,
    }
    if own.statement_timeout is not None:
        arguments["statement_timeout"] = own.statement_timeout
    arguments.update(overrides)
    if arguments["broker"] is None and "broker" not in overrides:
        raise ConfigError("no broker: pass --broker URL or set OUTBOXER_BROKER")
    return Consumer(**arguments)


async def _consume(args: argparse.Namespace) -> int:
    _importable_here()
    settings, own = _load(args)
    await run_consumer(build_consumer(settings, own), settings)
    return 0


async def run_consumer(consumer: Consumer, settings: Settings) -> ConsumerStats:
    """Run ``consumer`` until SIGTERM or SIGINT (or idle, with ``exit_when_idle``), with the
    HTTP API's metrics when ``settings.http`` is set; returns its counters.

    A second signal cuts the wait for the batches in flight short. Handlers that had not
    returned by then are named (ConsumerShutdownError, exit 1); if one still runs (a sync
    handler's thread cannot be interrupted), the process exits 1 here and now: the
    interpreter's exit would wait for that thread for ever, and the process's end closes
    its connection, which rolls back what the handler wrote."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, consumer.signalled)
    server = None
    if settings.http:
        from outboxer.consumer import ConsumerCollector
        from outboxer.http import start_http_api

        server = await start_http_api(settings, collectors=[ConsumerCollector([consumer])])
    try:
        return await consumer.run_async()
    except ConsumerShutdownError as exc:
        if exc.hung:
            _exit_now(EXIT_HUNG)
        raise
    finally:
        if server is not None:
            await server.close()


#: The exit status when handlers did not return at shutdown (the CLI's EXIT_ERROR).
EXIT_HUNG = 1
#: ``dead-letters replay``: none failed, but some were skipped and are still dead letters.
#: Not 0, which a script reads as "all replayed, the table is clean"; not 1, which says a
#: handler still fails: a lock held elsewhere clears up, and the same replay then works.
EXIT_SKIPPED = 3


def _exit_now(code: int) -> None:
    """Exit without waiting for the threads still running (os._exit), what was written
    to the log and to stdout first."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed, or its reader gone
            stream.flush()
    os._exit(code)


async def _replay(args: argparse.Namespace) -> int:
    _importable_here()
    settings, own = _load(args)
    consumer = build_consumer(settings, own, broker=None)  # replaying needs no broker
    counts = await consumer.replay_dead_letters(args.ids)
    print(", ".join(f"{name} {count}" for name, count in counts.items()))
    if counts["failed"]:
        return 1
    if counts["skipped"]:
        print(
            f"{counts['skipped']} dead letter(s) skipped and kept as they were (a lock held by "
            "another transaction, or an earlier dead letter of the key): run the replay again",
            file=sys.stderr,
        )
        return EXIT_SKIPPED
    return 0


async def _list(args: argparse.Namespace) -> int:
    from outboxer.consumer_db import NoAnswerError

    settings, own = _load(args)
    if not 1 <= args.limit <= DEAD_LETTERS_LIMIT:
        # Past a bigint (or SQLite's INTEGER) the database refuses it with its own error.
        raise ConfigError(f"--limit must be between 1 and {DEAD_LETTERS_LIMIT}, not {args.limit}")
    try:
        async with _session(settings, own) as session:
            letters = await session.dead_letters(own.group, args.limit)
    except NoAnswerError as exc:
        raise NoAnswerError(f"dead-letters list: {exc}") from exc
    _print_letters([letter.as_dict() for letter in letters], as_json=args.json)
    return 0


async def _purge(args: argparse.Namespace) -> int:
    from outboxer.consumer import parse_message_id
    from outboxer.consumer_db import NoAnswerError

    settings, own = _load(args)
    group = own.require("group")
    if args.all == bool(args.ids):
        raise ConfigError("purge needs --id ID (repeatable) or --all, not both")
    ids = [parse_message_id(value) for value in args.ids or []]
    from outboxer import payload_admin

    store = payload_admin.object_store(settings)
    held: list[str] = []  # the claim-check objects of the purged dead letters
    answered = True  # whether the store answered the releases (else it is not closed)
    deleted = 0
    try:
        try:
            async with _session(settings, own) as session:
                if args.all:
                    if store is not None:  # read first: one added meanwhile keeps its hold
                        held = await _held_objects(session, group)
                    deleted = await session.run("purge_consumer", {"consumer": group})
                else:
                    for message_id in ids:
                        letter = await session.dead_letter(group, message_id)
                        gone = await session.run("delete", session.id_params(group, message_id))
                        deleted += gone
                        if gone and letter is not None and store is not None:
                            held += claim_check_references(letter.delivery)
        except NoAnswerError as exc:
            # Each --id is a transaction of its own: those before it are purged (their holds
            # stay, kept too long, never lost); the one cut off perhaps (at its COMMIT).
            raise NoAnswerError(
                f"dead-letters purge: {exc}; {deleted} dead letter(s) purged before it: run "
                "it again once the database answers"
            ) from exc
        # The dead letters are gone (committed): their holds go now. A crash before keeps
        # the objects too long, never deletes one a dead letter still needs.
        if store is not None:
            answered = await asyncio.to_thread(
                release_holds, store, held, group, timeout=settings.claim_check_read_timeout
            )
    finally:
        if store is not None:
            from outboxer.claimcheck import close_store

            # Not after releases given up on: one more wait, and one more hung thread.
            if answered:
                close_store(store, timeout=settings.claim_check_read_timeout, log=logger)
    print(f"purged {deleted} dead letter(s)")
    return 0


def claim_check_references(delivery: Any) -> list[str]:
    return claim_check_names(delivery.headers)


def claim_check_names(headers: Mapping[str, Any] | None) -> list[str]:
    """The claim-check object a message's headers refer to (and a dead letter of it holds),
    as a list: empty without one, or with a name outboxer never makes."""
    from outboxer.claimcheck import HEADER_CLAIM_CHECK, ObjectName

    name = headers.get(HEADER_CLAIM_CHECK) if isinstance(headers, Mapping) else None
    return [name] if isinstance(name, str) and ObjectName.parse(name) is not None else []


async def _held_objects(session: Any, group: str) -> list[str]:
    from outboxer.consumer import REPLAY_PAGE_SIZE

    names: list[str] = []
    after = 0
    while True:
        page = await session.dead_letters_after(group, after, REPLAY_PAGE_SIZE)
        for letter in page:
            names += claim_check_references(letter.delivery)
        if len(page) < REPLAY_PAGE_SIZE:
            return names
        after = page[-1].seq


def release_holds(
    store: Any, names: Sequence[str], group: str, *, timeout: float | None = None
) -> bool:
    """Release ``group``'s holds on ``names``, once their dead letters are gone (committed):
    a failure is logged and keeps the object too long, never more. With ``timeout``, the
    releases are given up after that many seconds (``claim_check_read_timeout``): a store
    that stopped answering hung the purge, or Django admin's request, for ever. False when
    given up (logged; its thread goes on) or not tried for want of a free slot: the store
    is not answering, so the caller makes no more calls to it (each would wait as long)."""
    names = list(names)  # the releasing thread may outlive the caller's list

    def release_each() -> None:
        for name in names:
            try:
                store.delete_hold(name, group)
            except NotImplementedError:
                return
            except Exception as exc:  # noqa: BLE001 -- the object is kept too long, no more
                logger.warning(
                    "releasing the hold on claim-check object %s failed (%s): it is kept "
                    "until the hold is deleted",
                    name,
                    exc,
                )

    if not names:
        return True
    if timeout is None:
        release_each()
        return True
    from outboxer.claimcheck import run_bounded

    return run_bounded(
        release_each,
        timeout=timeout,
        what=f"releasing group {group!r}'s holds on {len(names)} claim-check object(s) "
        f"(the ones not released are kept until their holds are deleted)",
        log=logger,
    )


class _session:
    """A sync connection of the consumer's database, for ``list`` and ``purge``.

    Its connect and each statement give up after ``statement_timeout`` (the consumer's
    setting; unset, ``Session.statement_timeout``, a minute): NoAnswerError, the command
    exits 1 saying so, where a database that stopped answering held it for ever. In a
    daemon thread (DaemonThreadPool): one the bound cannot free (a hung file system under
    SQLite) does not hold the process's exit as well."""

    def __init__(self, settings: Settings, own: ConsumerSettings) -> None:
        from outboxer.consumer_db import DaemonThreadPool, session_factory

        self._executor = DaemonThreadPool(1, thread_name_prefix="outboxer-dead-letters")
        make = session_factory(
            settings.require_db(), settings.schema, is_async=False, async_driver=None
        )
        self.session = make(self._executor)
        if own.statement_timeout is not None:
            self.session.statement_timeout = own.statement_timeout

    async def __aenter__(self) -> Any:
        try:
            await self.session.open()
        except BaseException:
            self._executor.shutdown(wait=False)
            raise
        return self.session

    async def __aexit__(self, *exc_info: object) -> None:
        await self.session.close()
        self._executor.shutdown(wait=False)


def _print_letters(rows: Sequence[dict[str, Any]], *, as_json: bool) -> None:
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    if not rows:
        print("no dead letters")
    for row in rows:
        state = "held" if row["held"] else f"attempts={row['attempts']}"
        print(
            printable(
                f"{row['message_id']}  {row['consumer']:<16} {row['topic']:<24} key={row['key']} "
                f"{state} at {row['failed_at']} error={row['error']}"
            )
        )


__all__ = [
    "ConsumerSettings",
    "add_commands",
    "build_consumer",
    "claim_check_names",
    "load_consume_settings",
    "release_holds",
    "run_consumer",
]
