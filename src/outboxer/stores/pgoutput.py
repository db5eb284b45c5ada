"""A decoder for the pgoutput plugin's binary messages (protocol version 1).

Only what the WAL outbox and the Debezium layout's proof need: Begin, Commit, logical
decoding Messages, Relation and Insert (text-format tuples). The formats are PostgreSQL's
"Logical Replication Message Formats" (protocol chapter); other message kinds are
returned as ``Other`` so a reader can skip them.
"""

from __future__ import annotations

import datetime as dt
import struct
from dataclasses import dataclass

#: PostgreSQL timestamps count microseconds from here.
_PG_EPOCH = dt.datetime(2000, 1, 1, tzinfo=dt.UTC)


@dataclass(frozen=True, slots=True)
class Begin:
    final_lsn: int
    committed_at: dt.datetime
    xid: int


@dataclass(frozen=True, slots=True)
class Commit:
    commit_lsn: int
    #: Where the slot may be advanced to once every message of the transaction is handled.
    end_lsn: int


@dataclass(frozen=True, slots=True)
class LogicalMessage:
    transactional: bool
    lsn: int
    prefix: str
    content: bytes


@dataclass(frozen=True, slots=True)
class Relation:
    relation_id: int
    namespace: str
    name: str
    columns: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Insert:
    relation_id: int
    #: Column values as text (None for NULL), in the relation's column order.
    values: tuple[str | None, ...]


@dataclass(frozen=True, slots=True)
class Other:
    kind: str


Decoded = Begin | Commit | LogicalMessage | Relation | Insert | Other


class DecodeError(ValueError):
    """A pgoutput message this decoder cannot read."""


class _Reader:
    __slots__ = ("at", "data")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.at = 0

    def take(self, fmt: str) -> int:
        (value,) = struct.unpack_from(fmt, self.data, self.at)
        self.at += struct.calcsize(fmt)
        return int(value)

    def string(self) -> str:
        end = self.data.index(b"\0", self.at)
        text = self.data[self.at : end].decode("utf-8")
        self.at = end + 1
        return text

    def raw(self, length: int) -> bytes:
        chunk = self.data[self.at : self.at + length]
        if len(chunk) != length:
            raise DecodeError("pgoutput message is shorter than its lengths say")
        self.at += length
        return chunk


def decode(data: bytes) -> Decoded:
    """One pgoutput message (one row of ``pg_logical_slot_peek_binary_changes``)."""
    if not data:
        raise DecodeError("empty pgoutput message")
    kind = chr(data[0])
    r = _Reader(data)
    r.at = 1
    if kind == "B":
        final_lsn = r.take("!Q")
        committed_at = _PG_EPOCH + dt.timedelta(microseconds=r.take("!q"))
        return Begin(final_lsn, committed_at, r.take("!I"))
    if kind == "C":
        r.take("!B")  # flags
        commit_lsn = r.take("!Q")
        return Commit(commit_lsn, r.take("!Q"))
    if kind == "M":
        flags = r.take("!B")
        lsn = r.take("!Q")
        prefix = r.string()
        length = r.take("!I")
        return LogicalMessage(bool(flags & 1), lsn, prefix, r.raw(length))
    if kind == "R":
        relation_id = r.take("!I")
        namespace = r.string()
        name = r.string()
        r.take("!B")  # replica identity
        columns = []
        for _ in range(r.take("!H")):
            r.take("!B")  # flags
            columns.append(r.string())
            r.take("!I")  # type oid
            r.take("!i")  # type modifier
        return Relation(relation_id, namespace, name, tuple(columns))
    if kind == "I":
        relation_id = r.take("!I")
        if chr(r.take("!B")) != "N":
            raise DecodeError("pgoutput Insert without a new tuple")
        values: list[str | None] = []
        for _ in range(r.take("!H")):
            column_kind = chr(r.take("!B"))
            if column_kind == "n":
                values.append(None)
            elif column_kind == "t":
                values.append(r.raw(r.take("!I")).decode("utf-8"))
            else:
                raise DecodeError(f"pgoutput tuple column of kind {column_kind!r} not supported")
        return Insert(relation_id, tuple(values))
    return Other(kind)
