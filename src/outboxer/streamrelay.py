"""A relay for outboxes read by offset: PostgreSQL log mode and the WAL outbox.

These outboxes record no per-message status. A *source* hands out entries after its
stored checkpoint, in publish order; the relay publishes them and stores the checkpoint
of the longest prefix the broker confirmed. A failed message stops the stream there (a
key's later messages must not overtake it): the relay backs off and reads again from
the checkpoint, so messages after a failure may be published twice (at-least-once),
never skipped.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from outboxer.brokers.base import Outcome, Publisher
from outboxer.errors import BrokerUnavailableError, ConfigError, StoreError
from outboxer.message import Message
from outboxer.redact import get_logger

logger = get_logger("outboxer.streamrelay")


@dataclass(frozen=True, slots=True)
class Entry:
    """One step of a stream: a message to publish (or None: a step with nothing for this
    relay, such as a transaction without outbox messages) and where reading may resume
    after it (None inside a transaction, which is resumed from its start)."""

    message: Message | None
    checkpoint: object | None


class StreamSource(Protocol):
    """Where a stream relay reads: entries after the stored checkpoint, in publish order."""

    name: str

    async def connect(self) -> None: ...

    async def close(self) -> None: ...

    async def read(self, limit: int) -> list[Entry]:
        """Up to about ``limit`` entries after the stored checkpoint (whole transactions)."""
        ...

    async def commit(self, checkpoint: object) -> None:
        """Store ``checkpoint``: reading resumes after it, also after a restart."""
        ...

    async def idle(self) -> None:
        """Called when a read found nothing (the WAL source lets its slot move on)."""
        ...


@dataclass
class StreamStats:
    published: int = 0
    failed_rounds: int = 0
    commits: int = 0
    #: Rounds cut short by a lost database connection (the source then reconnects).
    outages: int = 0


def confirmed_checkpoint(
    entries: Sequence[Entry], outcomes: Sequence[Outcome]
) -> tuple[object | None, int, Outcome | None]:
    """The checkpoint after the longest confirmed prefix of ``entries``, how many messages
    that prefix holds, and the first outcome that was not a publish (None if all were).

    ``outcomes`` has one outcome per entry that holds a message, in order.
    """
    results = iter(outcomes)
    checkpoint: object | None = None
    published = 0
    for entry in entries:
        if entry.message is not None:
            outcome = next(results)
            if not outcome.published:
                return checkpoint, published, outcome
            published += 1
        if entry.checkpoint is not None:
            checkpoint = entry.checkpoint
    return checkpoint, published, None


async def run_stream_relay(
    source: StreamSource,
    publisher: Publisher,
    *,
    stop: asyncio.Event,
    batch_size: int = 500,
    poll_interval: float = 0.2,
    max_backoff: float = 30.0,
) -> StreamStats:
    """Publish ``source`` through ``publisher`` until ``stop`` is set."""
    stats = StreamStats()
    backoff = 0.0
    while not stop.is_set():
        if not publisher.connected:
            try:
                await publisher.connect()
            except BrokerUnavailableError as exc:
                backoff = _next_backoff(backoff, max_backoff)
                logger.warning(
                    "%s: broker unavailable (%s); retrying in %.1fs", source.name, exc, backoff
                )
                await _sleep(stop, backoff)
                continue
        try:
            entries = await source.read(batch_size)
            messages = [entry.message for entry in entries if entry.message is not None]
            outcomes = await publisher.publish_batch(messages) if messages else []
            checkpoint, published, failure = confirmed_checkpoint(entries, outcomes)
            if checkpoint is not None:
                await source.commit(checkpoint)
                stats.commits += 1
            if not messages:
                await source.idle()
        except Exception as exc:
            if not is_database_outage(exc):
                raise
            # The batch's checkpoint may not be stored: it is read and published again.
            stats.outages += 1
            backoff = _next_backoff(backoff, max_backoff)
            logger.warning(
                "%s: database unavailable (%s); reconnecting in %.1fs", source.name, exc, backoff
            )
            await _reconnect(source, stop, backoff)
            continue
        stats.published += published
        if failure is not None:
            stats.failed_rounds += 1
            backoff = max(_next_backoff(backoff, max_backoff), failure.retry_after or 0.0)
            logger.warning(
                "%s: publish failed (%s); the stream waits %.1fs and goes on from the last "
                "confirmed message%s",
                source.name,
                failure.error,
                backoff,
                "" if failure.retryable else " (the broker calls it permanent: fix it or skip it)",
            )
            await _sleep(stop, backoff)
            continue
        backoff = 0.0
        if not messages:
            await _sleep(stop, poll_interval)
    return stats


def is_database_outage(exc: BaseException) -> bool:
    """Whether ``exc`` means the database connection is gone or refused (the relay waits
    and reconnects), rather than a fault that retrying cannot mend (it propagates)."""
    if isinstance(exc, StoreError | OSError | ConnectionError | TimeoutError):
        return True
    module = type(exc).__module__.split(".", 1)[0]
    if module != "asyncpg":
        return False
    sqlstate = str(getattr(exc, "sqlstate", "") or "")
    name = type(exc).__name__
    # 08: connection exceptions; 57P: the server shutting down or not accepting yet.
    return sqlstate.startswith(("08", "57P")) or name in (
        "ConnectionDoesNotExistError",
        "InterfaceError",
        "InternalClientError",
    )


async def _reconnect(source: StreamSource, stop: asyncio.Event, first_wait: float) -> None:
    """Close ``source`` and connect it again, waiting before each try; returns once
    connected or stopped."""
    wait = first_wait
    while not stop.is_set():
        try:
            await source.close()
        except Exception as exc:
            if not is_database_outage(exc):
                raise
            logger.info("%s: closing the lost connection failed too: %s", source.name, exc)
        await _sleep(stop, wait)
        if stop.is_set():
            return
        try:
            await source.connect()
            logger.warning("%s: reconnected to the database", source.name)
            return
        except Exception as exc:
            if not is_database_outage(exc):
                raise
            wait = _next_backoff(wait, 30.0)
            logger.warning("%s: still no database (%s); next try in %.1fs", source.name, exc, wait)


def _next_backoff(current: float, limit: float) -> float:
    return min(limit, max(0.1, current * 2))


async def _sleep(stop: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except TimeoutError:
        return


def build_source(
    mode: str,
    url: str,
    destination: str,
    *,
    schema: str = "outboxer",
    table: str = "outbox",
    slot_prefix: str | None = None,
    retention_days: int | None = None,
) -> StreamSource:
    """The source of ``mode`` ("log" or "wal") for one destination."""
    if mode == "log":
        from outboxer.stores.pglog import PgLog

        return PgLog(url, schema=schema, table=table).reader(
            destination, retention_days=retention_days
        )
    if mode == "wal":
        from outboxer.stores.pgwal import PgWal

        return PgWal(url, schema=schema, table=table, slot_prefix=slot_prefix).reader(destination)
    raise ConfigError(f"--mode must be log or wal; got {mode!r}")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m outboxer.streamrelay``: relay one destination of a log or WAL outbox."""
    import argparse
    import signal
    from urllib.parse import urlsplit

    from outboxer.brokers import create_publisher
    from outboxer.config import check_url
    from outboxer.redact import redact_url

    parser = argparse.ArgumentParser(
        prog="python -m outboxer.streamrelay", description=main.__doc__
    )
    parser.add_argument("--mode", choices=("log", "wal"), required=True)
    parser.add_argument("--database", required=True, help="postgresql:// URL")
    parser.add_argument(
        "--broker", required=True, help="broker URL (amqp://, kafka://, file://...)"
    )
    parser.add_argument("--destination", default="default", help="reader (log) or slot (wal) name")
    parser.add_argument("--schema", default="outboxer")
    parser.add_argument("--table", default="outbox")
    parser.add_argument(
        "--slot-prefix", default=None, help="wal: slot names are PREFIX_DESTINATION"
    )
    parser.add_argument(
        "--apply-schema",
        action="store_true",
        help="log: create or upgrade the log's tables before relaying",
    )
    parser.add_argument(
        "--create-slot", action="store_true", help="wal: create the destination's slot if missing"
    )
    parser.add_argument(
        "--retention-days",
        type=int,
        default=None,
        help="log: drop the daily partitions older than this, once read by every reader",
    )
    parser.add_argument("--batch-size", type=int, default=500)
    parser.add_argument("--poll-interval", type=float, default=0.2)
    args = parser.parse_args(argv)
    if args.batch_size < 1 or args.poll_interval <= 0:
        parser.error("--batch-size must be >= 1 and --poll-interval > 0")
    if args.retention_days is not None and (args.retention_days < 0 or args.mode != "log"):
        parser.error("--retention-days is for --mode log, and must be >= 0")

    try:
        check_url(args.database, "--database")
        if urlsplit(args.database).scheme not in ("postgresql", "postgres", "postgresql+asyncpg"):
            raise ConfigError(
                f"--database must be a postgresql:// URL; got {redact_url(args.database)!r}"
            )
    except ConfigError as exc:
        parser.error(str(exc))

    async def run() -> None:
        if args.apply_schema and args.mode == "log":
            from outboxer.stores.pglog import PgLog

            log = PgLog(args.database, schema=args.schema, table=args.table)
            async with log:
                await log.apply_schema()
        if args.create_slot and args.mode == "wal":
            from outboxer.stores.pgwal import PgWal

            wal = PgWal(
                args.database, schema=args.schema, table=args.table, slot_prefix=args.slot_prefix
            )
            async with wal:
                await wal.create_slot(args.destination)
        source = build_source(
            args.mode,
            args.database,
            args.destination,
            schema=args.schema,
            table=args.table,
            slot_prefix=args.slot_prefix,
            retention_days=args.retention_days,
        )
        publisher = create_publisher(args.broker)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        await source.connect()
        try:
            await run_stream_relay(
                source,
                publisher,
                stop=stop,
                batch_size=args.batch_size,
                poll_interval=args.poll_interval,
            )
        finally:
            await publisher.close()
            await source.close()

    try:
        asyncio.run(run())
    except (ConfigError, StoreError) as exc:
        print(f"outboxer streamrelay: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ConfigError) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
