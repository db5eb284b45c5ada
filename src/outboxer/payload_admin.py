"""Payload protection on the outbox table: key rotation and the claim-check orphan sweep.

Both work on a synchronous connection of their own (psycopg, PyMySQL or sqlite3), apart
from the relay: ``outboxer keys rotate`` and ``outboxer claim-check sweep`` are operator
commands. Their SQL is in ``stores/sql/<dialect>/payload.sql``.

**Rotation** re-encrypts the unfinished rows (PENDING, FAILED) under the ring's current key,
in batches of bounded size, one transaction each, so a relay never waits long on a row
lock. A row a relay has claimed (PROCESSING) is left as it is (the relay may be publishing
its bytes), as is a row whose key changed since it was read; a later run takes them. A
claim-checked row gets a new object holding the new ciphertext; the old object is deleted
once the row's new reference has committed (a crash in between leaves an orphan for the
sweep, never a row without its object).

Every call of a rotation to the object store is bounded, so that a store that hangs (a dead
NFS mount, an S3 endpoint that never answers) neither holds a batch's transaction nor the
operator's command for ever: puts by the run's ClaimCheck (``put_timeout``), reads and
deletes by ``call_timeout``, in daemon threads whose number is capped (see
:class:`_RunStore`).
"""

from __future__ import annotations

import errno
import json
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from outboxer.claimcheck import (
    DEFAULT_SWEEP_CALL_TIMEOUT,
    HEADER_CLAIM_CHECK,
    ClaimCheck,
    ClaimCheckStoreError,
    ObjectDeleteTimeoutError,
    ObjectName,
    ObjectReadTimeoutError,
    ObjectStore,
    close_store,
    create_object_store,
    delete_many_bounded,
    fetch_payload,
    is_claim_checked,
    sweep_orphans,
)
from outboxer.crypto import (
    HEADER_KEY_ID,
    MAX_KEY_ID_LENGTH,
    FileSubjectKeys,
    KeyNotFoundError,
    KeyRing,
    KeyRingUnavailableError,
    SubjectKeyDeletedError,
    fetch_key_bounded_sync,
    fetch_message_keys_sync,
    is_key_id,
    reencrypt,
)
from outboxer.enqueue import Outbox
from outboxer.errors import ConfigError, OutboxerError
from outboxer.message import Message
from outboxer.redact import Log, get_logger
from outboxer.stores.pgmodes import tokens as mode_tokens
from outboxer.stores.sqlfiles import queries, render, table_name, to_pyformat

if TYPE_CHECKING:
    from outboxer.config import Settings

logger = get_logger("outboxer.payload_admin")


def dialect_of(url: str) -> str:
    """``postgres``, ``mysql`` or ``sqlite`` for a database URL (the stores' own choice)."""
    from outboxer.stores import create_store

    return create_store(url).dialect


def connect(url: str) -> Any:
    """A synchronous DB-API connection to the database at ``url``, no transaction open."""
    dialect = dialect_of(url)
    if dialect == "sqlite":
        import sqlite3

        from outboxer.stores.sqlite import sqlite_path

        # sqlite3's default: a transaction opens before the first write (as enqueue needs).
        return sqlite3.connect(sqlite_path(url), timeout=30)
    if dialect == "mysql":
        from outboxer.stores.mysql import mysql_connect_args
        from outboxer.stores.mysql_tls import connect_pymysql

        return connect_pymysql(mysql_connect_args(url))
    import psycopg

    return psycopg.connect(url)


# ----- from the settings ------------------------------------------------------------------


def subject_keys(settings: Settings) -> FileSubjectKeys | None:
    return FileSubjectKeys(settings.subject_keys) if settings.subject_keys else None


def keyring(settings: Settings) -> KeyRing | None:
    """The key ring the settings describe (``encryption_keys`` or ``encryption_key_file``),
    or None when they name no keys. ConfigError for a ring that cannot be built."""
    keys, key_file, current = (
        settings.encryption_keys,
        settings.encryption_key_file,
        settings.encryption_current_key,
    )
    if keys and key_file:
        raise ConfigError("set encryption_keys or encryption_key_file, not both")
    if keys:
        return KeyRing.from_text(
            keys, current, origin="encryption_keys", subjects=subject_keys(settings)
        )
    if key_file:
        ring = KeyRing.from_file(key_file, subjects=subject_keys(settings))
        if current is None:
            return ring
        # The setting names the current key over the file's own choice. A file's ring holds
        # its keys: ``ring.key`` is a lookup here, no source to wait for.
        return KeyRing(
            {key_id: ring.key(key_id) for key_id in ring.key_ids}, current, subjects=ring.subjects
        )
    if current is not None:
        raise ConfigError("encryption_current_key is set, but no encryption_keys or key file")
    return None


def require_keyring(settings: Settings) -> KeyRing:
    ring = keyring(settings)
    if ring is None:
        raise ConfigError("no encryption keys: set OUTBOXER_ENCRYPTION_KEYS or encryption_key_file")
    return ring


def object_store(settings: Settings) -> ObjectStore | None:
    url = settings.claim_check_store
    return create_object_store(url) if url else None


def claim_check(settings: Settings) -> ClaimCheck | None:
    store = object_store(settings)
    if store is None:
        return None
    return ClaimCheck(
        store, settings.claim_check_threshold, put_timeout=settings.claim_check_put_timeout
    )


def outbox(settings: Settings) -> Outbox:
    """The outbox ``outboxer enqueue`` writes to: names and payload protection as set."""
    return Outbox(
        schema=settings.schema,
        table=settings.table,
        encryption=keyring(settings),
        claim_check=claim_check(settings),
    )


def sweep_claim_checks(settings: Settings, *, log: Log | None = None) -> int | None:
    """Delete the claim-check objects no row refers to, older than the grace: those of
    rolled-back enqueues, and those whose rows retention deleted. None without a store.

    Each call to the store is bounded by ``claim_check_read_timeout`` (the one setting for
    how long outboxer waits on the store), the store's close afterwards too: a hung store
    ends the sweep with ClaimCheckSweepTimeoutError (logged, counted in
    ``sweep_failures``) rather than hang ``outboxer claim-check sweep`` or the relay's
    cleanup, which tries again next time. ``log`` gets the sweep's lines (the relay's
    names its database)."""
    store = object_store(settings)
    if store is None:
        return None
    try:
        with payload_table(
            settings.require_db(), schema=settings.schema, table=settings.table
        ) as table:
            return table.sweep(
                store,
                grace=settings.claim_check_sweep_grace,
                call_timeout=settings.claim_check_read_timeout,
                log=log,
            )
    finally:
        close_store(store, timeout=settings.claim_check_read_timeout, log=log)


#: Seconds before the start of the oldest open transaction from which the sweep keeps
#: objects: the enqueue's put comes before its INSERT, and hosts' clocks differ a little.
OPEN_TRANSACTION_MARGIN = 300.0


@dataclass
class RotationResult:
    #: Rows now encrypted under the current key.
    rotated: int = 0
    #: Rows whose subject was shredded: unreadable for good, nothing to rotate.
    shredded: int = 0
    #: Rows claimed or re-keyed by someone else between the read and the update.
    skipped: int = 0
    #: Rows that could not be re-encrypted, as "id (destination): error".
    failed: list[str] = field(default_factory=list)
    #: Claim-check objects no row refers to any more that the store did not delete (it did
    #: not answer within the run's ``call_timeout``, or refused): the old objects of
    #: re-encrypted rows, the new ones of rows skipped or rolled back. The orphan sweep
    #: (``outboxer claim-check sweep``) deletes them once older than its grace.
    orphaned: int = 0
    #: PostgreSQL log mode (``<table>_log``, append-only: never re-encrypted): by key id,
    #: the rows under another key than the current one that some reader has not confirmed
    #: yet (all of them while no reader is registered). Their key cannot be retired yet:
    #: the relay would fail them for good.
    log_unrelayed: dict[str, int] = field(default_factory=dict)
    #: The same for rows every reader has confirmed, kept until retention drops their
    #: partitions: only a replay (seek) of them needs their key.
    log_relayed: dict[str, int] = field(default_factory=dict)


class PayloadTable:
    """The outbox table of ``conn`` (a connection from :func:`connect`) for these commands."""

    def __init__(
        self, conn: Any, dialect: str, *, schema: str = "outboxer", table: str = "outbox"
    ) -> None:
        self.conn = conn
        self.dialect = dialect
        self._schema, self._table = schema, table
        self._outbox = table_name(dialect, schema, table)
        tokens = {"outbox": self._outbox}
        self._sql = {
            name: render(sql, tokens) for name, sql in queries(dialect, "payload.sql").items()
        }
        # PostgreSQL's log mode keeps its messages in the table ``<table>_log``, whose rows
        # refer to claim-check objects too (Outbox(mode="log", claim_check=...)). The
        # sweep must count them, or it deletes the objects of messages the stream readers
        # have still to publish, and consumers of published ones still fetch.
        self._log_table = mode_tokens(schema, table)["log"] if dialect == "postgres" else None
        self._log_exists: bool | None = None
        # After `outboxer schema migrate-partitioned`, the old table stays as <table>_plain
        # until the operator drops it "once past retention": its PUBLISHED history, whose
        # objects consumers may still fetch (retention of the new table never sees those
        # rows), and copies of the rows moved. The sweep asks it too, through its
        # claim_check_idx (migration 0011's, renamed), or the first sweep after the move
        # deleted the objects of every message published before it, however recent.
        self._plain_table = (
            table_name(dialect, schema, f"{table}_plain") if dialect == "postgres" else None
        )
        self._plain_sql = (
            render(queries(dialect, "payload.sql")["referenced"], {"outbox": self._plain_table})
            if self._plain_table is not None
            else None
        )
        self._plain_exists: bool | None = None

    # ----- statements ------------------------------------------------------------------------

    def _run(self, name: str, params: dict[str, Any]) -> Any:
        sql = self._sql[name]
        cursor = self.conn.cursor()
        if self.dialect == "sqlite":
            cursor.execute(sql, params)
            return cursor
        sql = to_pyformat(sql)
        if self.dialect == "mysql":
            from outboxer.stores.mysql import expand_lists

            sql, params = expand_lists(sql, params)
        cursor.execute(sql, params)
        return cursor

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        """One transaction: committed on success, rolled back on any error."""
        if self.dialect == "sqlite":
            # IMMEDIATE: the write lock from the first read, so no relay writes in between.
            self.conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self.conn.rollback()
            raise
        self.conn.commit()

    # ----- the claim-check sweep -------------------------------------------------------------

    def referenced(self, names: Sequence[ObjectName]) -> list[str]:
        """Which of these objects some row refers to (``sweep_orphans``' question)."""
        if not names:
            return []
        plain = [parsed.name for parsed in names]
        value: Any = json.dumps(plain) if self.dialect == "sqlite" else plain
        with self._transaction():
            rows = self._run("referenced", {"names": value}).fetchall()
            if self._log_table is not None and self._has_log_table():
                rows += self._log_referenced(plain)
            if self._plain_sql is not None and self._has_plain_table():
                cursor = self.conn.cursor()
                cursor.execute(to_pyformat(self._plain_sql), {"names": value})
                rows += cursor.fetchall()
        return [str(row[0]) for row in rows]

    def _has_log_table(self) -> bool:
        if self._log_exists is None:
            self._log_exists = self._exists(self._log_table)
        return self._log_exists

    def _has_plain_table(self) -> bool:
        if self._plain_exists is None:
            self._plain_exists = self._exists(self._plain_table)
        return self._plain_exists

    def _exists(self, table: str | None) -> bool:
        cursor = self.conn.cursor()
        cursor.execute("SELECT to_regclass(%s) IS NOT NULL", (table,))
        return bool(cursor.fetchone()[0])

    def _log_referenced(self, names: list[str]) -> list[Any]:
        # payload.sql's "referenced" on the log table: the same question, its partitions
        # included (a query on the partitioned parent reads them all), through the log's
        # claim_check_idx (pglog migration 0002), whose condition the first line repeats.
        cursor = self.conn.cursor()
        cursor.execute(
            f"SELECT headers->>'outboxer-claim-check' FROM {self._log_table} "
            "WHERE headers ? 'outboxer-claim-check' "
            "AND headers->>'outboxer-claim-check' = ANY(%s)",
            (names,),
        )
        return list(cursor.fetchall())

    def sweep(
        self,
        store: ObjectStore,
        *,
        grace: float,
        call_timeout: float | None = DEFAULT_SWEEP_CALL_TIMEOUT,
        log: Log | None = None,
    ) -> int:
        """Delete the objects older than ``grace`` seconds that no row refers to, and on
        PostgreSQL none written since the oldest transaction still open began. Each store
        call is given up after ``call_timeout`` seconds (see ``sweep_orphans``); the
        sweep's lines go to ``log``."""
        now = time.time()
        began = self._oldest_transaction()
        if began is not None:
            # The sweep deletes objects older than now - grace. An enqueue's transaction open
            # for longer than the grace (a batch job, a session left idle in transaction)
            # would otherwise lose its objects and commit references to nothing, which
            # every consumer then fails to fetch. Its put may precede its first statement
            # (enqueue offloads before the INSERT), and the store's clock may not be the
            # database's: hence the margin.
            now = min(now, began - OPEN_TRANSACTION_MARGIN + grace)
        return sweep_orphans(
            store, self.referenced, grace=grace, now=now, call_timeout=call_timeout, log=log
        )

    def _oldest_transaction(self) -> float | None:
        if "oldest_transaction" not in self._sql:  # MariaDB, SQLite: the grace alone
            return None
        with self._transaction():
            row = self._run("oldest_transaction", {}).fetchone()
        return None if row is None or row[0] is None else float(row[0])

    # ----- key rotation ----------------------------------------------------------------------

    def rotate(
        self,
        keyring: KeyRing,
        *,
        batch: int = 500,
        claim_check: ClaimCheck | None = None,
        progress: Callable[[RotationResult], None] | None = None,
        call_timeout: float | None = DEFAULT_SWEEP_CALL_TIMEOUT,
    ) -> RotationResult:
        """Re-encrypt unfinished rows under ``keyring``'s current key (module docstring).

        A KMS that fails (KeyRingUnavailableError) stops the rotation, as does an object
        store that cannot store a claim-checked row's new object (ClaimCheckStoreError: it
        did not answer within ``claim_check``'s ``put_timeout``, ``max_unanswered_puts``
        puts are still unanswered, a full disk) or did not return a row's object within
        ``call_timeout`` seconds (ObjectReadTimeoutError; None: no bound): the batch rolls
        back, what committed stays, a new run goes on from there. Every put of the run goes
        through ``claim_check``, so a hung store costs at most its ``max_unanswered_puts``
        threads, and one ``put_timeout``, not one of each per row; a read leaves at most
        one thread hung, since the run stops.

        A delete not answered within ``call_timeout`` (or refused) fails no row: the
        objects no row refers to are logged and counted in ``orphaned``, for the sweep;
        after one timed out, the run deletes nothing more (each would wait as long, on a
        store that is not answering). On PostgreSQL, the log mode's rows still under other
        keys are counted last (``log_unrelayed``, ``log_relayed``), not rewritten.

        A ring that fetches its keys (``KeyRing.from_callable``, a KMS) is asked for every
        key the run needs before its first batch, each fetch given up after
        ``call_timeout`` seconds (``crypto.fetch_key_bounded_sync``): a KMS that does not
        answer stops the run with KeyRingUnavailableError before any row changed, rather
        than hold a batch's transaction (and the command) for ever. A key first used by a
        row enqueued after that is fetched for its row, bounded alike.
        """
        result = RotationResult()
        if keyring.fetches:
            self._fetch_rotation_keys(keyring, call_timeout)
        store = None if claim_check is None else _RunStore(claim_check, call_timeout, result)
        after = 0
        while True:
            with self._transaction():
                rows = self._run(
                    "rotation_batch",
                    {"after": after, "current": keyring.current_key_id, "batch": batch},
                ).fetchall()
                if not rows:
                    break
                after = int(rows[-1][0])
                replaced = self._rotate_rows(rows, keyring, store, result, call_timeout)
            # Committed: the rows refer to the new objects only.
            if store is not None and replaced:
                store.delete(replaced, "old object(s) of re-encrypted rows")
            if progress is not None:
                progress(result)
        if self._log_table is not None and self._has_log_table():
            self._count_log_keys(keyring.current_key_id, result)
        return result

    def _fetch_rotation_keys(self, keyring: KeyRing, timeout: float | None) -> None:
        """Fetch the current key and those of the rows to re-encrypt (rotation_batch's
        rows, all of them) into ``keyring``; a key the source does not have is left to its
        rows, each reported as failed as before."""
        key_id = _KEY_ID_SQL[self.dialect]
        mark = "?" if self.dialect == "sqlite" else "%s"
        # Only a JSON string short enough to be a key id: the ring refuses any other header
        # before a KMS sees it (the row fails, as it did), where its text was asked for (a
        # number 5 as "5", MariaDB's null as "null": a KMS refusing an unknown id stopped the
        # whole run) and every value was read into memory, however long.
        rows = _read(
            self.conn,
            self.dialect,
            f"SELECT DISTINCT {key_id} FROM {self._outbox} "
            f"WHERE status IN ('PENDING', 'FAILED') AND {_KEY_ID_IS_TEXT[self.dialect]} "
            f"AND {_LENGTH[self.dialect]}({key_id}) <= {MAX_KEY_ID_LENGTH} "
            f"AND {key_id} <> {mark}",
            (keyring.current_key_id,),
        )
        found = sorted({row[0] for row in rows if is_key_id(row[0])})
        for wanted in [keyring.current_key_id, *found]:
            try:
                fetch_key_bounded_sync(
                    keyring, wanted, timeout, waiter="a key rotation", log=logger
                )
            except KeyNotFoundError:
                continue
            except KeyRingUnavailableError as exc:
                raise KeyRingUnavailableError(
                    f"{exc}: the rotation stopped before re-encrypting any message"
                ) from exc

    def _count_log_keys(self, current: str, result: RotationResult) -> None:
        """Fill ``result.log_unrelayed`` and ``log_relayed``: one statement, one snapshot.

        A row is unrelayed while it sorts after the slowest reader's offset (the reading
        order, pglog's), or while no reader has registered: a reader starts at the log's
        beginning."""
        offsets = mode_tokens(self._schema, self._table)["offsets"]
        with self._transaction():
            cursor = self.conn.cursor()
            cursor.execute(
                "SELECT l.headers->>'outboxer-key-id', "
                "count(*) FILTER (WHERE s.order_xid IS NULL "
                "OR (l.order_xid, l.position) > (s.order_xid, s.position)), count(*) "
                f"FROM {self._log_table} AS l LEFT JOIN (SELECT order_xid, position "
                f"FROM {offsets} ORDER BY order_xid, position LIMIT 1) AS s ON true "
                "WHERE l.headers ? 'outboxer-key-id' AND l.headers->>'outboxer-key-id' <> %s "
                "GROUP BY 1 ORDER BY 1",
                (current,),
            )
            for key_id, unrelayed, total in cursor.fetchall():
                if unrelayed:
                    result.log_unrelayed[str(key_id)] = int(unrelayed)
                if total > unrelayed:
                    result.log_relayed[str(key_id)] = int(total - unrelayed)

    def _rotate_rows(
        self,
        rows: Sequence[Sequence[Any]],
        keyring: KeyRing,
        store: _RunStore | None,
        result: RotationResult,
        key_timeout: float | None,
    ) -> list[str]:
        """Update the batch's rows; return the objects they no longer refer to."""
        put: list[str] = []
        replaced: list[str] = []
        try:
            for row in rows:
                message = _message(row)
                try:
                    rotated = self._reencrypt(message, keyring, store, key_timeout)
                except SubjectKeyDeletedError:
                    result.shredded += 1
                    continue
                except (KeyRingUnavailableError, ClaimCheckStoreError, ObjectReadTimeoutError):
                    # Not the row's trouble but the KMS's or the store's: every row after it
                    # would fail the same way, each after its own wait.
                    raise
                except OutboxerError as exc:
                    result.failed.append(f"{message.id} ({message.destination}): {exc}")
                    continue
                if rotated is None:
                    continue
                new_object = rotated.headers.get(HEADER_CLAIM_CHECK)
                if new_object is not None:
                    put.append(new_object)
                updated = self._run(
                    "rotation_update",
                    {
                        "seq": message.stored_seq,
                        "payload": rotated.payload,
                        "content_type": rotated.content_type,
                        "headers": json.dumps(
                            dict(rotated.headers), separators=(",", ":"), ensure_ascii=False
                        ),
                        "old_key_id": message.headers[HEADER_KEY_ID],
                    },
                ).rowcount
                if updated:
                    result.rotated += 1
                    if is_claim_checked(message):
                        replaced.append(message.headers[HEADER_CLAIM_CHECK])
                else:
                    result.skipped += 1
                    if new_object is not None and store is not None:  # never referred to
                        put.remove(new_object)
                        store.delete([new_object], "new object(s) of rows re-keyed meanwhile")
        except BaseException:
            if store is not None and put:  # the transaction rolls back: unreferenced
                store.delete(put, "new object(s) of the batch rolled back")
            raise
        return replaced

    @staticmethod
    def _reencrypt(
        message: Message, keyring: KeyRing, store: _RunStore | None, key_timeout: float | None
    ) -> Message | None:
        # Fetched before the run began, unless a row enqueued since uses a new key; before
        # the row's object is read (its headers name the key).
        fetch_message_keys_sync(message, keyring, key_timeout, waiter="a key rotation", log=logger)
        if not is_claim_checked(message):
            return reencrypt(message, keyring)
        if store is None:
            raise ConfigError("the row is claim-checked: configure claim_check_store to rotate it")
        rotated = reencrypt(store.fetch(message), keyring)
        if rotated is None:
            return None
        # Always back to the store: the row was sized for a reference, not a payload. Through
        # the run's ClaimCheck: its put timeout and its cap on unanswered puts bound them all.
        return store.offload(rotated)


class _RunStore:
    """One rotation's calls to its object store. Puts go through the run's ClaimCheck (its
    ``put_timeout`` and ``max_unanswered_puts``); reads and deletes are given up after
    ``timeout`` seconds, in daemon threads under the caps of ``fetch_payload``'s read slots
    and of the sweeps' slots (``delete_many_bounded``). Once a call of the run went
    unanswered, the run tries no more deletes: the store is not answering, and each would
    hold the command (inside a batch's transaction, its rows) for as long again."""

    def __init__(
        self, claim_check: ClaimCheck, timeout: float | None, result: RotationResult
    ) -> None:
        self.claim_check = claim_check
        self.timeout = timeout
        self.result = result
        self.unanswered: str | None = None  # why the run stopped deleting

    def fetch(self, message: Message) -> Message:
        try:
            return fetch_payload(message, self.claim_check.store, timeout=self.timeout)
        except ObjectReadTimeoutError as exc:
            self.unanswered = str(exc)
            raise

    def offload(self, message: Message) -> Message:
        try:
            return self.claim_check.offload_always(message)
        except ClaimCheckStoreError as exc:
            if exc.errno in (errno.ETIMEDOUT, errno.EBUSY):  # unanswered, not refused
                self.unanswered = str(exc)
            raise

    def delete(self, names: Sequence[str], what: str) -> None:
        """Delete objects no row refers to; a failure is logged and counted, not raised:
        the sweep deletes them later, and none of the rows is the worse for it."""
        if not names:
            return
        if self.unanswered is None:
            try:
                delete_many_bounded(self.claim_check.store, names, timeout=self.timeout)
                return
            except ObjectDeleteTimeoutError as exc:
                self.unanswered = str(exc)
                reason = self.unanswered
            except Exception as exc:  # noqa: BLE001 -- refused: a later batch's may work
                reason = f"{type(exc).__name__}: {exc}"
        else:
            reason = f"not tried, the store did not answer earlier: {self.unanswered}"
        self.result.orphaned += len(names)
        logger.warning(
            "keys rotate: %d %s not deleted from claim-check store %r (%s); no row refers to "
            "them: `outboxer claim-check sweep` deletes them once older than its grace",
            len(names),
            what,
            self.claim_check.store,
            reason,
        )


# ----- which keys stored messages are under ----------------------------------------------------


#: A row's key id (its ``outboxer-key-id`` header) as each dialect's SQL reads it.
_KEY_ID_SQL = {
    "postgres": "headers->>'outboxer-key-id'",
    "mysql": "JSON_UNQUOTE(JSON_EXTRACT(headers, '$.\"outboxer-key-id\"'))",
    "sqlite": "json_extract(headers, '$.\"outboxer-key-id\"')",
}

#: Whether a row's key id header is a JSON string (not a number, a boolean, null, a list).
_KEY_ID_IS_TEXT = {
    "postgres": "jsonb_typeof(headers->'outboxer-key-id') = 'string'",
    "mysql": "JSON_TYPE(JSON_EXTRACT(headers, '$.\"outboxer-key-id\"')) = 'STRING'",
    "sqlite": "json_type(headers, '$.\"outboxer-key-id\"') = 'text'",
}

#: Each dialect's length of a text in characters.
_LENGTH = {"postgres": "length", "mysql": "CHAR_LENGTH", "sqlite": "length"}


@dataclass
class KeyUsage:
    """Stored messages under each key id in one place that can hold ciphertext."""

    #: What the place is (one of :data:`KEY_PLACES`' names).
    place: str
    #: The table, as SQL names it.
    table: str
    #: Messages by key id (unencrypted ones are not counted).
    keys: dict[str, int] = field(default_factory=dict)


#: Every place ``key_usage`` looks in, with what empties it of an old key: its name, the
#: dialects that have it, and the advice. The tables of other modes than the default one
#: exist only on PostgreSQL.
KEY_PLACES: dict[str, tuple[tuple[str, ...], str]] = {
    "outbox": (
        ("postgres", "mysql", "sqlite"),
        "unfinished messages: `outboxer keys rotate` re-encrypts them "
        "(PROCESSING ones once their relay settles them)",
    ),
    "outbox finished": (
        ("postgres", "mysql", "sqlite"),
        "PUBLISHED and ABANDONED messages, kept until retention (`outboxer cleanup`) deletes "
        "them: a replay or requeue of them needs their key",
    ),
    "log": (
        ("postgres",),
        "log mode (append-only, never re-encrypted): its readers need the key until they "
        "have relayed these, a replay until retention drops their partitions",
    ),
    "stream dead letters": (
        ("postgres",),
        "the stream relay's dead letters (log, WAL modes): "
        "`outboxer stream-relay dead-letters replay` or `purge` them first",
    ),
    "plain": (
        ("postgres",),
        "the table `schema migrate-partitioned` left behind: drop it once past retention",
    ),
    "debezium": (("postgres",), "Debezium-layout rows, until retention deletes them"),
    "consumer dead letters": (
        ("postgres", "mysql", "sqlite"),
        "consumers' dead letters, stored as they arrived: "
        "`outboxer dead-letters replay` or `purge` them first",
    ),
}


def _key_usage_tables(dialect: str, schema: str, table: str) -> dict[str, tuple[str, str]]:
    """Each place's table (its SQL name, and its bare name for the existence check)."""
    found = {
        "outbox": (table_name(dialect, schema, table), table),
        "outbox finished": (table_name(dialect, schema, table), table),
        "consumer dead letters": (table_name(dialect, schema, "dead_letters"), "dead_letters"),
    }
    if dialect == "postgres":
        names = mode_tokens(schema, table)
        found["log"] = (names["log"], f"{table}_log")
        found["stream dead letters"] = (
            names["stream_dead_letters"],
            names["stream_dead_letters_raw"],
        )
        found["plain"] = (table_name(dialect, schema, f"{table}_plain"), f"{table}_plain")
        found["debezium"] = (names["debezium"], names["debezium_raw"])
    return {place: found[place] for place in KEY_PLACES if place in found}


def key_usage(url: str, *, schema: str = "outboxer", table: str = "outbox") -> list[KeyUsage]:
    """By key id, the stored messages under each key in every place of :data:`KEY_PLACES`
    that the database at ``url`` has; a place whose table does not exist is left out.

    Reads only, on a connection of its own: a plain SELECT per place (no lock beyond what
    any reader takes, no write lock on SQLite), each in a transaction rolled back."""
    conn = connect(url)
    try:
        return _key_usage(conn, dialect_of(url), schema, table)
    finally:
        conn.close()


def _key_usage(conn: Any, dialect: str, schema: str, table: str) -> list[KeyUsage]:
    key_id = _KEY_ID_SQL[dialect]
    unfinished = "status IN ('PENDING', 'PROCESSING', 'FAILED')"
    where = {"outbox": unfinished, "outbox finished": f"NOT ({unfinished})"}
    usage = []
    for place, (sql_name, bare) in _key_usage_tables(dialect, schema, table).items():
        if not _table_exists(conn, dialect, schema, bare):
            continue
        condition = f"{where[place]} AND " if place in where else ""
        rows = _read(
            conn,
            dialect,
            f"SELECT {key_id} AS key_id, count(*) FROM {sql_name} "
            f"WHERE {condition}{key_id} IS NOT NULL GROUP BY {key_id} ORDER BY 1",
        )
        usage.append(KeyUsage(place, sql_name, {str(k): int(n) for k, n in rows}))
    return usage


def _read(conn: Any, dialect: str, sql: str, params: Sequence[Any] = ()) -> list[Any]:
    """One read, its transaction (if the driver opened one) rolled back."""
    cursor = conn.cursor()
    try:
        if params:
            cursor.execute(sql, params)
        else:  # no placeholders to expand (a driver's % formatting stays out)
            cursor.execute(sql)
        return list(cursor.fetchall())
    finally:
        cursor.close()
        conn.rollback()


def _table_exists(conn: Any, dialect: str, schema: str, name: str) -> bool:
    if dialect == "postgres":
        sql = "SELECT to_regclass(format('%%I.%%I', %s::text, %s::text)) IS NOT NULL"
        return bool(_read(conn, dialect, sql, (schema, name))[0][0])
    if dialect == "mysql":
        sql = (
            "SELECT count(*) FROM information_schema.tables "
            "WHERE table_schema = DATABASE() AND table_name = %s"
        )
        return bool(_read(conn, dialect, sql, (name,))[0][0])
    sql = "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = ?"
    return bool(_read(conn, dialect, sql, (name,))[0][0])


def _message(row: Sequence[Any]) -> Message:
    seq, identifier, destination, topic, key, payload, content_type, headers = row
    return Message(
        id=identifier if isinstance(identifier, uuid.UUID) else uuid.UUID(str(identifier)),
        topic=topic,
        payload=bytes(payload),
        key=key,
        headers=json.loads(headers),
        content_type=content_type,
        destination=destination,
        seq=int(seq),
    )


@contextmanager
def payload_table(
    url: str, *, schema: str = "outboxer", table: str = "outbox"
) -> Iterator[PayloadTable]:
    """A :class:`PayloadTable` on a new connection to ``url``, closed afterwards."""
    conn = connect(url)
    try:
        yield PayloadTable(conn, dialect_of(url), schema=schema, table=table)
    finally:
        conn.close()


__all__ = [
    "KEY_PLACES",
    "KeyUsage",
    "PayloadTable",
    "RotationResult",
    "connect",
    "key_usage",
    "payload_table",
]
