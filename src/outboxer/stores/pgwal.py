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
``pg_replication_slots``; drop the slot of a destination you retire). With
``max_slot_wal_keep_size`` set, the server invalidates a slot that falls that far behind
(``wal_status`` 'lost'): its unread messages are gone, and the relay stops with
:class:`~outboxer.errors.SlotInvalidatedError` (``PgWal.slots`` shows ``safe_wal_size``,
the WAL that may still be written before that happens).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, TypeVar

from outboxer.errors import ConfigError, SlotInvalidatedError, StoreError
from outboxer.message import Message, check_text
from outboxer.redact import get_logger
from outboxer.stores import pgmodes
from outboxer.stores.pgmodes import (
    SENDING,
    WORKING,
    ModeSchema,
    ReaderLock,
    backend_activity,
    close_connection,
    open_connection,
    wal_prefix,
)
from outboxer.stores.pgoutput import Begin, Commit, LogicalMessage, decode
from outboxer.stores.pgstream import Backlog, DeadLetter, StreamBook, StreamFailure
from outboxer.stores.sqlfiles import queries, to_numbered
from outboxer.streamrelay import Entry

T = TypeVar("T")

logger = get_logger("outboxer.pgwal")

#: pgoutput needs a publication; the WAL outbox publishes no table, so it is empty.
PUBLICATION = "outboxer_wal"
KEEPALIVE_PREFIX = "outboxer-keepalive"
#: What no text column stores: NUL and lone surrogates (not encodable as UTF-8).
_UNSTORABLE = re.compile(r"[\x00\ud800-\udfff]")
_SLOT_NAME = re.compile(r"^[a-z0-9_]{1,63}$")
#: The SQLSTATE of a slot call on an invalidated slot (object_not_in_prerequisite_state); it
#: has other causes too, so the catalog's wal_status decides.
_NOT_IN_PREREQUISITE_STATE = "55000"
#: Seconds a slot call waits for a slot another session holds for a moment (a status
#: query peeking it) before it gives up.
SLOT_BUSY_SECONDS = 10.0
#: The last-resort bound of a call that decodes WAL (a peek, a slot's advance), far above
#: COMMAND_TIMEOUT: decoding goes through all the WAL after the slot's position, the
#: transactions without outbox messages included, and a relay that was down, or a
#: transaction of millions of rows, makes that minutes of work. A fixed bound shorter
#: than the work would cancel it at every try, re-decoding the same WAL for ever while the
#: slot kept it. The real bound is the watch (WalReader._decoding): after each
#: COMMAND_TIMEOUT without an answer the server is asked, on another session, whether the
#: call's process is still at it; a server that does not answer within
#: LOCK_CHECK_SECONDS, that is done with the call while its answer never came, or that
#: cannot hand the answer over within COMMAND_TIMEOUT (blocked writing it), is an outage,
#: as for any other statement.
DECODE_TIMEOUT = 24 * 3600.0


def lsn_text(lsn: int) -> str:
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


class PgWal(ModeSchema):
    """The WAL outbox of one (schema, table) name: its prefix, its slots."""

    folder = "pgwal"
    also = ("pgstream",)

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
        """The WAL outbox has no table of its own: pgoutput's (empty) publication, and the
        stream relay's tables of failures and dead letters (``sql/pgstream``)."""
        await self.connect()
        applied = []
        exists = await self.conn.fetchval(
            "SELECT 1 FROM pg_publication WHERE pubname = $1", PUBLICATION
        )
        if not exists and await self._create_publication():
            applied.append(f"publication {PUBLICATION}")
        return applied + await self.apply_migrations("pgstream")

    async def _create_publication(self) -> bool:
        """CREATE PUBLICATION; False if another session created it since the look (two
        stream relays started together with --apply-schema): it exists, as wanted. It
        failed the second with a duplicate key of pg_publication."""
        from outboxer.stores.postgres import _asyncpg

        asyncpg = _asyncpg()
        try:
            await self.conn.execute(f"CREATE PUBLICATION {PUBLICATION}")
        except (asyncpg.UniqueViolationError, asyncpg.DuplicateObjectError):
            return False
        return True

    def schema_sql(self) -> str:
        return f"CREATE PUBLICATION {PUBLICATION};\n\n" + super().schema_sql()

    async def slots(self) -> list[dict[str, Any]]:
        """The slots of this outbox (named ``<slot prefix>_<destination>``), with how much
        WAL each keeps and how far it is behind the WAL's end, in bytes, its ``wal_status``
        ('lost': invalidated, its unread messages gone) and ``safe_wal_size`` (bytes of WAL
        that may still be written before the server invalidates it; None without
        ``max_slot_wal_keep_size``)."""
        await self.connect()
        sql, _ = to_numbered(queries("pgwal")["slots"])
        rows = await self.conn.fetch(sql, self.slot_prefix + "_")
        return [dict(row) for row in rows]

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
        # Waits for the transactions running now to end (its snapshot): not bounded.
        async with self.schema_connection() as conn:
            await conn.execute("SELECT pg_create_logical_replication_slot($1, 'pgoutput')", name)
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
        self.mode = "wal"
        #: The stream's failures and dead letters, named by the destination.
        self.book = StreamBook(wal.names, "wal", destination)
        self._last_keepalive = time.monotonic()
        self._lock = ReaderLock(wal.url, f"outboxer-wal-reader:{self.slot}", self.name)

    @property
    def conn(self) -> Any:
        return self.wal.conn

    async def attach(self) -> None:
        """Connect for the stream's own tables only (replay, status), without the reader
        lock that a running relay holds."""
        await self.wal.connect()
        await self.book.check(self.conn)

    async def connect(self) -> None:
        await self.wal.connect()
        row = await self.wal.conn.fetchrow(
            "SELECT plugin, database = current_database() AS here, wal_status, "
            "CAST(confirmed_flush_lsn AS text) AS confirmed_flush_lsn "
            "FROM pg_replication_slots WHERE slot_name = $1",
            self.slot,
        )
        if row is None or row["plugin"] != "pgoutput" or not row["here"]:
            raise StoreError(
                f"{self.name} does not exist in this database (or is not a pgoutput slot): "
                "create it with PgWal.create_slot (outboxer stream-relay --mode wal "
                "--create-slot)"
            )
        if row["wal_status"] == "lost":
            # Before the lock: a relay restarted on an invalidated slot stops at once, with
            # the reason, instead of failing on its first read with the driver's error.
            raise self._invalidated(row["confirmed_flush_lsn"])
        await self.book.check(self.wal.conn)
        if not await self._lock.acquire():
            await self.close()
            raise StoreError(f"{self.name} is already being read by another relay")

    async def close(self) -> None:
        await self._lock.release()
        await self.wal.close()

    async def _slot_call(self, call: Callable[[], Awaitable[T]]) -> T:
        """``call()``, waiting while another session holds the slot for a moment: SQL slot
        functions take the slot for their call, and a second caller fails at once (55006)."""
        deadline = time.monotonic() + SLOT_BUSY_SECONDS
        while True:
            try:
                return await call()
            except Exception as exc:
                if getattr(exc, "sqlstate", None) == "42704":
                    # The slot (or the publication) was dropped under a running relay: a
                    # StoreError, as connect's, that /health names while the relay waits for
                    # it to be created again, where the driver's error ended the relay.
                    raise StoreError(f"{self.name}: {exc}") from exc
                if getattr(exc, "sqlstate", None) == _NOT_IN_PREREQUISITE_STATE:
                    # "can no longer get changes from replication slot": invalidated by
                    # max_slot_wal_keep_size. Its WAL is gone; retrying cannot help, and the
                    # driver's error said neither what was lost nor what to do.
                    await self._check_not_invalidated()
                if getattr(exc, "sqlstate", None) != "55006":
                    raise
                if time.monotonic() > deadline:
                    # Held longer than a moment (a long status peek, a pg_recvlogical left
                    # running): a StoreError, which the relay waits out and retries, where
                    # the driver's error stopped the relay at every restart until released.
                    raise StoreError(f"{self.name} is in use by another session: {exc}") from exc
                await asyncio.sleep(0.05)

    async def _decoding(self, call: Awaitable[T]) -> T:
        """``call``, a statement of ``self.wal.conn`` that decodes WAL (DECODE_TIMEOUT says
        why no fixed bound fits it), watched instead: every COMMAND_TIMEOUT without its
        answer, the server is asked what the call's process does. StoreError (an outage:
        the relay reconnects, and reads again from the slot, which only a confirmed advance
        moves) when the server does not answer that question, or when it is done with the
        call and the answer still does not arrive."""
        pid = self.wal.conn.get_server_pid()
        task = asyncio.ensure_future(call)
        try:
            while True:
                done, _ = await asyncio.wait((task,), timeout=pgmodes.COMMAND_TIMEOUT)
                if done:
                    return task.result()
                activity = await self._activity(pid)
                if activity == WORKING:
                    continue
                # Done on the server's side: an answer on its way has one more short wait,
                # then it is lost. One the server is still handing over (blocked writing:
                # the decoding ended, its function returned the slot) has a statement's
                # bound to arrive, as in log mode: a connection that stopped taking it held
                # the relay for DECODE_TIMEOUT, the watch seeing an 'active' process.
                sending = activity == SENDING
                grace = pgmodes.COMMAND_TIMEOUT if sending else pgmodes.LOCK_CHECK_SECONDS
                done, _ = await asyncio.wait((task,), timeout=grace)
                if done:
                    return task.result()
                raise StoreError(
                    f"{self.name}: the server is done with a call that decodes the slot "
                    f"(process {pid}), and its answer has not arrived"
                    + (f": not taken from the server within {grace:g}s" if sending else "")
                )
        finally:
            if not task.done():
                task.cancel()  # asyncpg sends the server a cancel request (bounded)
                await asyncio.wait((task,), timeout=pgmodes.CLOSE_TIMEOUT)
            if task.done() and not task.cancelled():
                task.exception()  # retrieved (it is raised above, or moot after an outage)

    async def _activity(self, pid: int) -> str:
        """What server process ``pid`` does with its statement: asked on the reader lock's
        session, or without the lock (``stream status``) on a connection of its own."""
        if self._lock.held:
            return await self._lock.activity(pid)
        conn = await open_connection(self.wal.url)
        try:
            return await backend_activity(conn, pid)
        except Exception as exc:  # the driver's error or a timeout: the database is out
            raise StoreError(
                f"{self.name}: the database does not answer: {str(exc) or type(exc).__name__}"
            ) from exc
        finally:
            await close_connection(conn)

    async def _peek(self, limit: int) -> list[Any]:
        async def peek() -> list[Any]:
            return list(
                await self._decoding(
                    self.wal.conn.fetch(
                        "SELECT data FROM pg_logical_slot_peek_binary_changes($1, NULL, $2, "
                        "'proto_version', '1', 'publication_names', $3, 'messages', 'true')",
                        self.slot,
                        limit,
                        PUBLICATION,
                        timeout=DECODE_TIMEOUT,
                    )
                )
            )

        return await self._slot_call(peek)

    async def read(self, limit: int) -> list[Entry]:
        await self._lock.check()
        return self._entries(await self._peek(limit))

    def _entries(self, rows: Sequence[Any]) -> list[Entry]:
        entries: list[Entry] = []
        pending: list[Entry] = []
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
                    entry = self._entry(item, committed_at)
                    if entry is not None:
                        pending.append(entry)
            elif isinstance(item, Commit):
                # Every message of the transaction, then the place after its commit.
                entries.extend(pending)
                entries.append(Entry(None, item.end_lsn))
                pending = []
        return entries

    def _entry(self, item: LogicalMessage, committed_at: dt.datetime | None) -> Entry | None:
        """The entry of an outbox message for this destination (None: not for it).

        One whose envelope cannot be read (a writer of another version, a hand-made
        ``pg_logical_emit_message`` with the outbox's prefix) becomes a *poison* entry,
        dead-lettered at its turn: raising here would stop every relay of the slot at
        each restart, and the slot would keep the WAL from there on for ever.
        """
        head, _, payload = item.content.partition(b"\n")
        envelope: Any = None
        try:
            envelope = json.loads(head)
            if not isinstance(envelope, dict):
                raise TypeError(f"the envelope is a JSON {type(envelope).__name__}, not an object")
            destinations = envelope["destinations"]
            if not isinstance(destinations, list):
                raise TypeError("its destinations are not a list")
            if self.destination not in destinations:
                return None
            headers = envelope["headers"]
            fields = (envelope["topic"], envelope["content_type"], *headers, *headers.values())
            if not all(isinstance(value, str) for value in fields) or not (
                envelope["key"] is None or isinstance(envelope["key"], str)
            ):
                raise TypeError("a topic, key, content type or header is not a string")
            # JSON carries a NUL (\u0000) or a lone surrogate (\ud800) that no text column
            # (nor jsonb) stores: a dead letter of it could not be written, and the relay
            # stopped there at every restart. Unreadable, so dead-lettered raw, untried.
            for what, value in (("topic", envelope["topic"]), ("key", envelope["key"] or "")):
                check_text(value, f"the {what}")
            for name, value in headers.items():
                check_text(name, "a header name")
                check_text(value, "a header value")
            message = Message(
                id=uuid.UUID(envelope["id"]),
                topic=envelope["topic"],
                payload=payload,
                key=envelope["key"],
                headers=headers,
                content_type=envelope["content_type"],
                destination=self.destination,
                created_at=committed_at,
                seq=item.lsn,
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            reason = (
                f"WAL outbox message at {lsn_text(item.lsn)} has no readable envelope: "
                f"{type(exc).__name__}: {exc}"
            )
            logger.error("%s: %s; it becomes a dead letter", self.name, reason)
            return Entry(self._unreadable(item, committed_at, envelope), None, poison=reason)
        return Entry(message, None)

    def _unreadable(
        self, item: LogicalMessage, committed_at: dt.datetime | None, envelope: Any
    ) -> Message:
        """A dead letter's message for an unreadable WAL message: its whole content as the
        payload, and whatever of the envelope can be read (an id stable across reads)."""
        readable = envelope if isinstance(envelope, dict) else {}

        def text(name: str) -> str | None:
            value = readable.get(name)
            # A NUL or a lone surrogate (valid in JSON) cannot be stored in a text column of
            # the dead letter: each becomes U+FFFD.
            return _UNSTORABLE.sub("\ufffd", value) if isinstance(value, str) else None

        try:
            message_id = uuid.UUID(text("id") or "")
        except ValueError:
            message_id = uuid.uuid5(uuid.NAMESPACE_URL, f"outboxer-wal:{self.slot}:{item.lsn}")
        return Message(
            id=message_id,
            topic=text("topic") or "",
            payload=item.content,
            key=text("key"),
            content_type="application/octet-stream",
            destination=self.destination,
            created_at=committed_at,
            seq=item.lsn,
        )

    async def commit(
        self,
        checkpoint: object,
        letters: Sequence[DeadLetter] = (),
        cleared: Iterable[int] = (),
    ) -> None:
        """Advance the slot to ``checkpoint``, after writing ``letters`` and marking the
        failure rows of ``cleared`` (seqs of messages the advance passes).

        The advance cannot join a transaction, so the order is the invariant: the dead
        letters (idempotent on their entry) and the marks commit first, then the slot
        moves, then the marked rows go. A relay that dies before the advance reads the
        messages again and finds their failure rows (a dead one is written again, a no-op);
        one that dies after it leaves marked rows that no read reaches, dropped at the next
        start or advance (``pass_lsn`` at or behind the slot).
        """
        if not isinstance(checkpoint, int):
            raise TypeError(f"a WAL reader commits LSNs, not {checkpoint!r}")
        conn = self.wal.conn
        passing = {letter.message.seq for letter in letters if letter.message.seq is not None}
        passing.update(cleared)
        if letters or passing:
            async with conn.transaction():
                await self.book.write_letters(conn, letters)
                await self.book.mark_passing(conn, passing, checkpoint)

        async def advance() -> None:
            # Decodes the WAL up to the checkpoint again, as long as the peek did: watched,
            # as the peek. One cut short leaves the slot's confirmed position where it was
            # or at the checkpoint, never past it: never past what the broker confirmed.
            await self._decoding(
                conn.execute(
                    "SELECT pg_replication_slot_advance($1, $2)",
                    self.slot,
                    checkpoint,
                    timeout=DECODE_TIMEOUT,
                )
            )

        await self._slot_call(advance)
        if passing:
            await self.book.drop_passed(conn, checkpoint)

    async def confirmed_lsn(self) -> int:
        """Where the slot is: reading resumes after this LSN."""
        state = await self._slot_state()
        return int(state["confirmed"])

    async def _slot_state(self) -> Any:
        sql, _ = to_numbered(queries("pgwal")["slot_state"])
        row = await self.wal.conn.fetchrow(sql, self.slot)
        if row is None:
            raise StoreError(f"{self.name} does not exist any more")
        if row["wal_status"] == "lost":
            confirmed = row["confirmed"]
            raise self._invalidated(None if confirmed is None else lsn_text(int(confirmed)))
        return row

    async def _check_not_invalidated(self) -> None:
        """Raise SlotInvalidatedError if the server invalidated the slot."""
        await self._slot_state()

    def _invalidated(self, confirmed: str | None) -> SlotInvalidatedError:
        since = f"its last confirmed position {confirmed}" if confirmed else "its creation"
        return SlotInvalidatedError(
            f"{self.name} was invalidated by the server (wal_status 'lost'): the WAL it still "
            f"needed was removed (it fell behind by more than max_slot_wal_keep_size), so "
            f"messages written since {since} may be lost for destination "
            f"{self.destination!r}. The slot cannot be read again: drop it "
            f"(SELECT pg_drop_replication_slot('{self.slot}')), create it again "
            f"(outboxer stream-relay --mode wal --destination {self.destination} "
            "--create-slot), check max_slot_wal_keep_size against how long this relay may be "
            "down, and recover the lost messages from their writers if they matter",
            slot=self.slot,
        )

    async def failures(self) -> dict[int, StreamFailure]:
        """The failing messages ahead of the slot; rows a relay that died after an advance
        left behind it go now."""
        confirmed = await self.confirmed_lsn()
        await self.book.drop_passed(self.wal.conn, confirmed)
        return await self.book.failures(self.wal.conn, passed=confirmed)

    async def record_failure(self, message: Message, error: str) -> int:
        return await self.book.record_failure(self.wal.conn, message, error)

    async def held_keys(self, keys: Iterable[str] | None = None) -> set[str]:
        return await self.book.held_keys(self.wal.conn, keys)

    async def backlog(self, limit: int) -> Backlog:
        """Messages of this destination in the slot (decoding at most ``limit`` changes), the
        commit time of the first, and the WAL the slot keeps. Peeking decodes the WAL the
        relay will decode again: keep ``limit`` modest, and the calls rare."""
        rows = await self._peek(limit)
        entries = self._entries(rows)
        messages = [entry.message for entry in entries if entry.message is not None]
        state = await self._slot_state()
        return Backlog(
            len(messages),
            len(rows) >= limit,
            messages[0].created_at if messages else None,
            int(state["retained"]),
            int(state["behind"]),
            wal_status=state["wal_status"],
            wal_safe_bytes=state["safe_wal_size"],
            wal_keep_limit_bytes=state["keep_limit"],
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
