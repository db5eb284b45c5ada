"""The stream relays' own tables: failed messages and dead letters (``sql/pgstream``).

Log mode and the WAL outbox keep no status per message: a reader's offset, or a slot,
says how far a destination got. For retries that survive a restart and for poison
isolation, the relay keeps two small tables beside them, one row per *failing* message
and one per *dead letter*, for every stream (a mode and a destination):

* ``<table>_stream_failures``: attempts and last error of a message the stream has not
  gone past yet, written in one statement per failed attempt;
* ``<table>_stream_dead_letters``: what the stream went past without publishing (attempts
  used up, refused for good, or held behind such a message of its key).

:class:`StreamBook` runs their statements on the connection of the stream's source, so
that log mode writes a dead letter and moves its offset in one transaction.
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from outboxer.errors import SchemaError
from outboxer.message import Message
from outboxer.stores.base import storable_error
from outboxer.stores.sqlfiles import queries, render, to_numbered

#: The modes a stream relay reads.
STREAM_MODES = ("log", "wal")
#: The most entries a backlog count reads: past it, the count says "at least".
BACKLOG_LIMIT = 100_000


@dataclass(frozen=True, slots=True)
class StreamFailure:
    """A message that failed and that the stream has not gone past yet."""

    seq: int
    message_id: uuid.UUID
    attempts: int
    last_error: str
    #: Refused for good (the broker said so): dead-lettered at its next turn, whatever
    #: its attempts. Known to this process only; a restart tries it once more.
    permanent: bool = False


@dataclass(frozen=True)
class DeadLetter:
    """A message the stream goes past without publishing it."""

    message: Message
    error: str
    attempts: int
    #: Never attempted itself: held behind an earlier dead letter of its key.
    held: bool = False

    def __post_init__(self) -> None:
        # Whatever the broker answered (NUL bytes, megabytes of body) can be stored.
        object.__setattr__(self, "error", storable_error(self.error))

    def params(self, mode: str, destination: str) -> dict[str, Any]:
        message = self.message
        return {
            "mode": mode,
            "destination": destination,
            "seq": message.seq,
            "message_id": str(message.id),
            "topic": message.topic,
            "key": message.key,
            "payload": message.payload,
            "content_type": message.content_type,
            "headers": json.dumps(dict(message.headers), separators=(",", ":"), ensure_ascii=False),
            "error": self.error,
            "attempts": self.attempts,
            "held": self.held,
            "created_at": message.created_at,
        }


@dataclass(frozen=True)
class StoredLetter:
    """A dead letter as the table holds it."""

    destination: str
    message: Message
    error: str
    attempts: int
    held: bool
    failed_at: dt.datetime

    def as_dict(self) -> dict[str, Any]:
        message = self.message
        return {
            "destination": self.destination,
            "seq": message.seq,
            "message_id": str(message.id),
            "topic": message.topic,
            "key": message.key,
            "content_type": message.content_type,
            "payload_bytes": len(message.payload),
            "headers": dict(message.headers),
            "error": self.error,
            "attempts": self.attempts,
            "held": self.held,
            "created_at": message.created_at.isoformat() if message.created_at else None,
            "failed_at": self.failed_at.isoformat(),
        }


#: A slot with less than this share of max_slot_wal_keep_size left to write before the
#: server invalidates it is at risk (a warning, /health "degraded").
WAL_SAFE_SHARE = 0.1


@dataclass(frozen=True)
class Backlog:
    """How far a stream is behind its head."""

    #: Messages of the stream after its checkpoint (at most ``limit``); None when unknown.
    entries: int | None
    #: True when the count stopped at its limit: there are at least ``entries``.
    capped: bool = False
    #: When the first message after the checkpoint was written (log) or committed (WAL).
    oldest: dt.datetime | None = None
    #: WAL mode: bytes of WAL the slot keeps (from its restart_lsn to the WAL's end).
    wal_retained_bytes: int | None = None
    #: WAL mode: bytes between the slot's confirmed position and the WAL's end.
    wal_behind_bytes: int | None = None
    #: WAL mode: the slot's ``wal_status`` (reserved, extended, unreserved: about to be
    #: invalidated; lost).
    wal_status: str | None = None
    #: WAL mode: bytes of WAL that may still be written before the server invalidates the
    #: slot (``safe_wal_size``; <= 0 once unreserved); None without max_slot_wal_keep_size.
    wal_safe_bytes: int | None = None
    #: WAL mode: ``max_slot_wal_keep_size`` in bytes; None when it is -1 (no limit).
    wal_keep_limit_bytes: int | None = None

    def wal_at_risk(self) -> str | None:
        """Why the slot is close to being invalidated (None: it is not): 'unreserved', or
        less than WAL_SAFE_SHARE of max_slot_wal_keep_size left to write."""
        if self.wal_status == "unreserved":
            return (
                "wal_status 'unreserved': the slot is behind by more than "
                "max_slot_wal_keep_size and the next checkpoint may invalidate it"
            )
        limit, safe = self.wal_keep_limit_bytes, self.wal_safe_bytes
        if limit is not None and safe is not None and safe < limit * WAL_SAFE_SHARE:
            return (
                f"only {safe} bytes of WAL may still be written before the server "
                f"invalidates the slot (under {WAL_SAFE_SHARE:.0%} of "
                f"max_slot_wal_keep_size, {limit} bytes)"
            )
        return None

    def age(self, now: dt.datetime | None = None) -> float:
        """Seconds the oldest unpublished message has waited (0 when there is none)."""
        if self.oldest is None:
            return 0.0
        now = now or dt.datetime.now(dt.UTC)
        return max((now - self.oldest).total_seconds(), 0.0)


class StreamBook:
    """The failures and dead letters of one stream, on connections the caller passes
    (asyncpg): the source's own, so that log mode can join them to its offset's update."""

    def __init__(self, names: dict[str, str], mode: str, destination: str) -> None:
        self.names = names
        self.mode = mode
        self.destination = destination
        self._prepared: dict[str, tuple[str, tuple[str, ...]]] = {}

    def statement(self, name: str) -> tuple[str, tuple[str, ...]]:
        if name not in self._prepared:
            self._prepared[name] = to_numbered(render(queries("pgstream")[name], self.names))
        return self._prepared[name]

    def _args(self, name: str, params: dict[str, Any]) -> tuple[str, list[Any]]:
        sql, order = self.statement(name)
        given = {"mode": self.mode, "destination": self.destination, **params}
        return sql, [given[n] for n in order]

    async def fetch(self, conn: Any, name: str, **params: Any) -> list[Any]:
        sql, args = self._args(name, params)
        return list(await conn.fetch(sql, *args))

    async def execute(self, conn: Any, name: str, **params: Any) -> int:
        """Run statement ``name``; the rows it changed."""
        sql, args = self._args(name, params)
        status = str(await conn.execute(sql, *args))
        last = status.rsplit(" ", 1)[-1]
        return int(last) if last.isdigit() else 0

    async def check(self, conn: Any) -> None:
        """SchemaError unless the stream tables exist (``--apply-schema`` makes them)."""
        sql, args = self._args(
            "tables",
            {
                "failures": self.names["stream_failures"],
                "letters": self.names["stream_dead_letters"],
            },
        )
        if not await conn.fetchval(sql, *args):
            raise SchemaError(
                f"the stream relay's tables ({self.names['stream_failures']}, "
                f"{self.names['stream_dead_letters']}) do not exist: run "
                f"`outboxer stream-relay --mode {self.mode} --apply-schema` once"
            )

    async def failures(self, conn: Any, passed: int | None = None) -> dict[int, StreamFailure]:
        """The stream's failing messages by seq (WAL: not those behind slot position ``passed``)."""
        rows = await self.fetch(conn, "failures", passed=passed)
        return {
            row["seq"]: StreamFailure(
                row["seq"], uuid.UUID(str(row["message_id"])), row["attempts"], row["last_error"]
            )
            for row in rows
        }

    async def record_failure(self, conn: Any, message: Message, error: str) -> int:
        """Count one failed attempt of ``message``; its attempts in all."""
        sql, args = self._args(
            "record_failure",
            {"seq": message.seq, "message_id": str(message.id), "error": storable_error(error)},
        )
        return int(await conn.fetchval(sql, *args))

    async def write_letters(self, conn: Any, letters: Sequence[DeadLetter]) -> None:
        if not letters:
            return
        sql, order = self.statement("insert_letter")
        await conn.executemany(
            sql,
            [[letter.params(self.mode, self.destination)[n] for n in order] for letter in letters],
        )

    async def clear(self, conn: Any, seqs: Iterable[int]) -> None:
        wanted = sorted(set(seqs))
        if wanted:
            await self.execute(conn, "clear_failures", seqs=wanted)

    async def mark_passing(self, conn: Any, seqs: Iterable[int], lsn: int) -> None:
        wanted = sorted(set(seqs))
        if wanted:
            await self.execute(conn, "mark_passing", seqs=wanted, lsn=lsn)

    async def drop_passed(self, conn: Any, lsn: int) -> None:
        await self.execute(conn, "drop_passed", lsn=lsn)

    async def held_keys(self, conn: Any, keys: Iterable[str] | None = None) -> set[str]:
        """Which of ``keys`` (None: any key) have a dead letter in the stream."""
        if keys is None:
            rows = await self.fetch(conn, "all_held_keys")
        else:
            wanted = sorted(set(keys))
            if not wanted:
                return set()
            rows = await self.fetch(conn, "held_keys", keys=wanted)
        return {row["key"] for row in rows}

    async def letters(
        self, conn: Any, limit: int, *, every_destination: bool = False
    ) -> list[StoredLetter]:
        """Dead letters, oldest first (of every destination of the mode, if asked)."""
        rows = await self.fetch(
            conn,
            "list_letters",
            destination=None if every_destination else self.destination,
            limit=limit,
        )
        return [_stored(row, self.mode) for row in rows]


def _stored(row: Any, mode: str) -> StoredLetter:
    headers = json.loads(row["headers"]) if row["headers"] not in (None, "{}") else {}
    message = Message(
        id=uuid.UUID(str(row["message_id"])),
        topic=row["topic"],
        payload=bytes(row["payload"]),
        key=row["key"],
        headers=dict(headers),
        content_type=row["content_type"],
        destination=row["destination"],
        created_at=row["created_at"],
        seq=row["seq"],
    )
    return StoredLetter(
        row["destination"], message, row["error"], row["attempts"], row["held"], row["failed_at"]
    )


__all__ = [
    "BACKLOG_LIMIT",
    "STREAM_MODES",
    "Backlog",
    "DeadLetter",
    "StoredLetter",
    "StreamBook",
    "StreamFailure",
]
