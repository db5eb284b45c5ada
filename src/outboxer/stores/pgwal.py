"""The WAL outbox: no table, messages written to the WAL and read through a slot.

Writers call ``Outbox(mode="wal").enqueue(conn, ...)``, which runs
``pg_logical_emit_message(true, 'outboxer:<schema>.<table>', content)`` in the caller's
transaction: the message exists only if that transaction commits, and logical decoding
hands it out at its commit's place, so in commit order. Nothing is inserted, updated
or vacuumed.

Each destination reads through a logical replication slot of its own (pgoutput with
``messages``), with the SQL slot functions: ``pg_logical_slot_peek_binary_changes``
reads without consuming, and ``pg_replication_slot_advance`` moves the slot past a
transaction only after the broker confirmed all of its messages. A restarted relay reads
again from the slot: what was confirmed is not sent again, the rest is.

Needs ``wal_level = logical`` and a free slot per destination. A slot keeps WAL until it
is advanced: a relay that stays down keeps WAL growing (watch
``pg_replication_slots``; drop the slot of a destination you retire).
"""

from __future__ import annotations

import datetime as dt
import json
import re
import time
import uuid

from outboxer.errors import ConfigError, StoreError
from outboxer.message import Message
from outboxer.redact import get_logger
from outboxer.stores.pgmodes import ModeSchema, wal_prefix
from outboxer.stores.pgoutput import Begin, Commit, DecodeError, LogicalMessage, decode
from outboxer.streamrelay import Entry

logger = get_logger("outboxer.pgwal")

#: pgoutput needs a publication; the WAL outbox publishes no table, so it is empty.
PUBLICATION = "outboxer_wal"
KEEPALIVE_PREFIX = "outboxer-keepalive"
_SLOT_NAME = re.compile(r"^[a-z0-9_]{1,63}$")


def lsn_text(lsn: int) -> str:
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


class PgWal(ModeSchema):
    """The WAL outbox of one (schema, table) name: its prefix, its slots."""

    folder = "pgwal"

    def __init__(
        self,
        url: str,
        *,
        schema: str = "outboxer",
        table: str = "outbox",
        slot_prefix: str | None = None,
        keepalive_seconds: float = 10.0,
    ) -> None:
        super().__init__(url, schema=schema, table=table)
        self.prefix = wal_prefix(schema, table)
        self.slot_prefix = slot_prefix or f"outboxer_{schema}_{table}".lower()
        self.keepalive_seconds = keepalive_seconds

    def slot_name(self, destination: str) -> str:
        name = f"{self.slot_prefix}_{destination}".lower()
        if not _SLOT_NAME.fullmatch(name):
            raise ConfigError(
                f"slot name {name!r} (slot prefix + destination) must be 1-63 lower-case "
                "letters, digits or underscores"
            )
        return name

    async def apply_schema(self) -> list[str]:
        """The WAL outbox has no table; only pgoutput's (empty) publication."""
        await self.connect()
        exists = await self.conn.fetchval(
            "SELECT 1 FROM pg_publication WHERE pubname = $1", PUBLICATION
        )
        if exists:
            return []
        await self.conn.execute(f"CREATE PUBLICATION {PUBLICATION}")
        return [f"publication {PUBLICATION}"]

    async def create_slot(self, destination: str) -> bool:
        """Create the destination's slot (False if it exists). It holds every message
        committed from now on; messages committed before it never reach this destination."""
        await self.apply_schema()
        name = self.slot_name(destination)
        found = await self.conn.fetchrow(
            "SELECT database = current_database() AS here FROM pg_replication_slots "
            "WHERE slot_name = $1",
            name,
        )
        if found is not None:
            if not found["here"]:  # slot names are cluster-wide
                raise StoreError(
                    f"replication slot {name!r} belongs to another database: choose another "
                    "slot prefix for this one"
                )
            return False
        await self.conn.execute("SELECT pg_create_logical_replication_slot($1, 'pgoutput')", name)
        return True

    async def drop_slot(self, destination: str) -> None:
        await self.connect()
        await self.conn.execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1",
            self.slot_name(destination),
        )

    def reader(self, destination: str) -> WalReader:
        return WalReader(self, destination)


class WalReader:
    """One destination's stream: peeks its slot, advances it past confirmed transactions."""

    def __init__(self, wal: PgWal, destination: str) -> None:
        self.wal = wal
        self.destination = destination
        self.slot = wal.slot_name(destination)
        self.name = f"WAL outbox slot {self.slot!r}"
        self._last_keepalive = time.monotonic()

    async def connect(self) -> None:
        await self.wal.connect()
        row = await self.wal.conn.fetchrow(
            "SELECT plugin, database = current_database() AS here FROM pg_replication_slots "
            "WHERE slot_name = $1",
            self.slot,
        )
        if row is None or row["plugin"] != "pgoutput" or not row["here"]:
            raise StoreError(
                f"{self.name} does not exist in this database (or is not a pgoutput slot): "
                "create it with PgWal.create_slot (python -m outboxer.streamrelay --create-slot)"
            )

    async def close(self) -> None:
        await self.wal.close()

    async def read(self, limit: int) -> list[Entry]:
        rows = await self.wal.conn.fetch(
            "SELECT data FROM pg_logical_slot_peek_binary_changes($1, NULL, $2, "
            "'proto_version', '1', 'publication_names', $3, 'messages', 'true')",
            self.slot,
            limit,
            PUBLICATION,
        )
        entries: list[Entry] = []
        pending: list[Message] = []
        committed_at: dt.datetime | None = None
        for row in rows:
            item = decode(bytes(row["data"]))
            if isinstance(item, Begin):
                pending = []
                committed_at = item.committed_at
            elif isinstance(item, LogicalMessage):
                if not item.transactional:  # a keepalive: the slot may move up to here
                    entries.append(Entry(None, item.lsn))
                elif item.prefix == self.wal.prefix:
                    message = self._message(item, committed_at)
                    if message is not None:
                        pending.append(message)
            elif isinstance(item, Commit):
                # Every message of the transaction, then the place after its commit.
                entries.extend(Entry(m, None) for m in pending)
                entries.append(Entry(None, item.end_lsn))
                pending = []
        return entries

    def _message(self, item: LogicalMessage, committed_at: dt.datetime | None) -> Message | None:
        head, _, payload = item.content.partition(b"\n")
        try:
            envelope = json.loads(head)
        except ValueError as exc:
            raise DecodeError(
                f"WAL outbox message at {lsn_text(item.lsn)} has no envelope: {exc}"
            ) from exc
        if self.destination not in envelope["destinations"]:
            return None
        return Message(
            id=uuid.UUID(envelope["id"]),
            topic=envelope["topic"],
            payload=payload,
            key=envelope["key"],
            headers=envelope["headers"],
            content_type=envelope["content_type"],
            destination=self.destination,
            created_at=committed_at,
            seq=item.lsn,
        )

    async def commit(self, checkpoint: object) -> None:
        if not isinstance(checkpoint, int):
            raise TypeError(f"a WAL reader commits LSNs, not {checkpoint!r}")
        await self.wal.conn.execute(
            "SELECT pg_replication_slot_advance($1, $2)", self.slot, checkpoint
        )

    async def idle(self) -> None:
        """Nothing to read. pgoutput sends nothing for transactions without messages, so on a
        database whose other writes go on the slot would never move and would keep WAL:
        a non-transactional keepalive message, read back next round, lets it move."""
        if time.monotonic() - self._last_keepalive < self.wal.keepalive_seconds:
            return
        self._last_keepalive = time.monotonic()
        await self.wal.conn.execute(
            "SELECT pg_logical_emit_message(false, $1, ''::bytea)", KEEPALIVE_PREFIX
        )
