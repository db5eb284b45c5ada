"""The Store port: one adapter per database, the relay and the CLI speak only to this."""

from __future__ import annotations

import asyncio
import datetime
import itertools
import json
import random
import re
import uuid
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from outboxer.config import Settings
from outboxer.errors import ConfigError, SchemaError, StoreError
from outboxer.message import Message
from outboxer.redact import Log, redact_text, register_url_secrets
from outboxer.stores.pgpartitions import PARTITIONED, PartitionPolicy, PartitionReport
from outboxer.stores.sqlfiles import Migration, adopted_tables, migrations, quote_ident, render

R = TypeVar("R")

if TYPE_CHECKING:
    from outboxer.admin import MessageFilter

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,40}$")

#: The most characters of an error a row keeps in ``last_error``; the rest is cut, with a
#: marker. A broker's error can quote a whole response body (megabytes from a webhook).
MAX_ERROR_LENGTH = 2000
#: NUL (PostgreSQL's text refuses it) and lone surrogates (not encodable as UTF-8: every
#: driver refuses them); each becomes U+FFFD, the replacement character.
_UNSTORABLE = re.compile(r"[\x00\ud800-\udfff]")

#: ``Store.status`` counts every row of a table this small (by a bound each store reads
#: without a scan): a pass over it costs milliseconds. A bigger table's PUBLISHED rows of a
#: first attempt are estimated; everything else is still counted exactly, through an index.
EXACT_STATUS_ROWS = 20_000
#: Rows a sampled estimate of the PUBLISHED rows looks up by seq (MySQL, SQLite): a few
#: milliseconds of primary-key lookups; its error is about one percent of the table.
STATUS_SAMPLE_SIZE = 1000


def storable_error(text: str) -> str:
    """``text`` as every supported database stores it: no NUL, valid UTF-8 (no lone
    surrogates), at most ``MAX_ERROR_LENGTH`` characters, the cut marked; URL passwords and
    registered secrets masked, as in log lines (``/messages``, the dashboard and
    ``outboxer messages`` show it; a broker or a driver may quote a URL). Idempotent."""
    text = redact_text(text)
    if len(text) > MAX_ERROR_LENGTH:
        marker = f" … [cut: {len(text)} characters in all]"
        text = text[: MAX_ERROR_LENGTH - len(marker)] + marker
    return _UNSTORABLE.sub("\ufffd", text)


class StoreDataError(StoreError):
    """The database refused the values of a statement (a data error or a constraint, not an
    outage): the same statement would fail again, so retrying it cannot help."""


@dataclass(frozen=True)
class Failure:
    """One failed publish to record: seq, error text, backoff delay, permanent or not.

    ``error`` is made storable on construction (see ``storable_error``): a broker's error
    text, whatever it holds, can always be recorded.
    """

    seq: int
    error: str
    delay: float
    permanent: bool

    def __post_init__(self) -> None:
        object.__setattr__(self, "error", storable_error(self.error))


@dataclass(frozen=True)
class Lease:
    """Who holds the rows of one claim: the relay that claimed them, and the claim's own token.

    Every claim writes a fresh token on its rows; a settle or a renewal changes a row only
    while the row still holds that token (a fencing token). A holder whose lease expired
    and was taken over, by another relay or by another loop of the same relay (both share
    ``relay_id``), changes nothing.
    """

    relay_id: str
    token: str

    @classmethod
    def new(cls, relay_id: str) -> Lease:
        return cls(relay_id, str(uuid.uuid4()))


@dataclass(frozen=True)
class AbandonedRow:
    """A row a claim gave up: its relay died (or stalled) while publishing it, and that
    attempt was its last (``max_attempts``)."""

    id: uuid.UUID
    seq: int
    topic: str
    key: str | None
    attempts: int
    error: str


#: What reading a claimed row raises when the row was not written by ``enqueue`` (a hand
#: written INSERT, another language's writer): a malformed id, headers or JSON.
UNREADABLE_ROW = (ValueError, TypeError, KeyError, AttributeError, UnicodeError)


def parse_headers(text: str | bytes) -> dict[str, str]:
    """A row's headers: a JSON object of strings, or ValueError."""
    if text == "{}":  # most messages carry no headers: no JSON parser (hot path, once a row)
        return {}
    value = json.loads(text)
    if not isinstance(value, dict) or not all(
        isinstance(name, str) and isinstance(item, str) for name, item in value.items()
    ):
        raise ValueError(f"headers must be a JSON object of strings; got {str(text)[:80]}")
    return value


def read_rows(
    rows: Iterable[R], build: Callable[[R], Message], describe: Callable[[R, str], AbandonedRow]
) -> tuple[list[Message], list[AbandonedRow]]:
    """The messages of claimed ``rows``, and the rows that do not read as one (see
    ``Store.abandon_unreadable``): one bad row must not fail its whole batch."""
    messages: list[Message] = []
    unreadable: list[AbandonedRow] = []
    for row in rows:
        try:
            messages.append(build(row))
        except UNREADABLE_ROW as exc:
            unreadable.append(describe(row, f"unreadable row: {type(exc).__name__}: {exc}"))
    return messages, unreadable


def row_id(value: object) -> uuid.UUID:
    """A claimed row's id as a UUID; the nil UUID for one that is not (it says which row
    only through its seq, in the error that abandons it)."""
    try:
        return value if isinstance(value, uuid.UUID) else uuid.UUID(str(value))
    except ValueError:
        return uuid.UUID(int=0)


class Claim(list[Message]):
    """The messages one claim took, in publish order, with the claim's lease.

    ``recovered``: the claim took over one row from an expired lease, alone (its relay
    died or stalled while publishing it). ``recovery_waiting``: it was not to recover, found
    such a row, and took nothing. ``abandoned``: the rows it gave up (see ``Store.claim``).
    """

    def __init__(
        self,
        messages: Iterable[Message] = (),
        *,
        lease: Lease,
        recovered: bool = False,
        recovery_waiting: bool = False,
        abandoned: Iterable[AbandonedRow] = (),
    ) -> None:
        super().__init__(messages)
        self.lease = lease
        self.recovered = recovered
        self.recovery_waiting = recovery_waiting
        self.abandoned = list(abandoned)


@dataclass
class SettleResult:
    published: int = 0
    failed: int = 0
    released: int = 0
    #: Rows the lease no longer held (it expired and another claim took them over).
    lost: int = 0


@dataclass
class DestinationStatus:
    destination: str
    counts: dict[str, int] = field(default_factory=dict)
    oldest_pending_age: float | None = None
    retried: int = 0
    #: ``counts["PUBLISHED"]`` is an estimate (a big table: see ``Store.status``); every
    #: other count, ``retried`` and ``oldest_pending_age`` are exact all the same.
    published_estimated: bool = False

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def retry_rate(self) -> float:
        """Share of the rows in the table that needed more than one attempt."""
        return self.retried / self.total if self.total else 0.0

    def as_dict(self) -> dict[str, object]:
        return {
            "destination": self.destination,
            "counts": dict(self.counts),
            "oldest_pending_age_seconds": self.oldest_pending_age,
            "retry_rate": round(self.retry_rate, 4),
            "abandoned": self.counts.get("ABANDONED", 0),
            "published_estimated": self.published_estimated,
        }


def fold_counts(rows: Sequence[Mapping[str, Any]]) -> list[DestinationStatus]:
    """Rows of (destination, status, count, retried, oldest_age) -> one report per destination."""
    by_destination: dict[str, DestinationStatus] = {}
    for row in rows:
        entry = by_destination.setdefault(row["destination"], DestinationStatus(row["destination"]))
        entry.counts[row["status"]] = int(row["count"])
        entry.retried += int(row["retried"] or 0)
        if row["status"] in ("PENDING", "FAILED", "PROCESSING") and row["oldest_age"] is not None:
            age = float(row["oldest_age"])
            entry.oldest_pending_age = max(entry.oldest_pending_age or 0.0, age)
    return sorted(by_destination.values(), key=lambda s: s.destination)


def with_published_estimates(
    counted: Sequence[DestinationStatus], first_attempts: Mapping[str, float]
) -> list[DestinationStatus]:
    """``counted`` (every row but the PUBLISHED ones of a first attempt, exactly: a store's
    counts_tally) plus the estimated PUBLISHED rows of a first attempt per destination;
    every PUBLISHED count is then flagged an estimate. A destination known only from the
    estimate gets an entry of its own."""
    by_destination = {entry.destination: entry for entry in counted}
    for destination, estimate in first_attempts.items():
        rows = round(estimate)
        if rows > 0:
            entry = by_destination.setdefault(destination, DestinationStatus(destination))
            entry.counts["PUBLISHED"] = entry.counts.get("PUBLISHED", 0) + rows
    for entry in by_destination.values():
        entry.published_estimated = True
    return sorted(by_destination.values(), key=lambda s: s.destination)


def sample_seqs(first: int, last: int, size: int = STATUS_SAMPLE_SIZE) -> list[int]:
    """``size`` seqs drawn from ``first..last``: the range cut into ``size`` equal slices,
    one seq drawn at random in each. Each seq has the same chance (1 / its slice's length,
    equal to within one), and a slice follows the mix of destinations of its stretch of
    time, so the sample does better than ``size`` independent draws; drawn, not evenly
    spaced, because rows written in a pattern (every tenth for one destination) would bias
    a fixed stride. The same seqs while ``last`` is the same: two calls in a row agree."""
    span = last - first + 1
    size = min(size, span)
    draw = random.Random(last)
    cuts = [first + span * i // size for i in range(size + 1)]
    return [draw.randrange(start, end) for start, end in itertools.pairwise(cuts)]


def estimate_from_sample(
    hits: Mapping[str, int], sampled: int, first: int, last: int
) -> dict[str, float]:
    """Rows per destination in seqs ``first..last``, from ``hits`` among ``sampled`` seqs
    drawn there at random: every seq of the range has the same chance to be drawn, a seq
    whose row was deleted included, so hits / sampled estimates the share of the range."""
    span = last - first + 1
    return {destination: span * count / sampled for destination, count in hits.items()}


#: Tables of a schema (a MySQL database, a SQLite file) that every outbox table in it shares.
SHARED_TABLES = frozenset({"inbox", "dead_letters", "inbox_suspects"})


def copied_once(
    copy: Callable[[Sequence[Message]], list[Message]],
    originals: Sequence[Message],
    made: dict[int, list[Message]],
) -> list[Message]:
    """A replay's copies of ``originals`` (MySQL and PostgreSQL stores: a replay tried again
    after a deadlock), in their order, ``copy`` called with one original at a time, so
    that one it leaves out (a shredded subject's) is known.

    ``made`` keeps across a replay's tries, by the original's seq, what must not be done
    twice: copies whose claim-check object was put (the next try inserts the same copy, its
    object named after its id) and originals the copier left out (counted as shredded once,
    not offered again). Any other copy leaves nothing behind to make again (at most the key
    source is asked again), and is not kept: ``made`` holding every copy, payload and all, a
    replay of a long history held all of it in memory until it committed, where a page's
    copies are dropped once written (admin.REPLAY_PAGE). What it keeps is a reference's
    headers (the payload is in the object) or nothing."""
    from outboxer.claimcheck import HEADER_CLAIM_CHECK

    copies: list[Message] = []
    for original in originals:
        seq = original.seq
        assert seq is not None  # read from the table
        kept = made.get(seq)
        if kept is None:
            kept = copy([original])
            if not kept or any(HEADER_CLAIM_CHECK in made_copy.headers for made_copy in kept):
                made[seq] = kept
        copies.extend(kept)
    return copies


def adopted_by(pending: Iterable[Migration]) -> set[str]:
    """The tokens of the tables that ``pending`` migrations create only if missing (CREATE
    TABLE IF NOT EXISTS: the shared inbox and dead letters, MySQL's outbox tables)."""
    return {token for migration in pending for token in adopted_tables(migration.sql)}


def refuse_foreign_tables(
    pending: Iterable[Migration], tokens: Mapping[str, str], columns: Mapping[str, Iterable[str]]
) -> None:
    """SchemaError if a table that a pending migration creates only if missing exists
    without the columns the migration gives it: someone else's table of that name, that the
    consumer would fail on later with an obscure SQL error, or write into.

    ``columns``: by token (``adopted_by``), the columns of the table that exists under that
    name, none if there is none. Called before the first pending migration runs, so that a
    refusal changes nothing, MySQL's DDL that commits by itself included."""
    for migration in pending:
        for token, expected in adopted_tables(migration.sql).items():
            found = {column.lower() for column in columns.get(token, ())}
            missing = [column for column in expected if column not in found]
            if found and missing:
                raise SchemaError(
                    f"table {tokens[token]} exists but is not outboxer's: migration "
                    f"{migration.name} would adopt it, and it lacks column(s) "
                    f"{', '.join(missing)}. Rename or move that table, or give outboxer "
                    "a schema (MySQL: a database) of its own; nothing was changed"
                )


def check_identifier(kind: str, name: str) -> str:
    if not _IDENTIFIER.fullmatch(name):
        raise ConfigError(
            f"{kind} name {name!r} must start with a letter or underscore and hold only "
            "letters, digits and underscores (at most 41 characters)"
        )
    return name


class Store(ABC):
    """An outbox table in one database."""

    dialect: str
    #: Up to this many rows ``status`` counts everything exactly (see EXACT_STATUS_ROWS).
    exact_status_rows = EXACT_STATUS_ROWS
    #: After a batch smaller than asked for (the relay has caught up), the relay waits in
    #: ``wait_for_wakeup`` before claiming again, so that the next batch gathers more than a
    #: handful of rows. Only for stores whose wait is short while work keeps coming.
    gathers_batches = False

    def __init__(self, url: str, *, schema: str = "outboxer", table: str = "outbox") -> None:
        self.url = url
        register_url_secrets(url)  # masked in every outboxer log line from now on
        self.schema = check_identifier("schema", schema)
        self.table = check_identifier("table", table)
        if table.lower() in SHARED_TABLES:
            # The outbox would be created under the shared table's name, and the migration
            # that makes the shared table would then find it there and take it for its own.
            raise ConfigError(
                f"table name {table!r} is the name of outboxer's {table.lower()} table, "
                "shared by every outbox in the schema: choose another one"
            )

    # Names used in the SQL files.
    def tokens(self) -> dict[str, str]:
        return {
            "schema": quote_ident(self.schema),
            "table_raw": self.table,
            "outbox": f"{quote_ident(self.schema)}.{quote_ident(self.table)}",
            "migrations": f"{quote_ident(self.schema)}.{quote_ident(self.table + '_migrations')}",
            "inbox": f"{quote_ident(self.schema)}.{quote_ident('inbox')}",
            "dead_letters": f"{quote_ident(self.schema)}.{quote_ident('dead_letters')}",
            "inbox_suspects": f"{quote_ident(self.schema)}.{quote_ident('inbox_suspects')}",
            "listeners": f"{quote_ident(self.schema)}.{quote_ident(self.table + '_listeners')}",
            "channel_literal": "'" + self.channel + "'",
        }

    @property
    def channel(self) -> str:
        """The LISTEN/NOTIFY channel of this table."""
        return f"outboxer_{self.schema}_{self.table}"[:63]

    def lock_key(self, destination: str) -> int:
        """A stable 63-bit key for the per-destination claim lock."""
        return zlib.crc32(f"outboxer:{self.schema}.{self.table}:{destination}".encode())

    @abstractmethod
    async def connect(self) -> None: ...

    @abstractmethod
    async def close(self) -> None: ...

    #: DDL of the table that records applied migrations (tokens in braces).
    migrations_table_sql: str = ""

    def schema_sql(self, *, partitioned: bool = False) -> str:
        """The whole DDL, for teams that run their own migrations, recording each version.

        ``partitioned``: the partitioned layout's (PostgreSQL only)."""
        if partitioned and self.dialect != "postgres":
            raise ConfigError(f"the partitioned outbox needs PostgreSQL, not {self.dialect}")
        tokens = self.tokens()
        parts = [render(self.migrations_table_sql, tokens).strip()]
        for migration in migrations(self.dialect, PARTITIONED if partitioned else None):
            parts.append(render(migration.sql, tokens).strip())
            parts.append(
                self.record_migration_sql(tokens["migrations"], migration.version, migration.name)
            )
        if partitioned:
            parts.append(
                "-- Partitions by time: a running relay, or `outboxer cleanup`, makes them "
                "ahead and drops them\n-- past retention; until the first run, rows go to "
                "the default partition (and are moved then)."
            )
        return "\n\n".join(parts) + "\n"

    def record_migration_sql(self, table: str, version: int, name: str) -> str:
        """The statement of ``schema_sql`` that records one migration (a no-op if recorded)."""
        return f"INSERT INTO {table} (version, name) VALUES ({version}, '{name}') ON CONFLICT DO NOTHING;"

    @abstractmethod
    async def apply_schema(self) -> list[str]:
        """Create or upgrade the schema; return the migrations applied now."""

    @abstractmethod
    async def applied_migrations(self) -> set[int]:
        """Versions recorded in the migrations table (empty if there is none yet)."""

    async def layout(self) -> str | None:
        """The outbox table's layout where a database has several (PostgreSQL's
        ``partitioned``); None for the default table."""
        return None

    async def is_partitioned(self) -> bool:
        """Whether retention drops whole partitions (``maintain_partitions``) rather than
        deleting rows (``cleanup``)."""
        return await self.layout() == PARTITIONED

    async def maintain_partitions(
        self, policy: PartitionPolicy, *, now: datetime.datetime | None = None
    ) -> PartitionReport:
        """Create the partitions ahead and drop those past retention (see
        outboxer.stores.pgpartitions); only for a partitioned outbox."""
        raise StoreError(f"the outbox {self.schema}.{self.table} has no partitions")

    async def check_schema(self) -> None:
        """Raise SchemaError unless every migration this version knows has been applied."""
        layout = await self.layout()
        applied = await self.applied_migrations()
        missing = [m.name for m in migrations(self.dialect, layout) if m.version not in applied]
        if missing:
            where = f"{self.schema}.{self.table}" if self.dialect == "postgres" else self.table
            if layout is not None:
                where += f" ({layout} layout)"
            raise SchemaError(
                f"the outbox schema of {where} lacks migration(s) {', '.join(missing)}: "
                "run `outboxer schema apply` (or apply the DDL of `outboxer schema sql`)"
            )

    @abstractmethod
    async def claim(
        self,
        destination: str,
        relay_id: str,
        limit: int,
        lock_seconds: float,
        abandoned_blocks: bool,
        *,
        max_attempts: int = Settings.max_attempts,
        recover: bool = True,
        max_bytes: int = Settings.claim_max_bytes,
    ) -> Claim:
        """Take due rows under a new lease lasting ``lock_seconds``, in publish order.

        In one transaction, under the destination's lock: rows whose lease expired (their
        relay died or stalled while publishing them) with their attempts used up, counting
        the one that died, become ABANDONED (``Claim.abandoned``). Then, if a row whose
        lease expired heads its key, the claim takes that row alone, the earliest one, and
        counts the attempt that died (``Claim.recovered``): a message that kills its relay
        dies alone, and its batch-mates are recovered one a claim. Unless ``recover`` is
        false (the caller holds other rows, which would die with it): then it takes nothing
        and says so (``Claim.recovery_waiting``). Otherwise it takes up to ``limit`` due
        PENDING and FAILED rows that no earlier row of their key holds back, in seq order,
        stopping once the stored payloads it took reach ``max_bytes``: at least one row (a
        larger payload is taken alone), and never a row after one it left out.
        """

    @abstractmethod
    async def renew(
        self, destination: str, lease: Lease, seqs: Sequence[int], lock_seconds: float
    ) -> int:
        """Extend the lease on ``seqs`` to ``lock_seconds`` from now, in one statement, on the
        rows that still hold it; return how many did (fewer: the others were taken over)."""

    @abstractmethod
    async def settle(
        self,
        destination: str,
        lease: Lease,
        published: Sequence[int],
        failed: Sequence[Failure],
        released: Sequence[int],
        max_attempts: int,
    ) -> SettleResult:
        """Record a batch's outcomes in one transaction, one statement per outcome, on the
        rows that still hold ``lease``."""

    async def abandon_unreadable(
        self, destination: str, claim: Claim, unreadable: Sequence[AbandonedRow], max_attempts: int
    ) -> None:
        """PROCESSING -> ABANDONED for claimed rows that do not read as a message (see
        ``read_rows``), under the claim's lease, in one settle; they join ``claim.abandoned``,
        which the relay logs. Never published: retried, a malformed row fails the same way,
        and failing its claim instead would hold its batch-mates until their lease ran out.
        """
        if not unreadable:
            return
        failures = [Failure(row.seq, row.error, 0.0, True) for row in unreadable]
        await self.settle(destination, claim.lease, [], failures, [], max_attempts)
        claim.abandoned.extend(unreadable)
        if not claim:  # the recovered row was the bad one: nothing is held alone any more
            claim.recovered = False

    @abstractmethod
    async def cleanup(self, status: str, retention: float, limit: int) -> int:
        """Delete up to ``limit`` rows of ``status`` older than ``retention`` seconds."""

    @abstractmethod
    async def cleanup_inbox(self, retention: float, limit: int) -> int:
        """Delete up to ``limit`` inbox entries older than ``retention`` seconds, and up to
        ``limit`` consumer suspect rows whose latest attempt was recorded before that (their
        ``first_seen``, set again at each attempt); how many of both."""

    @abstractmethod
    async def status(self) -> list[DestinationStatus]:
        """Rows per destination and status, the oldest unfinished row's age, the retries.

        Cheap on a big table: no statement reads the published history. The unfinished
        (PENDING, PROCESSING, FAILED) and ABANDONED rows, the retried ones and the oldest
        age are always exact, read through an index that holds only them and the PUBLISHED
        rows that needed more than one attempt. On a table of more than
        ``exact_status_rows`` rows the PUBLISHED rows of a first attempt are estimated, and
        ``published_estimated`` says so; a smaller table is counted row by row.
        """

    async def oldest_transaction(self) -> float | None:
        """Seconds the oldest open writing transaction has run; None where the database cannot tell."""
        return None

    async def bound_wal(self, *, log: Log | None = None) -> int | None:
        """After the relay's cleanup round: shrink the database's write-ahead file if a burst
        grew it, and return its bytes; None where the server owns its WAL (only SQLite's is
        a file beside the application's, see SqliteStore.bound_wal)."""
        return None

    async def status_report(self) -> dict[str, Any]:
        """What ``outboxer status --json`` prints and ``GET /status`` returns."""
        destinations = [entry.as_dict() for entry in await self.status()]
        return {
            "destinations": destinations,
            "oldest_transaction_age_seconds": await self.oldest_transaction(),
        }

    @abstractmethod
    async def ping(self) -> None:
        """Run a trivial query (connecting first if need be); raise if the database does not answer."""

    @abstractmethod
    async def list_messages(self, statuses: Sequence[str], limit: int) -> list[dict[str, object]]:
        """Up to ``limit`` rows in ``statuses``, the newest change first (updated_at, then
        seq, both descending: a stable order), each read through an index that stops after
        ``limit`` rows per status, however many rows the table holds."""

    @abstractmethod
    async def requeue(
        self, destinations: Sequence[str], statuses: Sequence[str], ids: Sequence[str] | None
    ) -> int: ...

    # Wake-ups are per destination: a commit may hold rows for several destinations, and
    # each destination's loops must hear of it (one destination's loop taking the only
    # wake-up would leave the others asleep until their poll interval).

    def configure_wakeups(
        self, *, wake_on_commit_below: float, busy_poll_interval: float | None = None
    ) -> None:
        """The relay's ``wake_on_commit_below`` and ``busy_poll_interval`` settings, for
        stores that can be woken by a commit (PostgreSQL's NOTIFY) and would rather poll
        under load (None: the store's default poll)."""
        return None

    def reset_wakeup(self, destination: str) -> None:
        """Forget the destination's earlier wake-ups; called just before a claim, so none
        is missed after it."""
        return None

    def nudge(self, destination: str) -> None:
        """Wake one of the destination's loops waiting in ``wait_for_wakeup``: more work is
        likely there."""
        return None

    async def wait_for_wakeup(self, destination: str, timeout: float) -> bool:
        """Sleep until new messages may be there for ``destination`` or ``timeout`` passes;
        True if woken early."""
        await asyncio.sleep(timeout)
        return False

    # ----- operators' changes by filter (outboxer.admin checks the filters) ---------------
    # Each runs in one transaction; the SQL and its invariants are in sql/<dialect>/admin.sql.

    async def count_matching(self, where: MessageFilter) -> dict[str, dict[str, int]]:
        """The rows ``where`` matches, counted by destination, then status."""
        raise NotImplementedError(f"{type(self).__name__} has no admin operations")

    async def purge(self, where: MessageFilter) -> int:
        """Delete the rows ``where`` matches, never a PROCESSING one; return how many."""
        raise NotImplementedError(f"{type(self).__name__} has no admin operations")

    async def requeue_matching(self, where: MessageFilter) -> int:
        """ABANDONED | FAILED rows ``where`` matches -> PENDING, due now, attempts reset;
        never one with a later row of its key in flight (admin.sql: requeue_matching)."""
        raise NotImplementedError(f"{type(self).__name__} has no admin operations")

    async def requeue_matching_counted(self, where: MessageFilter) -> tuple[int, int]:
        """``requeue_matching``, and the matching rows it left because a later row of their
        key is in flight (``count_requeue_deferred`` in its transaction)."""
        raise NotImplementedError(f"{type(self).__name__} has no admin operations")

    async def count_requeue_deferred(self, where: MessageFilter) -> int:
        """The ABANDONED | FAILED rows ``where`` matches that a requeue would leave now: a
        later row of their key is in flight."""
        raise NotImplementedError(f"{type(self).__name__} has no admin operations")

    async def replay(
        self, where: MessageFilter, copy: Callable[[Sequence[Message]], list[Message]]
    ) -> int:
        """Insert ``copy``'s rows for the PUBLISHED rows ``where`` matches, read in seq order a
        page at a time (``copy`` runs in a worker thread); return how many were inserted."""
        raise NotImplementedError(f"{type(self).__name__} has no admin operations")

    async def __aenter__(self) -> Store:
        await self.connect()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
