"""Operators' changes to the outbox: purge, replay and requeue messages chosen by a filter.

``outboxer purge|replay|requeue`` and the HTTP API's ``POST /messages/purge|replay|requeue``
both come here, so both validate alike and behave alike:

* A :class:`MessageFilter` says which rows: ids, destinations, topics, keys, statuses, an
  age or a creation time range, a substring of the last error. It is checked when it is
  made (:class:`~outboxer.errors.AdminRequestError`, nothing read or changed); the criteria
  combine with AND, the values of one criterion with OR.
* **purge** deletes the matching rows. It needs a filter (or ``everything``: an empty filter
  must not delete the outbox by accident), and never touches PROCESSING rows: a relay holds
  them and is publishing them; asking for them is refused.
* **replay** copies matching PUBLISHED rows as new PENDING rows (new ids, the same topic,
  key, payload and headers, plus ``replay-of: <original id>``) for a destination (default:
  each row's own), in the originals' order, so each key's copies keep its order.
* **requeue** makes matching ABANDONED (or FAILED) rows PENDING again, due now, attempts
  reset; a row with a later row of its key in flight is left as it is and counted as
  ``deferred`` (made PENDING, the claim took it beside that row, and the two reached the
  broker in either order: docs/design/ordering.md); requeue it again once the key's
  in-flight rows are settled.

Each one is a single transaction in the store (the SQL and its invariants are in
``stores/sql/<dialect>/admin.sql``); ``dry_run`` counts the rows it would change, by
destination and status, and changes nothing.

Replay and payload protection: a copy is a new message, and the payload's protection is
bound to the message. An encrypted payload's associated data names the message id and the
destination (outboxer.crypto), so ciphertext copied as is would never authenticate under
the copy's id; and a claim-checked row may fetch only an object named after its own id
(outboxer.claimcheck). So :class:`ReplayCopier` decrypts each encrypted original and
encrypts the copy for its own id and destination (under the ring's current key, the same
subject, the same sealed headers), and gives each claim-checked copy an object of its own.
A copy never shares the original's object: retention deletes the original row, and the
sweep then its object, whenever the original's time comes, and the copy is unaffected.
"""

from __future__ import annotations

import asyncio
import errno
import math
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from outboxer.claimcheck import (
    DEFAULT_PUT_TIMEOUT,
    DEFAULT_READ_TIMEOUT,
    HEADER_CLAIM_CHECK,
    ClaimCheck,
    ClaimCheckError,
    ClaimCheckStoreError,
    ObjectDeleteTimeoutError,
    ObjectReadTimeoutError,
    ObjectStore,
    close_store,
    delete_many_bounded,
    fetch_payload,
    is_claim_checked,
)
from outboxer.crypto import (
    HEADER_SEALED_HEADERS,
    HEADER_SUBJECT,
    EncryptionError,
    KeyRing,
    KeyRingUnavailableError,
    SubjectKeyDeletedError,
    decrypt,
    encrypt_message,
    fetch_message_keys_sync,
    is_encrypted,
)
from outboxer.errors import AdminRequestError, ConfigError, PayloadError, ReplayError
from outboxer.message import (
    MAX_DESTINATION_LENGTH,
    Message,
    Status,
    check_text,
    destination_name_problem,
    uuid7,
)
from outboxer.redact import get_logger

if TYPE_CHECKING:
    from outboxer.stores.base import Store

logger = get_logger("outboxer.admin")

#: The header a replayed copy carries: the id of the row it copies.
HEADER_REPLAY_OF = "replay-of"
#: Rows a replay reads (and copies) at a time, inside its one transaction.
REPLAY_PAGE = 500

ALL_STATUSES = tuple(status.value for status in Status)
#: What purge deletes when no status is given: everything a relay does not hold.
PURGEABLE = tuple(s for s in ALL_STATUSES if s != Status.PROCESSING.value)
REQUEUEABLE = (Status.ABANDONED.value, Status.FAILED.value)

#: The filter's fields, as the HTTP API's JSON names them.
FILTER_FIELDS = frozenset(
    {
        "ids",
        "destinations",
        "topics",
        "keys",
        "statuses",
        "older_than",
        "created_after",
        "created_before",
        "error",
    }
)

#: Counts by destination, then by status.
Counts = dict[str, dict[str, int]]
#: Copies a page of PUBLISHED originals (seq order) as the rows to insert, in that order.
CopyPage = Callable[[Sequence[Message]], list[Message]]


# ----- the filter ----------------------------------------------------------------------------


@dataclass(frozen=True)
class MessageFilter:
    """Which rows an operator's change applies to: every given criterion must hold (AND),
    and a row matches a list criterion when it equals one of its values (OR).

    ``older_than`` is seconds since the row was created (the database's clock);
    ``created_after`` (inclusive) and ``created_before`` (exclusive) are times, UTC when
    they carry no offset; ``error`` is a case-sensitive substring of ``last_error``.
    Values are checked here: AdminRequestError names the field and what is wrong.
    """

    ids: tuple[uuid.UUID, ...] | None = None
    destinations: tuple[str, ...] | None = None
    topics: tuple[str, ...] | None = None
    keys: tuple[str, ...] | None = None
    statuses: tuple[str, ...] | None = None
    older_than: float | None = None
    created_after: datetime | None = None
    created_before: datetime | None = None
    error: str | None = None

    def __post_init__(self) -> None:
        if self.ids is not None:
            self._set(
                "ids", _unique(_message_id(value, "ids") for value in _items(self.ids, "ids"))
            )
        for name in ("destinations", "topics", "keys"):
            values = getattr(self, name)
            if values is not None:
                self._set(name, _unique(_text(value, name) for value in _items(values, name)))
        if self.statuses is not None:
            statuses = _unique(
                _text(value, "statuses") for value in _items(self.statuses, "statuses")
            )
            self._set("statuses", check_statuses(statuses, ALL_STATUSES, "statuses"))
        if self.older_than is not None:
            self._set("older_than", _seconds(self.older_than, "older_than"))
        for name in ("created_after", "created_before"):
            moment = getattr(self, name)
            if moment is not None:
                self._set(name, _utc(moment, name))
        after, before = self.created_after, self.created_before
        if after is not None and before is not None and after >= before:
            raise AdminRequestError(
                f"created_after ({after.isoformat()}) must be earlier than created_before "
                f"({before.isoformat()})"
            )
        if self.error is not None:
            self._set("error", _text(self.error, "error"))

    def _set(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)  # frozen: the checked value replaces the given one

    @property
    def empty(self) -> bool:
        """No criterion at all: the filter matches every row."""
        return all(getattr(self, name) is None for name in FILTER_FIELDS)

    def with_(self, **changes: Any) -> MessageFilter:
        values = {name: getattr(self, name) for name in FILTER_FIELDS}
        values.update(changes)
        return MessageFilter(**values)

    def describe(self) -> str:
        """The criteria for a log line (ids counted, not listed)."""
        parts = []
        for name in sorted(FILTER_FIELDS):
            value = getattr(self, name)
            if value is None:
                continue
            if name == "ids":
                parts.append(f"{len(value)} id(s)")
            elif isinstance(value, tuple):
                parts.append(f"{name} {', '.join(value)}")
            elif isinstance(value, datetime):
                parts.append(f"{name} {value.isoformat()}")
            else:
                parts.append(f"{name} {value!r}")
        return "; ".join(parts) or "no filter"


def _items(values: object, name: str) -> list[object]:
    if isinstance(values, str | bytes) or not isinstance(values, Iterable):
        raise AdminRequestError(f"{name} must be a list, not {type(values).__name__}")
    items = list(values)
    if not items:
        raise AdminRequestError(f"{name} must be a non-empty list (leave it out for the default)")
    return items


def _unique(values: Iterable[Any]) -> tuple[Any, ...]:
    return tuple(dict.fromkeys(values))


def _text(value: object, name: str) -> str:
    if not isinstance(value, str) or not value:
        raise AdminRequestError(
            f"{name} must hold non-empty strings; got {value!r:.60}"
            if name.endswith("s")
            else f"{name} must be a non-empty string; got {value!r:.60}"
        )
    try:
        check_text(value, f"an item of {name}" if name.endswith("s") else name)
    except PayloadError as exc:
        raise AdminRequestError(str(exc)) from None
    return value


def _message_id(value: object, name: str) -> uuid.UUID:
    if isinstance(value, uuid.UUID):
        return value
    try:
        if isinstance(value, str):
            return uuid.UUID(value)
    except ValueError:
        pass
    raise AdminRequestError(f"{name} must be message ids (UUIDs); got {value!r:.60}")


def _seconds(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise AdminRequestError(f"{name} must be a number of seconds; got {value!r:.60}")
    seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0:
        raise AdminRequestError(f"{name} must be a finite number of seconds >= 0; got {value!r}")
    return seconds


def _utc(value: object, name: str) -> datetime:
    if not isinstance(value, datetime):
        raise AdminRequestError(f"{name} must be a datetime; got {type(value).__name__}")
    try:
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
    except OverflowError:  # 9999-12-31T23:59-01:00 is past year 9999 in UTC
        raise AdminRequestError(f"{name} is out of range in UTC; got {value.isoformat()}") from None


def check_statuses(values: Sequence[str], allowed: Sequence[str], name: str) -> tuple[str, ...]:
    unknown = [value for value in values if value not in allowed]
    if unknown:
        raise AdminRequestError(f"unknown {name} {', '.join(unknown)}; use {', '.join(allowed)}")
    return tuple(values)


# ----- reading a filter: the CLI's flags and the API's JSON ----------------------------------


def parse_time(text: object, name: str) -> datetime:
    """An ISO 8601 time (``2024-05-01``, ``2024-05-01T12:00:00+02:00``); UTC without an offset."""
    if not isinstance(text, str):
        raise AdminRequestError(f"{name} must be an ISO 8601 time as a string; got {text!r:.60}")
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError:
        raise AdminRequestError(
            f"{name} must be an ISO 8601 time such as 2024-05-01 or 2024-05-01T12:00:00Z; "
            f"got {text!r:.60}"
        ) from None
    return _utc(moment, name)


def parse_age(value: object, name: str) -> float:
    """Seconds, from a number or a duration such as ``90m`` or ``7d``."""
    from outboxer.config import parse_duration

    try:
        return parse_duration(value, name)
    except ConfigError as exc:
        raise AdminRequestError(str(exc)) from None


def filter_from_json(body: Mapping[str, Any]) -> MessageFilter:
    """The filter of a JSON request body (its other fields are the caller's to read).

    Lists are JSON arrays of strings, ``older_than`` seconds or a duration string,
    ``created_after`` and ``created_before`` ISO 8601 strings. A field given as null is
    left out, as if absent.
    """
    values: dict[str, Any] = {}
    for name in ("ids", "destinations", "topics", "keys", "statuses"):
        value = body.get(name)
        if value is None:
            continue
        if (
            not isinstance(value, list)
            or not value
            or not all(isinstance(item, str) and item for item in value)
        ):
            raise AdminRequestError(
                f"{name} must be a non-empty list of non-empty strings (leave it out for the "
                "default)"
            )
        values[name] = value
    statuses = values.get("statuses")
    if statuses is not None:  # case-insensitive in JSON, as GET /messages?status= is
        for item in statuses:
            _text(item, "statuses")
        values["statuses"] = [item.strip().upper() for item in statuses]
    if body.get("older_than") is not None:
        values["older_than"] = parse_age(body["older_than"], "older_than")
    for name in ("created_after", "created_before"):
        if body.get(name) is not None:
            values[name] = parse_time(body[name], name)
    if body.get("error") is not None:
        values["error"] = body["error"]
    return MessageFilter(**values)


def flag(body: Mapping[str, Any], name: str) -> bool:
    """A JSON boolean field (absent or null: false)."""
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise AdminRequestError(f"{name} must be true or false; got {value!r:.60}")
    return value


# ----- the operations' own rules -------------------------------------------------------------


def purge_filter(where: MessageFilter, *, everything: bool = False) -> MessageFilter:
    """``where`` as purge applies it: a filter needed (or ``everything``), PROCESSING refused,
    and every status but PROCESSING when none is given."""
    _filter_or_everything(where, everything, "purge")
    if where.statuses is not None and Status.PROCESSING.value in where.statuses:
        raise AdminRequestError(
            "PROCESSING messages cannot be purged: a relay holds them and is publishing them "
            "now; wait until they are settled (PUBLISHED, FAILED or ABANDONED), then purge"
        )
    return where if where.statuses is not None else where.with_(statuses=PURGEABLE)


def replay_filter(where: MessageFilter, *, everything: bool = False) -> MessageFilter:
    """``where`` as replay applies it: a filter needed (or ``everything``), PUBLISHED rows only."""
    _filter_or_everything(where, everything, "replay")
    if where.statuses is not None and where.statuses != (Status.PUBLISHED.value,):
        raise AdminRequestError(
            "replay copies PUBLISHED messages only; leave the status out (requeue makes "
            "ABANDONED or FAILED messages PENDING again)"
        )
    return where.with_(statuses=(Status.PUBLISHED.value,))


def requeue_filter(where: MessageFilter, *, destinations: Sequence[str]) -> MessageFilter:
    """``where`` as requeue applies it: ABANDONED or FAILED only (ABANDONED when no status
    is given) of ``destinations`` when the filter names none (the configured ones)."""
    statuses = check_statuses(where.statuses or (Status.ABANDONED.value,), REQUEUEABLE, "statuses")
    return where.with_(
        statuses=statuses,
        destinations=where.destinations if where.destinations is not None else tuple(destinations),
    )


def _filter_or_everything(where: MessageFilter, everything: bool, action: str) -> None:
    if everything and not where.empty:
        raise AdminRequestError(
            f'all (--all, or "all": true) {action}s every message: give it without a filter'
        )
    if not everything and where.empty:
        raise AdminRequestError(
            f"{action} needs a filter (id, topic, key, destination, status, age, creation "
            f'time or error text), or all (--all, or "all": true) to {action} every message'
        )


def check_destination(name: object, known: Sequence[str] | None) -> str:
    """A replay's target: a destination name, one of ``known`` when given (a copy for a
    destination no relay serves would stay PENDING for ever)."""
    if not isinstance(name, str) or not name or len(name) > MAX_DESTINATION_LENGTH:
        raise AdminRequestError(
            f"the destination to replay to must be a name of 1 to {MAX_DESTINATION_LENGTH} "
            f"characters; got {name!r:.60}"
        )
    _text(name, "to")
    if problem := destination_name_problem(name):
        # Checked whether or not the destinations are known: a library caller may pass none.
        raise AdminRequestError(f"the destination to replay to: {problem}")
    if known is not None and name not in known:
        raise AdminRequestError(
            f"destination {name!r} is not configured (configured: {', '.join(sorted(known))}): no "
            "relay would publish the copies; name it in a [destinations.NAME] table of the "
            "configuration file"
        )
    return name


# ----- results --------------------------------------------------------------------------------


_PAST = {"purge": "purged", "replay": "replayed", "requeue": "requeued"}


@dataclass(frozen=True)
class AdminResult:
    """What an operation did, or (``dry_run``) would do."""

    action: str
    dry_run: bool
    #: Rows changed (copies inserted, for replay), or that would be.
    count: int
    #: A dry run's matching rows by destination, then status (the originals', for replay).
    by_destination: Counts = field(default_factory=dict)
    #: A purge's dry run with no status given: PROCESSING rows the rest of the filter
    #: matches, which purge leaves to their relay.
    held: int = 0
    #: Replay: the destination the copies go to (None: each to its original's).
    to: str | None = None
    #: Replay: originals not copied because their subject's key was shredded.
    shredded: int = 0
    #: Requeue: matching rows left as they were (or that would be) because a later row of
    #: their key is in flight; requeued again once it is settled, they go out in order.
    deferred: int = 0

    def as_json(self) -> dict[str, object]:
        if self.dry_run:
            answer: dict[str, object] = {
                "dry_run": True,
                f"would_{self.action}": self.count,
                "by_destination": self.by_destination,
            }
            if self.action == "purge":
                answer["held"] = self.held
        else:
            answer = {_PAST[self.action]: self.count}
        if self.action == "replay":
            answer["to"] = self.to
            if not self.dry_run:
                answer["shredded"] = self.shredded
        if self.deferred:
            answer["deferred"] = self.deferred
        return answer

    def lines(self) -> list[str]:
        """The CLI's report."""
        if not self.dry_run:
            text = f"{_PAST[self.action]} {self.count} message(s)"
            if self.action == "replay":
                text += f" as new PENDING messages ({_to_text(self.to)})"
            lines = [text]
            if self.shredded:
                lines.append(
                    f"{self.shredded} message(s) not copied: their subject's key was shredded"
                )
            if self.deferred:
                lines.append(_deferred_text(self.deferred, "left as they were"))
            return lines
        where = f" ({_to_text(self.to)})" if self.action == "replay" else ""
        lines = [f"would {self.action} {self.count} message(s){where}; dry run, nothing changed"]
        for destination, counts in sorted(self.by_destination.items()):
            for status, number in sorted(counts.items()):
                lines.append(f"  {destination:<16} {status:<10} {number:>10}")
        if self.held:
            lines.append(
                f"{self.held} PROCESSING message(s) match too: a relay holds them, purge leaves them"
            )
        if self.deferred:
            lines.append(_deferred_text(self.deferred, "would be left as they are"))
        return lines


def _deferred_text(deferred: int, outcome: str) -> str:
    return (
        f"{deferred} message(s) {outcome}: a later message of their key is in flight; "
        "requeue them again once it is settled"
    )


def _to_text(to: str | None) -> str:
    return f"to destination {to}" if to is not None else "each to its own destination"


def _total(counts: Counts) -> int:
    return sum(n for by_status in counts.values() for n in by_status.values())


def _only(counts: Counts, statuses: Sequence[str]) -> Counts:
    kept = {
        destination: {status: n for status, n in by_status.items() if status in statuses}
        for destination, by_status in counts.items()
    }
    return {destination: by_status for destination, by_status in kept.items() if by_status}


# ----- the operations ------------------------------------------------------------------------


async def purge(
    store: Store,
    where: MessageFilter,
    *,
    everything: bool = False,
    dry_run: bool = False,
) -> AdminResult:
    """Delete the rows ``where`` matches, in one transaction (PROCESSING rows never)."""
    applied = purge_filter(where, everything=everything)
    if dry_run:
        if where.statuses is None:  # also count what purge leaves to the relays
            counts = await store.count_matching(applied.with_(statuses=None))
            held = sum(by.get(Status.PROCESSING.value, 0) for by in counts.values())
            counts = _only(counts, PURGEABLE)
        else:
            counts, held = await store.count_matching(applied), 0
        return AdminResult("purge", True, _total(counts), counts, held=held)
    deleted = await store.purge(applied)
    logger.info("purged %d message(s) (%s)", deleted, applied.describe())
    return AdminResult("purge", False, deleted)


async def requeue(
    store: Store,
    where: MessageFilter,
    *,
    destinations: Sequence[str],
    dry_run: bool = False,
) -> AdminResult:
    """Make the ABANDONED (or FAILED) rows ``where`` matches PENDING, in one transaction.

    ``destinations``: the ones to requeue in when the filter names none (the configured).
    """
    applied = requeue_filter(where, destinations=destinations)
    if dry_run:
        counts = await store.count_matching(applied)
        deferred = await store.count_requeue_deferred(applied)
        return AdminResult("requeue", True, _total(counts) - deferred, counts, deferred=deferred)
    count, deferred = await store.requeue_matching_counted(applied)
    logger.info(
        "requeued %d message(s) (%s)%s",
        count,
        applied.describe(),
        f"; {deferred} left: a later message of their key is in flight" if deferred else "",
    )
    return AdminResult("requeue", False, count, deferred=deferred)


async def replay(
    store: Store,
    where: MessageFilter,
    *,
    to: str | None = None,
    everything: bool = False,
    copier: ReplayCopier | None = None,
    known_destinations: Sequence[str] | None = None,
    dry_run: bool = False,
) -> AdminResult:
    """Copy the PUBLISHED rows ``where`` matches as new PENDING rows, in one transaction.

    ``to``: the copies' destination (None: each original's own), which must be one of
    ``known_destinations`` when they are given. ``copier`` copies the payloads
    (default: a :class:`ReplayCopier` without keys or object store, which refuses
    encrypted and claim-checked rows with ReplayError).
    """
    applied = replay_filter(where, everything=everything)
    if to is not None:
        to = check_destination(to, known_destinations)
    if dry_run:
        counts = await store.count_matching(applied)
        return AdminResult("replay", True, _total(counts), counts, to=to)
    copier = copier if copier is not None else ReplayCopier()
    # One copier serves each database of a request in turn: what it counts and the objects
    # it may discard are this replay's only.
    copier.to, copier.objects, shredded_before = to, [], copier.shredded
    try:
        count = await store.replay(applied, copier)
    except ReplayError:
        # A copy refused, inside the transaction: it rolled back, no row refers to them.
        # In a thread: a store's delete blocks (up to the copier's bound), and this loop may
        # serve the HTTP API and run relays.
        await asyncio.to_thread(copier.discard_objects)
        raise
    except BaseException:
        # Anything else may have come with the copies committed, or about to be: a cancel
        # does not stop SQLite's worker thread, a connection lost during COMMIT says
        # nothing of its outcome. The claim-check sweep deletes only what no row refers
        # to; deleting here could take the payloads of committed copies.
        copier.objects = []
        raise
    # Committed: rows refer to these objects now; a later database's failure must not
    # take them (its discard would lose these copies' payloads).
    copier.objects = []
    shredded = copier.shredded - shredded_before
    logger.info(
        "replayed %d message(s) %s (%s)%s",
        count,
        _to_text(to),
        applied.describe(),
        f"; {shredded} of shredded subjects not copied" if shredded else "",
    )
    return AdminResult("replay", False, count, to=to, shredded=shredded)


# ----- copying payloads -----------------------------------------------------------------------


class ReplayCopier:
    """Makes a replay's copies: new ids, the destination, ``replay-of``, and the payload
    protected for the copy (module docstring). Called by the store inside its transaction,
    one page of originals at a time, in a worker thread (the object store and the key
    source may block)."""

    def __init__(
        self,
        keyring: KeyRing | None = None,
        object_store: ObjectStore | None = None,
        *,
        read_timeout: float | None = DEFAULT_READ_TIMEOUT,
        put_timeout: float | None = DEFAULT_PUT_TIMEOUT,
    ) -> None:
        self.keyring = keyring
        self.object_store = object_store
        #: Bounds on the object store's calls (None: none), inside the replay's transaction:
        #: a store that hangs (a dead NFS mount) held its locks and the command for ever.
        #: ``read_timeout`` bounds a callable key ring's fetches too (a KMS that stops
        #: answering), as the consumer's ``object_store_timeout`` does.
        self.read_timeout = read_timeout
        self.put_timeout = put_timeout
        #: The destination of every copy (None: each original's own); set by ``replay``.
        self.to: str | None = None
        #: Objects put for copies; deleted when a refused copy (ReplayError) rolled the
        #: transaction back, else left to the claim-check sweep (admin.replay).
        self.objects: list[str] = []
        self.shredded = 0
        self._claim_check: ClaimCheck | None = None
        #: Why the store is taken for hung (a call of this copier went unanswered): the
        #: copier then deletes and closes nothing, each would wait as long again and leave
        #: one more thread.
        self.unanswered: str | None = None
        #: Why the key ring's source (a KMS) failed a fetch, or did not answer within
        #: ``read_timeout``: a copy refused for now, not for good (the HTTP API's 503).
        self.keys_unavailable: str | None = None

    def __call__(self, originals: Sequence[Message]) -> list[Message]:
        copies = []
        for original in originals:
            try:
                copies.append(self.copy(original))
            except SubjectKeyDeletedError:
                self.shredded += 1  # shredded on purpose: its content must stay unreadable
        return copies

    def copy(self, original: Message) -> Message:
        destination = self.to or original.destination
        stored = original
        claim_checked = is_claim_checked(original)
        if claim_checked:
            if self.object_store is None:
                raise ReplayError(
                    f"message {original.id}'s payload is in the claim-check store: configure "
                    "claim_check_store (OUTBOXER_CLAIM_CHECK_STORE) to replay it"
                )
            try:
                stored = fetch_payload(original, self.object_store, timeout=self.read_timeout)
            except ClaimCheckError as exc:
                if isinstance(exc, ObjectReadTimeoutError):
                    self.unanswered = str(exc)
                raise ReplayError(f"message {original.id} cannot be replayed: {exc}") from exc
        copy_id = uuid7()
        if is_encrypted(stored):
            copy = self._reencrypted(stored, copy_id, destination)
        else:
            copy = _renamed(stored, copy_id, destination, stored.payload, stored.content_type)
        copy = _renamed(
            copy,
            copy_id,
            destination,
            copy.payload,
            copy.content_type,
            {**copy.headers, HEADER_REPLAY_OF: str(original.id)},
        )
        if claim_checked:
            assert self.object_store is not None
            # Its own object, named after the copy: never the original's (module docstring).
            # One ClaimCheck for the copier: its cap on unanswered puts bounds the replay's.
            if self._claim_check is None:
                self._claim_check = ClaimCheck(
                    self.object_store, threshold=0, put_timeout=self.put_timeout
                )
            try:
                copy = self._claim_check.offload_always(copy)
            except ClaimCheckError as exc:
                # Refused like a read: the transaction rolls back, nothing is written (not
                # a failure that may have committed, whose objects must be kept).
                if isinstance(exc, ClaimCheckStoreError) and exc.errno in (
                    errno.ETIMEDOUT,
                    errno.EBUSY,
                ):
                    self.unanswered = str(exc)
                raise ReplayError(f"message {original.id} cannot be replayed: {exc}") from exc
            self.objects.append(copy.headers[HEADER_CLAIM_CHECK])
        return copy

    def _reencrypted(self, stored: Message, copy_id: uuid.UUID, destination: str) -> Message:
        if self.keyring is None:
            raise ReplayError(
                f"message {stored.id} is encrypted, and its ciphertext is bound to its id: "
                "configure the encryption keys (OUTBOXER_ENCRYPTION_KEYS) to replay it"
            )
        try:
            # A ring that fetches from a KMS: the keys first, bounded like the store's reads
            # (this runs inside the replay's transaction, holding its locks).
            fetch_message_keys_sync(
                stored, self.keyring, self.read_timeout, waiter="a replay", log=logger
            )
            plain = decrypt(stored, self.keyring, destination=stored.destination)
        except SubjectKeyDeletedError:
            raise
        except EncryptionError as exc:
            if isinstance(exc, KeyRingUnavailableError):
                self.keys_unavailable = str(exc)
            raise ReplayError(f"message {stored.id} cannot be replayed: {exc}") from exc
        sealed = {name for name in plain.headers if name not in stored.headers}
        headers = {name: value for name, value in plain.headers.items() if name != HEADER_REPLAY_OF}
        return encrypt_message(
            _renamed(plain, copy_id, destination, plain.payload, plain.content_type, headers),
            self.keyring,
            subject=stored.headers.get(HEADER_SUBJECT),
            seal_headers=(sealed - {HEADER_REPLAY_OF})
            if stored.headers.get(HEADER_SEALED_HEADERS) == "1"
            else False,
            # A subject shredded since the decrypt above stays shredded: a new secret would
            # make its data readable again (the copy is counted as shredded instead).
            create_subject=False,
        )

    def close(self) -> None:
        """Close the object store (the keys hold nothing to close), given up after
        ``read_timeout`` (:func:`~outboxer.claimcheck.close_store`); not tried once a call
        went unanswered (the store is dropped unclosed, its connections with it)."""
        if self.object_store is None:
            return
        if self.unanswered is not None:
            logger.info(
                "claim-check store %r not closed: it did not answer earlier", self.object_store
            )
            return
        close_store(self.object_store, timeout=self.read_timeout, log=logger)

    def discard_objects(self) -> None:
        """Delete the objects put for copies that were not committed, given up after
        ``read_timeout``; not tried once a call went unanswered. Best effort: the
        claim-check sweep deletes what is left. Blocks: async callers run it in a thread."""
        if self.object_store is None or not self.objects:
            return
        names, self.objects = self.objects, []
        if self.unanswered is not None:
            reason = f"not tried, the store did not answer earlier: {self.unanswered}"
        else:
            try:
                delete_many_bounded(self.object_store, names, timeout=self.read_timeout)
                return
            except ObjectDeleteTimeoutError as exc:
                self.unanswered = reason = str(exc)
            except Exception as exc:  # noqa: BLE001 -- the sweep deletes orphans later
                reason = f"{type(exc).__name__}: {exc}"
        logger.warning(
            "%d unused claim-check object(s) not deleted from %r (%s): the claim-check sweep "
            "deletes them once older than its grace",
            len(names),
            self.object_store,
            reason,
        )


def _renamed(
    message: Message,
    message_id: uuid.UUID,
    destination: str,
    payload: bytes,
    content_type: str,
    headers: Mapping[str, str] | None = None,
) -> Message:
    return Message(
        id=message_id,
        topic=message.topic,
        payload=payload,
        key=message.key,
        headers=dict(message.headers if headers is None else headers),
        content_type=content_type,
        destination=destination,
    )


def copier_from_settings(settings: Any) -> ReplayCopier:
    """A copier with the keys and the claim-check store the settings name (either may be
    None); close it with :meth:`ReplayCopier.close`."""
    from outboxer import payload_admin

    return ReplayCopier(
        payload_admin.keyring(settings),
        payload_admin.object_store(settings),
        read_timeout=settings.claim_check_read_timeout,
        put_timeout=settings.claim_check_put_timeout,
    )


__all__ = [
    "FILTER_FIELDS",
    "HEADER_REPLAY_OF",
    "AdminResult",
    "MessageFilter",
    "ReplayCopier",
    "filter_from_json",
    "parse_age",
    "parse_time",
    "purge",
    "replay",
    "requeue",
]
