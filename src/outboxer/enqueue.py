"""The write path: add messages to the outbox on the caller's connection.

``enqueue`` and friends run one INSERT inside the caller's transaction and never
commit: if the caller rolls back, the message never existed. The connection's
type picks the SQL dialect and the driver's parameter style.
"""

from __future__ import annotations

import functools
import json
import threading
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from outboxer.errors import ConfigError, DuplicateMessageError, PayloadError
from outboxer.message import (
    DEFAULT_DESTINATION,
    MAX_DESTINATION_LENGTH,
    Message,
    coerce_message_id,
    destination_name_problem,
    encode_payload,
    validate_envelope,
)
from outboxer.redact import get_logger
from outboxer.stores import pgmodes
from outboxer.stores.base import check_identifier
from outboxer.stores.pgmodes import check_mode
from outboxer.stores.sqlfiles import (
    queries,
    render,
    strip_comments,
    table_name,
    to_numbered,
    to_pyformat,
)
from outboxer.tracing import inject_trace_context

if TYPE_CHECKING:
    from outboxer.claimcheck import ClaimCheck
    from outboxer.crypto import EnqueueKeyUnavailableError, KeyRing, KeyRingUnavailableError

logger = get_logger("outboxer.enqueue")

#: Seconds an enqueue waits for the current key of a ring that fetches it (a KMS) at its
#: first use: the relay's bound for the same fetch (payload_relay.KEY_FETCH_TIMEOUT), not
#: imported from there, which would load the relay's brokers into every writer.
KEY_FETCH_TIMEOUT = 30.0

SUPPORTED = (
    "sync: psycopg.Connection, psycopg2 connection, sqlite3.Connection, pymysql.Connection, "
    "MySQLdb connection, SQLAlchemy Connection or Session, Django connection; "
    "async: psycopg.AsyncConnection, asyncpg.Connection (or pool connection), "
    "aiomysql.Connection, SQLAlchemy AsyncConnection or AsyncSession"
)

#: MySQL's duplicate-key error, and its server status bits (autocommit on, transaction open).
_ER_DUP_ENTRY = 1062
_STATUS_IN_TRANS, _STATUS_AUTOCOMMIT = 1, 2
#: libpq's PQTRANS_IDLE: connected, no transaction open (psycopg and psycopg2 report it).
_PG_IDLE = 0


@dataclass(frozen=True)
class _Row:
    """One message as INSERT parameters."""

    message: Message

    def params(self, dialect: str) -> dict[str, Any]:
        m = self.message
        return {
            "id": m.id if dialect == "postgres" else str(m.id),
            "destination": m.destination,
            "topic": m.topic,
            "key": m.key,
            "payload": m.payload,
            "content_type": m.content_type,
            "headers": json.dumps(dict(m.headers), separators=(",", ":"), ensure_ascii=False),
        }


@dataclass(frozen=True)
class Outbox:
    """An outbox table: its names and the destinations each message is recorded for.

    ``outboxer.enqueue`` uses ``Outbox()``; make your own to use other names or
    several destinations::

        outbox = Outbox(schema="billing", destinations=("internal", "partner"))
        outbox.enqueue(conn, "invoice.paid", {"id": 7}, key="invoice-7")
    """

    schema: str = "outboxer"
    table: str = "outbox"
    destinations: tuple[str, ...] = (DEFAULT_DESTINATION,)
    #: Refuse (PayloadError, nothing written) a payload larger than this once encoded;
    #: None accepts any size the database takes.
    max_payload_bytes: int | None = None
    #: "table" (the default outbox), or a PostgreSQL mode: "log", "wal", "debezium"
    #: (outboxer.stores.pgmodes).
    mode: str = "table"
    #: Encrypt each destination's copy under this ring's current key before the INSERT
    #: (outboxer.crypto); the database then holds ciphertext only.
    encryption: KeyRing | None = None
    #: With ``encryption``: user headers moved inside the ciphertext (True: all of them).
    seal_headers: bool | tuple[str, ...] = False
    #: Offload payloads over its threshold (after encryption) to its object store before
    #: the INSERT (outboxer.claimcheck); the row then carries a reference.
    claim_check: ClaimCheck | None = None
    #: PostgreSQL: the most key locks one write takes (distinct keys of an enqueue_many, or
    #: of a replay). A write with more locks the table instead (queries.sql: table_lock):
    #: each key lock is an entry of the cluster's shared lock table, which a few thousand
    #: fill, and then every session's next lock fails.
    max_key_locks: int = 1000
    #: With an ``encryption`` ring that fetches its keys (``KeyRing.from_callable``, a KMS):
    #: seconds an enqueue waits for the current key at its first use, before any SQL; past
    #: it (or when the source fails), EnqueueKeyUnavailableError and nothing is written.
    #: The relay's ``PayloadHandling.key_fetch_timeout``, with its default.
    key_fetch_timeout: float = KEY_FETCH_TIMEOUT
    _cache: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        check_identifier("schema", self.schema)
        check_identifier("table", self.table)
        check_mode(self.mode)
        # Frozen: set through object's own setattr (a list given here becomes the tuple).
        object.__setattr__(self, "destinations", _destination_names(self.destinations))
        limit = self.max_payload_bytes
        if limit is not None and (
            isinstance(limit, bool) or not isinstance(limit, int) or limit < 1
        ):
            raise ConfigError(
                f"max_payload_bytes must be None or a whole number of bytes >= 1; got {limit!r}"
            )
        limit = self.max_key_locks
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ConfigError(f"max_key_locks must be a whole number >= 1; got {limit!r}")
        bound = self.key_fetch_timeout
        # NaN fails the comparison; past TIMEOUT_MAX (infinity too) a thread's wait overflows.
        if (
            isinstance(bound, bool)
            or not isinstance(bound, int | float)
            or not 0 < bound <= threading.TIMEOUT_MAX
        ):
            raise ConfigError(
                f"key_fetch_timeout must be a positive number of seconds; got {bound!r:.100}"
            )
        self._check_protection()

    def _check_protection(self) -> None:
        from outboxer.claimcheck import ClaimCheck
        from outboxer.crypto import KeyRing

        if self.encryption is not None and not isinstance(self.encryption, KeyRing):
            raise ConfigError(f"encryption must be a KeyRing or None; got {self.encryption!r:.100}")
        if self.claim_check is not None and not isinstance(self.claim_check, ClaimCheck):
            raise ConfigError(
                f"claim_check must be a ClaimCheck or None; got {self.claim_check!r:.100}"
            )
        sealed = self.seal_headers
        if not isinstance(sealed, bool):
            names = (sealed,) if isinstance(sealed, str) else tuple(sealed)
            if not all(isinstance(name, str) and name for name in names):
                raise ConfigError("seal_headers must be True, False or a list of header names")
            object.__setattr__(self, "seal_headers", names)
        if sealed and self.encryption is None:
            raise ConfigError("seal_headers needs encryption= (a KeyRing)")
        if self.claim_check is not None and self.mode not in ("table", "log"):
            # No table row of these modes refers to the object, so the orphan sweep (the
            # relay's cleanup, `outboxer claim-check sweep`) would delete it unread.
            raise ConfigError(
                f"claim_check needs mode 'table' or 'log': the {self.mode} mode keeps no "
                "row that refers to the object, and the orphan sweep would delete it"
            )
        self._check_one_copy(self.destinations)

    def _check_one_copy(self, destinations: Sequence[str]) -> None:
        """The log, WAL and Debezium modes store one copy of a message for every destination,
        while encryption and claim-check make a copy per destination (each bound to its own):
        every destination but the first would get a copy it cannot read."""
        protected = self.encryption is not None or self.claim_check is not None
        if protected and self.mode != "table" and len(destinations) > 1:
            raise ConfigError(
                f"the {self.mode} mode stores one copy of a message for every destination, "
                "and encryption or claim_check binds each copy to its own destination: "
                "use one destination, or mode 'table'"
            )

    # ----- building rows ------------------------------------------------------------------

    def build(
        self,
        topic: str,
        payload: object,
        *,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
        message_id: object = None,
        content_type: str | None = None,
        destinations: Sequence[str] | None = None,
        subject: str | None = None,
    ) -> list[Message]:
        """Validate and encode one message, one copy per destination (in plaintext: see
        :meth:`protect`). Raises PayloadError; ``max_payload_bytes`` counts the plaintext."""
        if subject is not None:
            from outboxer.crypto import check_subject

            if self.encryption is None:
                raise PayloadError("subject= needs an outbox with encryption= (a KeyRing)")
            check_subject(subject)
        # Every enqueue variant builds here: the active span's context rides in the headers.
        headers = inject_trace_context(headers)
        topic, key, clean_headers = validate_envelope(topic, key, headers)
        body, kind = encode_payload(payload, content_type, self.max_payload_bytes)
        identifier = coerce_message_id(message_id)
        targets = self.destinations if destinations is None else _destination_names(destinations)
        if destinations is not None:
            self._check_one_copy(targets)
        return [
            Message(
                id=identifier,
                topic=topic,
                payload=body,
                key=key,
                headers=clean_headers,
                content_type=kind,
                destination=destination,
            )
            for destination in targets
        ]

    def protect(self, copies: Sequence[Message], subject: str | None = None) -> list[Message]:
        """The copies as stored: each encrypted for its own destination when the outbox
        encrypts (so one destination's ciphertext never authenticates as another's)."""
        if self.encryption is None:
            return list(copies)
        from outboxer.crypto import encrypt_message

        return [
            encrypt_message(m, self.encryption, subject=subject, seal_headers=self.seal_headers)
            for m in copies
        ]

    def _built(self, items: Iterable[Mapping[str, Any]]) -> list[tuple[list[Message], Any]]:
        """Each message's plaintext copies (the first returned to the caller) and subject."""
        built = []
        for item in items:
            fields = dict(item)
            built.append((self.build(**fields), fields.get("subject")))
        return built

    def _protected(self, built: Sequence[tuple[list[Message], Any]]) -> list[Message]:
        """The copies as stored, once the current key is held (``_fetch_current_key``)."""
        return [m for copies, subject in built for m in self.protect(copies, subject)]

    # ----- the key ring's current key -----------------------------------------------------

    def _ring_to_fetch(self) -> KeyRing | None:
        """The ring whose current key an enqueue must fetch before it encrypts: one with a
        source (a KMS) that does not hold the key yet. None for a static ring, or a key
        fetched before: two attribute reads and a dict lookup, no thread nor lock."""
        ring = self.encryption
        if ring is None or not ring.fetches or ring.has_key(ring.current_key_id):
            return None
        return ring

    def _fetch_current_key(self) -> None:
        """Fetch the current key (``crypto.fetch_key_bounded_sync``) before any SQL: within
        ``key_fetch_timeout``, or EnqueueKeyUnavailableError. Encrypting fetched it on the
        caller's thread unbounded, inside its open transaction: a silent KMS held the
        request, and the transaction's row locks, for ever."""
        ring = self._ring_to_fetch()
        if ring is None:
            return
        from outboxer.crypto import KeyRingUnavailableError, fetch_key_bounded_sync

        try:
            fetch_key_bounded_sync(
                ring,
                ring.current_key_id,
                self.key_fetch_timeout,
                waiter="the enqueue",
                log=logger,
            )
        except KeyRingUnavailableError as exc:
            raise self._key_unavailable(ring, exc) from exc

    async def _fetch_current_key_async(self) -> None:
        """``_fetch_current_key`` awaited (``crypto.fetch_key_bounded``): the call runs in a
        daemon thread of its own, never on the event loop."""
        ring = self._ring_to_fetch()
        if ring is None:
            return
        from outboxer.crypto import KeyRingUnavailableError, fetch_key_bounded

        try:
            await fetch_key_bounded(
                ring,
                ring.current_key_id,
                self.key_fetch_timeout,
                waiter="the enqueue",
                log=logger,
            )
        except KeyRingUnavailableError as exc:
            raise self._key_unavailable(ring, exc) from exc

    def _key_unavailable(
        self, ring: KeyRing, exc: KeyRingUnavailableError
    ) -> EnqueueKeyUnavailableError:
        from outboxer.crypto import EnqueueKeyUnavailableError

        key_id, bound = ring.current_key_id, self.key_fetch_timeout
        # The cause's text is the ring's own: the source's error masked (crypto._kms_error).
        return EnqueueKeyUnavailableError(
            f"enqueue: no encryption key {key_id!r} from the key ring's source within "
            f"key_fetch_timeout={bound:g} s ({exc}); nothing was written: outboxer sent no "
            "SQL, the transaction is the caller's to roll back",
            key_id,
            bound,
        )

    # ----- SQL per dialect and driver -----------------------------------------------------

    def _sql(self, dialect: str, name: str) -> str:
        cache_key = f"{dialect}:{name}"
        if cache_key not in self._cache:
            tokens = {
                "outbox": table_name(dialect, self.schema, self.table),
                "key_slots": table_name(dialect, self.schema, self.table + "_key_slots"),
            }
            rendered = render(queries(dialect)[name], tokens)
            # PyMySQL and aiomysql batch an executemany into one INSERT only without comments.
            self._cache[cache_key] = strip_comments(rendered) if dialect == "mysql" else rendered
        sql: str = self._cache[cache_key]
        return sql

    # ----- sync --------------------------------------------------------------------------

    def enqueue(
        self,
        conn: Any,
        topic: str,
        payload: object,
        *,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
        message_id: object = None,
        content_type: str | None = None,
        destinations: Sequence[str] | None = None,
        subject: str | None = None,
    ) -> Message:
        """Add one message in the caller's transaction; return it (with its id), as given:
        in plaintext, for the first destination.

        ``subject`` (with ``encryption``) encrypts under the subject's own key, which
        ``outboxer keys shred SUBJECT`` deletes. Claim-checked payloads are put in the
        object store before the INSERT: if the transaction rolls back, the object is an
        orphan that ``outboxer claim-check sweep`` deletes.

        A ring that fetches its keys (a KMS) gets the current key at its first use before
        any SQL, within ``key_fetch_timeout``: else EnqueueKeyUnavailableError, nothing
        written.
        """
        copies = self.build(
            topic,
            payload,
            key=key,
            headers=headers,
            message_id=message_id,
            content_type=content_type,
            destinations=destinations,
            subject=subject,
        )
        self._fetch_current_key()
        self._write(conn, self.protect(copies, subject))
        return copies[0]

    def enqueue_many(self, conn: Any, items: Iterable[Mapping[str, Any]]) -> list[Message]:
        """Add several messages (each a mapping of ``enqueue``'s arguments) in one round trip."""
        built = self._built(items)
        if built:
            self._fetch_current_key()
        self._write(conn, self._protected(built))
        return [copies[0] for copies, _ in built]

    def _write(self, conn: Any, messages: Sequence[Message]) -> None:
        driver = detect(conn)
        if driver.is_async:
            raise TypeError(f"{driver.name} is an async connection: use `await enqueue_async(...)`")
        if not messages:
            return
        _refuse_repeated_ids(messages)
        if self.claim_check is not None:  # the objects are durable before the row exists
            messages = self.claim_check.offload_all(messages)
        try:
            if self.mode == "table":
                driver.write(self, conn, messages)
            else:
                pgmodes.write(driver, self.mode, self.schema, self.table, conn, messages)
        except Exception as exc:
            _raise_duplicate(exc, messages)
            raise

    # ----- async -------------------------------------------------------------------------

    async def enqueue_async(
        self,
        conn: Any,
        topic: str,
        payload: object,
        *,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
        message_id: object = None,
        content_type: str | None = None,
        destinations: Sequence[str] | None = None,
        subject: str | None = None,
    ) -> Message:
        """:meth:`enqueue` awaited; a key fetch from a KMS never blocks the event loop."""
        copies = self.build(
            topic,
            payload,
            key=key,
            headers=headers,
            message_id=message_id,
            content_type=content_type,
            destinations=destinations,
            subject=subject,
        )
        await self._fetch_current_key_async()
        await self._write_async(conn, self.protect(copies, subject))
        return copies[0]

    async def enqueue_many_async(
        self, conn: Any, items: Iterable[Mapping[str, Any]]
    ) -> list[Message]:
        built = self._built(items)
        if built:
            await self._fetch_current_key_async()
        await self._write_async(conn, self._protected(built))
        return [copies[0] for copies, _ in built]

    async def _write_async(self, conn: Any, messages: Sequence[Message]) -> None:
        driver = detect(conn)
        if not driver.is_async:
            raise TypeError(f"{driver.name} is a sync connection: use `enqueue(...)`")
        if not messages:
            return
        _refuse_repeated_ids(messages)
        if self.claim_check is not None:
            messages = await self.claim_check.offload_all_async(messages)
        try:
            if self.mode == "table":
                await driver.write_async(self, conn, messages)
            else:
                await pgmodes.write_async(
                    driver, self.mode, self.schema, self.table, conn, messages
                )
        except Exception as exc:
            _raise_duplicate(exc, messages)
            raise


def _destination_names(destinations: Iterable[object]) -> tuple[str, ...]:
    """``destinations`` as a tuple of names; ConfigError unless each is a storable name."""
    given = () if isinstance(destinations, str) else tuple(destinations)
    names = tuple(
        name
        for name in given
        if isinstance(name, str) and name and len(name) <= MAX_DESTINATION_LENGTH
    )
    if len(set(names)) != len(names):
        # Two copies of one message for one destination: the unique index refuses the second.
        raise ConfigError(f"destinations names a destination twice: {destinations!r:.100}")
    if not names or len(names) != len(given):
        raise ConfigError(
            "destinations must be a non-empty list of destination names "
            f"(non-empty strings of at most {MAX_DESTINATION_LENGTH} characters); "
            f"got {destinations!r:.100}"
        )
    for name in names:
        if problem := destination_name_problem(name):
            raise ConfigError(problem)
    return names


def _refuse_repeated_ids(messages: Sequence[Message]) -> None:
    """DuplicateMessageError before any SQL for an id given twice for one destination in one
    write: the unique index would refuse it too, but on PostgreSQL that error aborts the
    caller's transaction (and claim-checked payloads would be put for nothing)."""
    seen: set[tuple[object, str]] = set()
    for m in messages:
        if (m.id, m.destination) in seen:
            raise DuplicateMessageError(
                f"message id {m.id} is given twice for destination {m.destination!r:.80} "
                "in one write: nothing was written"
            )
        seen.add((m.id, m.destination))


def _raise_duplicate(exc: BaseException, messages: Sequence[Message]) -> None:
    """Turn a driver's unique violation on (id, destination) into DuplicateMessageError."""
    seen: BaseException | None = exc
    while seen is not None:  # SQLAlchemy wraps the driver's error
        name = type(seen).__name__
        text = str(seen)
        if (
            name in ("UniqueViolation", "UniqueViolationError")
            or (name == "IntegrityError" and "UNIQUE" in text and ".id" in text)
            or (mysql_errno(seen) == _ER_DUP_ENTRY and "id_destination" in text)
        ):
            ids = ", ".join(sorted({str(m.id) for m in messages}))
            raise DuplicateMessageError(
                f"a message with id {ids} is already in the outbox"
            ) from exc
        seen = seen.__cause__ or getattr(seen, "orig", None)


def mysql_errno(exc: BaseException) -> int | None:
    """The MySQL error number of a PyMySQL, aiomysql or mysqlclient error (None for others)."""
    if type(exc).__module__.split(".", 1)[0] not in ("pymysql", "MySQLdb") or not exc.args:
        return None
    code = exc.args[0]
    return code if isinstance(code, int) else None


# ----- drivers ------------------------------------------------------------------------------


def _many_params(messages: Sequence[Message], *, lock_keys: bool) -> dict[str, Any]:
    rows = [_Row(m).params("postgres") for m in messages]
    return {
        "lock_keys": lock_keys,
        "ids": [r["id"] for r in rows],
        "destinations": [r["destination"] for r in rows],
        "topics": [r["topic"] for r in rows],
        "keys": [r["key"] for r in rows],
        "payloads": [r["payload"] for r in rows],
        "content_types": [r["content_type"] for r in rows],
        "headers": [r["headers"] for r in rows],
    }


class _Driver:
    """Runs ``:name``-style SQL on one kind of connection; returns affected rows."""

    name = "?"
    is_async = False

    def dialect(self, conn: Any) -> str:
        return "postgres"

    def execute(self, conn: Any, sql: str, params: dict[str, Any]) -> int:
        raise NotImplementedError

    async def execute_async(self, conn: Any, sql: str, params: dict[str, Any]) -> int:
        raise NotImplementedError

    def execute_many(self, conn: Any, sql: str, rows: Sequence[dict[str, Any]]) -> None:
        for params in rows:
            self.execute(conn, sql, params)

    async def execute_many_async(self, conn: Any, sql: str, rows: Sequence[dict[str, Any]]) -> None:
        for params in rows:
            await self.execute_async(conn, sql, params)

    def driver_connection(self, conn: Any) -> Any:
        """The DB-API (or aiomysql) connection under ``conn``."""
        return conn

    async def driver_connection_async(self, conn: Any) -> Any:
        return conn

    @staticmethod
    def statements(
        outbox: Outbox, dialect: str, messages: Sequence[Message], *, key_locks: bool = True
    ) -> list[tuple[str, list[dict[str, Any]]]]:
        """The statements that insert ``messages``, each with its rows of parameters.

        ``key_locks=False`` (PostgreSQL): the transaction holds the table lock already
        (a replay of many keys), so the rows take no key lock.
        """
        if dialect == "mysql":
            # Each key's slot locked before any row takes its seq; see queries.sql, key_lock.
            # The list is padded to a power of two with its last slot (locked once all the
            # same), so the statement takes one of 17 shapes, not one per key count: the
            # formatted statements are cached.
            slots = mysql_key_slots(m.key for m in messages)
            if slots:
                slots += [slots[-1]] * ((1 << (len(slots) - 1).bit_length()) - len(slots))
            locks = (
                [
                    (
                        outbox._sql(dialect, "key_lock").replace(
                            ":slots", ", ".join(f":slot_{n}" for n in range(len(slots)))
                        ),
                        [{f"slot_{n}": slot for n, slot in enumerate(slots)}],
                    )
                ]
                if slots
                else []
            )
            return [
                *locks,
                (outbox._sql(dialect, "insert"), [_Row(m).params(dialect) for m in messages]),
            ]
        if dialect == "sqlite" or (len(messages) == 1 and key_locks):
            # SQLite has no arrays (one row a statement) and no key locks (one writer at once).
            return [(outbox._sql(dialect, "insert"), [_Row(m).params(dialect) for m in messages])]
        insert = outbox._sql(dialect, "insert_many")
        if key_locks and _more_keys_than(messages, outbox.max_key_locks):
            return [
                (outbox._sql(dialect, "table_lock"), [{}]),
                (insert, [_many_params(messages, lock_keys=False)]),
            ]
        return [(insert, [_many_params(messages, lock_keys=key_locks)])]

    def check_transaction(self, conn: Any) -> None:
        """TypeError unless ``conn`` is inside a transaction (or commits only when told)."""
        _refuse_autocommit(self.name, self.driver_connection(conn))

    async def check_transaction_async(self, conn: Any) -> None:
        _refuse_autocommit(self.name, await self.driver_connection_async(conn))

    def mysql_charset(self, conn: Any) -> str | None:
        """The character set of the MySQL connection under ``conn`` (None: not known)."""
        return _charset_of(self.driver_connection(conn))

    async def mysql_charset_async(self, conn: Any) -> str | None:
        return _charset_of(await self.driver_connection_async(conn))

    def write(self, outbox: Outbox, conn: Any, messages: Sequence[Message]) -> None:
        dialect = self.dialect(conn)
        if dialect in ("mysql", "sqlite"):
            # SQLite and MySQL in autocommit commit each statement apart (SQLAlchemy's
            # AUTOCOMMIT isolation included). PostgreSQL's insert is one statement, key
            # lock and rows together, so an autocommit enqueue there stays allowed.
            self.check_transaction(conn)
        if dialect == "mysql":
            _check_mysql_text(self.mysql_charset(conn), messages)
        for sql, rows in self.statements(outbox, dialect, messages):
            if len(rows) == 1:
                self.execute(conn, sql, rows[0])
            else:
                self.execute_many(conn, sql, rows)

    async def write_async(
        self, outbox: Outbox, conn: Any, messages: Sequence[Message], *, key_locks: bool = True
    ) -> None:
        dialect = self.dialect(conn)
        if dialect in ("mysql", "sqlite"):
            await self.check_transaction_async(conn)
        if dialect == "mysql":
            _check_mysql_text(await self.mysql_charset_async(conn), messages)
        for sql, rows in self.statements(outbox, dialect, messages, key_locks=key_locks):
            if len(rows) == 1:
                await self.execute_async(conn, sql, rows[0])
            else:
                await self.execute_many_async(conn, sql, rows)


#: MySQL's three-byte UTF-8: a connection in it cannot carry characters beyond U+FFFF.
_MYSQL_UTF8MB3 = ("utf8", "utf8mb3")


def _charset_of(raw: Any) -> str | None:
    """A PyMySQL, aiomysql (``charset``) or mysqlclient connection's character set."""
    name = getattr(raw, "charset", None)
    if not isinstance(name, str):
        get = getattr(raw, "character_set_name", None)
        name = get() if callable(get) else None
    return name.lower() if isinstance(name, str) else None


def _check_mysql_text(charset: str | None, messages: Sequence[Message]) -> None:
    """PayloadError, before any SQL, for a character beyond U+FFFF (an emoji, say) on a
    connection in utf8mb3: the server turns it into '?' (sql_mode without strict: "k😀"
    and "k😃" become one key "k?", and the row names another topic) or refuses the row
    after the key lock was taken. The columns are utf8mb4; the connection decides."""
    if charset not in _MYSQL_UTF8MB3:
        return
    for m in messages:
        texts = [("the topic", m.topic), ("the key", m.key), ("a destination", m.destination)]
        texts += [(f"the header {name!r:.80}", name + value) for name, value in m.headers.items()]
        for what, text in texts:
            if text is not None and any(ord(char) > 0xFFFF for char in text):
                raise PayloadError(
                    f"{what} holds a character beyond U+FFFF, which this MySQL connection "
                    f"(character set {charset}) cannot carry: connect with charset='utf8mb4'"
                )


def _more_keys_than(messages: Sequence[Message], limit: int) -> bool:
    """Whether ``messages`` carry more than ``limit`` distinct keys."""
    if len(messages) <= limit:  # the common case: no set built
        return False
    return len({m.key for m in messages if m.key is not None}) > limit


def _refuse_autocommit(name: str, raw: Any) -> None:
    """Refuse a connection that would commit each statement on its own: the row (and on MySQL
    the key lock) would commit apart from the caller's rows, and an inbox record apart from
    the work it records, so a failed apply would still mark the message as applied."""
    if _outside_transaction(raw):
        raise _autocommit_error(name)


def _autocommit_error(name: str) -> TypeError:
    return TypeError(
        f"{name} is in autocommit mode and no transaction is open: begin a "
        "transaction first (conn.begin()) or turn autocommit off; outboxer never "
        "commits for you"
    )


def _outside_transaction(raw: Any) -> bool:
    """Whether the driver connection ``raw`` is in autocommit with no transaction open.

    PyMySQL and aiomysql report whether a transaction is open; mysqlclient does not, so an
    autocommit mysqlclient connection counts as outside even inside BEGIN. A connection
    of a driver not named here (Django's wrapper, aiosqlite) is checked elsewhere or not.
    """
    root = type(raw).__module__.split(".", 1)[0]
    if root == "sqlite3":
        # Python 3.12's autocommit=True ignores isolation_level; LEGACY (-1) or absent keeps it.
        autocommit = getattr(raw, "autocommit", None) is True or raw.isolation_level is None
        return autocommit and not raw.in_transaction
    if root in ("pymysql", "aiomysql", "MySQLdb"):
        status = getattr(raw, "server_status", None)
        if isinstance(status, int):
            return bool(status & _STATUS_AUTOCOMMIT) and not status & _STATUS_IN_TRANS
        get_autocommit = getattr(raw, "get_autocommit", None)
        return bool(get_autocommit()) if get_autocommit is not None else False
    if root == "psycopg":  # autocommit=True inside conn.transaction() is INTRANS, not IDLE
        return bool(raw.autocommit) and int(raw.info.transaction_status) == _PG_IDLE
    if root == "psycopg2":
        return bool(raw.autocommit) and int(raw.get_transaction_status()) == _PG_IDLE
    if root == "asyncpg":  # asyncpg commits every statement outside conn.transaction()
        return not raw.is_in_transaction()
    return False


class _Psycopg(_Driver):
    name = "psycopg.Connection"

    def execute(self, conn: Any, sql: str, params: dict[str, Any]) -> int:
        return int(conn.execute(_pyformat(sql), params).rowcount)


class _Psycopg2(_Driver):
    name = "psycopg2 connection"

    def execute(self, conn: Any, sql: str, params: dict[str, Any]) -> int:
        with conn.cursor() as cursor:
            cursor.execute(_pyformat(sql), _psycopg2_params(params))
            return int(cursor.rowcount)


def _psycopg2_params(params: dict[str, Any]) -> dict[str, Any]:
    """UUIDs as text (the SQL casts them): psycopg2 adapts uuid.UUID only once the
    application has called psycopg2.extras.register_uuid(), which outboxer must not do."""
    return {
        name: [str(item) for item in value]
        if name == "ids"
        else str(value)
        if name == "id"
        else value
        for name, value in params.items()
    }


class _Django(_Driver):
    """A Django connection (``django.db.connection`` or ``connections[alias]``).

    SQL runs through Django's own cursor, so it shows in Django's query log and debug tools.
    Django runs in autocommit outside ``transaction.atomic()``; there the message would
    commit on its own, apart from the business rows, so enqueue refuses.
    """

    name = "Django connection"
    _DIALECTS = {"postgresql": "postgres", "sqlite": "sqlite", "mysql": "mysql"}

    def dialect(self, conn: Any) -> str:
        vendor = str(conn.vendor)
        if vendor not in self._DIALECTS:
            raise TypeError(f"Django database vendor {vendor!r} is not supported by outboxer")
        return self._DIALECTS[vendor]

    def execute(self, conn: Any, sql: str, params: dict[str, Any]) -> int:
        with conn.cursor() as cursor:
            cursor.execute(_pyformat(sql), params)
            return int(cursor.rowcount)

    def execute_many(self, conn: Any, sql: str, rows: Sequence[dict[str, Any]]) -> None:
        with conn.cursor() as cursor:  # on MySQL, INSERTs become one multi-row statement
            cursor.executemany(_pyformat(sql), rows)

    def check_transaction(self, conn: Any) -> None:
        if conn.get_autocommit():
            raise TypeError(
                f"the {conn.alias!r} Django connection is in autocommit mode: "
                "enqueue inside transaction.atomic(), with the rows it announces; "
                "outboxer never commits for you"
            )

    def mysql_charset(self, conn: Any) -> str | None:
        return _charset_of(conn.connection)  # connected: check_transaction ran first

    def write(self, outbox: Outbox, conn: Any, messages: Sequence[Message]) -> None:
        self.check_transaction(conn)  # on PostgreSQL too: outside atomic() is a mistake
        super().write(outbox, conn, messages)


class _PsycopgAsync(_Driver):
    name = "psycopg.AsyncConnection"
    is_async = True

    async def execute_async(self, conn: Any, sql: str, params: dict[str, Any]) -> int:
        return int((await conn.execute(_pyformat(sql), params)).rowcount)


class _Asyncpg(_Driver):
    name = "asyncpg.Connection"
    is_async = True

    async def execute_async(self, conn: Any, sql: str, params: dict[str, Any]) -> int:
        numbered, names = _numbered(sql)
        tag = str(await conn.execute(numbered, *(params[name] for name in names)))
        count = tag.rsplit(" ", 1)[-1]  # "INSERT 0 3"; "LOCK TABLE" counts no rows
        return int(count) if count.isdigit() else 0


class _Sqlite(_Driver):
    name = "sqlite3.Connection"

    def dialect(self, conn: Any) -> str:
        return "sqlite"

    def execute(self, conn: Any, sql: str, params: dict[str, Any]) -> int:
        if conn.isolation_level is None and not conn.in_transaction:
            # Autocommit would commit each statement on its own; outboxer never commits for you.
            raise TypeError(
                "sqlite3 connection is in autocommit mode and no transaction is open: "
                "run BEGIN first, or use the default isolation_level"
            )
        return int(conn.execute(sql, params).rowcount)


class _PyMySQL(_Driver):
    """PyMySQL, and mysqlclient (MySQLdb), which has the same DB-API shape."""

    def __init__(self, name: str) -> None:
        self.name = name

    def dialect(self, conn: Any) -> str:
        return "mysql"

    def execute(self, conn: Any, sql: str, params: dict[str, Any]) -> int:
        with conn.cursor() as cursor:
            return int(cursor.execute(_pyformat(sql), params))

    def execute_many(self, conn: Any, sql: str, rows: Sequence[dict[str, Any]]) -> None:
        with conn.cursor() as cursor:  # INSERTs become one multi-row statement
            cursor.executemany(_pyformat(sql), rows)


class _AioMySQL(_Driver):
    name = "aiomysql.Connection"
    is_async = True

    def dialect(self, conn: Any) -> str:
        return "mysql"

    async def execute_async(self, conn: Any, sql: str, params: dict[str, Any]) -> int:
        async with conn.cursor() as cursor:
            return int(await cursor.execute(_pyformat(sql), _aiomysql_params(params)))

    async def execute_many_async(self, conn: Any, sql: str, rows: Sequence[dict[str, Any]]) -> None:
        async with conn.cursor() as cursor:
            await cursor.executemany(_pyformat(sql), [_aiomysql_params(row) for row in rows])


class _AiomysqlBytes:
    """``bytes`` for aiomysql. aiomysql 0.3.2 cannot escape bytes with PyMySQL 1.2.3 or later
    (it calls a PyMySQL helper that became a placeholder string: aio-libs/aiomysql#1080);
    values of any other type it escapes through PyMySQL's ``encoders`` table, where this
    type renders as PyMySQL itself renders bytes."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data


def _escape_aiomysql_bytes(value: _AiomysqlBytes, mapping: object = None) -> str:
    return "_binary X'" + value.data.hex() + "'"


@functools.cache
def _register_aiomysql_bytes() -> None:
    # The table aiomysql escapes with: `pymysql.converters` can name another copy of the
    # module once pymysql.install_as_MySQLdb() has let something import MySQLdb.converters
    # (Django's MySQL backend on PyMySQL does).
    from aiomysql import connection

    # A new entry for outboxer's own type: no other value escapes differently.
    connection.encoders.setdefault(_AiomysqlBytes, _escape_aiomysql_bytes)


def _aiomysql_params(params: dict[str, Any]) -> dict[str, Any]:
    _register_aiomysql_bytes()
    return {
        name: _AiomysqlBytes(value) if isinstance(value, bytes) else value
        for name, value in params.items()
    }


class _SqlAlchemy(_Driver):
    """Connection or Session; SQL goes through ``text()`` so the dialect's driver binds it."""

    def __init__(self, name: str, is_async: bool) -> None:
        self.name = name
        self.is_async = is_async

    @staticmethod
    def _dialect(conn: Any) -> Any:
        return (conn.get_bind() if hasattr(conn, "get_bind") else conn).dialect

    def dialect(self, conn: Any) -> str:
        name = str(self._dialect(conn).name)
        if name == "postgresql":
            return "postgres"
        if name == "sqlite":
            return "sqlite"
        if name in ("mysql", "mariadb"):
            return "mysql"
        raise TypeError(f"SQLAlchemy dialect {name!r} is not supported by outboxer yet")

    def _bindable(self, conn: Any, params: dict[str, Any]) -> dict[str, Any]:
        """aiomysql cannot escape bytes itself. Its sync face (an async engine's connection
        inside a flush event or ``run_sync``) reaches here through the sync methods too."""
        if self._dialect(conn).driver == "aiomysql":
            return _aiomysql_params(params)
        return params

    def execute(self, conn: Any, sql: str, params: dict[str, Any]) -> int:
        from sqlalchemy import text

        return int(conn.execute(text(sql), self._bindable(conn, params)).rowcount)

    async def execute_async(self, conn: Any, sql: str, params: dict[str, Any]) -> int:
        from sqlalchemy import text

        return int((await conn.execute(text(sql), self._bindable(conn, params))).rowcount)

    def execute_many(self, conn: Any, sql: str, rows: Sequence[dict[str, Any]]) -> None:
        from sqlalchemy import text

        conn.execute(text(sql), [self._bindable(conn, row) for row in rows])

    async def execute_many_async(self, conn: Any, sql: str, rows: Sequence[dict[str, Any]]) -> None:
        from sqlalchemy import text

        await conn.execute(text(sql), [self._bindable(conn, row) for row in rows])

    def driver_connection(self, conn: Any) -> Any:
        connection = conn.connection() if hasattr(conn, "get_bind") else conn  # Session
        return connection.connection.driver_connection

    def check_transaction(self, conn: Any) -> None:
        connection = conn.connection() if hasattr(conn, "get_bind") else conn  # Session
        if _sqlalchemy_outside_transaction(connection.connection):
            raise _autocommit_error(self.name)

    async def check_transaction_async(self, conn: Any) -> None:
        connection = await conn.connection() if hasattr(conn, "get_bind") else conn
        if _sqlalchemy_outside_transaction(await connection.get_raw_connection()):
            raise _autocommit_error(self.name)

    async def driver_connection_async(self, conn: Any) -> Any:
        connection = await conn.connection() if hasattr(conn, "get_bind") else conn  # AsyncSession
        return (await connection.get_raw_connection()).driver_connection


def _sqlalchemy_outside_transaction(pooled: Any) -> bool:
    """``_outside_transaction`` for the pool's connection under a SQLAlchemy connection.

    asyncpg has no autocommit switch: SQLAlchemy's adapter opens the asyncpg transaction at
    the block's first statement, unless its AUTOCOMMIT isolation turned that off; so before
    the first statement of a block asyncpg itself reports no transaction.
    """
    raw = pooled.driver_connection
    if type(raw).__module__.split(".", 1)[0] == "asyncpg":
        adapter = pooled.dbapi_connection
        return bool(getattr(adapter, "autocommit", False)) and not raw.is_in_transaction()
    return _outside_transaction(raw)


MYSQL_KEY_SLOTS = 65536  # rows of <table>_key_slots (MySQL migration 0005)


def mysql_key_slots(keys: Iterable[str | None]) -> list[int]:
    """The key-lock slots of ``keys`` on MySQL, sorted and distinct: the order every writer
    locks them in, so none waits for another in a cycle. In SQL: ``CRC32(key) & 65535``."""
    return sorted(
        {zlib.crc32(key.encode()) & (MYSQL_KEY_SLOTS - 1) for key in keys if key is not None}
    )


@functools.cache
def _pyformat(sql: str) -> str:
    return to_pyformat(sql)


@functools.cache
def _numbered(sql: str) -> tuple[str, tuple[str, ...]]:
    return to_numbered(sql)


def detect(conn: Any) -> _Driver:
    """Which driver ``conn`` belongs to, by its class (no driver is imported for this)."""
    kind = type(conn)
    driver = _DRIVERS.get(kind)
    if driver is None:  # once per connection class, not once per enqueue (the write path)
        driver = _DRIVERS[kind] = _driver_for(kind)
    return driver


_DRIVERS: dict[type, _Driver] = {}


def _driver_for(kind: type) -> _Driver:
    for cls in kind.__mro__:
        module, name = cls.__module__, cls.__qualname__
        root = module.split(".", 1)[0]
        if root == "psycopg":
            if name == "Connection":
                return _Psycopg()
            if name == "AsyncConnection":
                return _PsycopgAsync()
        elif root == "psycopg2" and name == "connection":
            return _Psycopg2()
        elif root == "django" and name in ("BaseDatabaseWrapper", "ConnectionProxy"):
            return _Django()  # the proxy (django.db.connection) hands every attribute on
        elif root == "asyncpg" and name in ("Connection", "PoolConnectionProxy"):
            return _Asyncpg()
        elif root == "sqlite3" and name == "Connection":
            return _Sqlite()
        elif root == "pymysql" and name == "Connection":
            return _PyMySQL("pymysql.Connection")
        elif root == "MySQLdb" and name == "Connection":
            return _PyMySQL("MySQLdb connection")
        elif root == "aiomysql" and name == "Connection":
            return _AioMySQL()
        elif root == "sqlalchemy":
            if name in ("Connection", "Session"):
                return _SqlAlchemy(f"sqlalchemy {name}", is_async=False)
            if name in ("AsyncConnection", "AsyncSession"):
                return _SqlAlchemy(f"sqlalchemy {name}", is_async=True)
    raise TypeError(
        f"unsupported connection type {kind.__module__}.{kind.__qualname__}; "
        f"outboxer supports {SUPPORTED}"
    )


DEFAULT_OUTBOX = Outbox()


def configure(
    *,
    schema: str = "outboxer",
    table: str = "outbox",
    destinations: Sequence[str] = (DEFAULT_DESTINATION,),
    max_payload_bytes: int | None = None,
    mode: str = "table",
    encryption: KeyRing | None = None,
    seal_headers: bool | tuple[str, ...] = False,
    claim_check: ClaimCheck | None = None,
    max_key_locks: int = 1000,
    key_fetch_timeout: float = KEY_FETCH_TIMEOUT,
) -> Outbox:
    """Set the names, destinations, payload limit, payload protection, key-lock limit and
    key fetch bound that the module-level ``enqueue`` functions use."""
    global DEFAULT_OUTBOX
    DEFAULT_OUTBOX = Outbox(
        schema=schema,
        table=table,
        destinations=tuple(destinations),
        max_payload_bytes=max_payload_bytes,
        mode=mode,
        encryption=encryption,
        seal_headers=seal_headers,
        claim_check=claim_check,
        max_key_locks=max_key_locks,
        key_fetch_timeout=key_fetch_timeout,
    )
    return DEFAULT_OUTBOX


def enqueue(
    conn: Any,
    topic: str,
    payload: object,
    *,
    key: str | None = None,
    headers: Mapping[str, str] | None = None,
    message_id: object = None,
    content_type: str | None = None,
    destinations: Sequence[str] | None = None,
    subject: str | None = None,
) -> Message:
    """Add a message to the default outbox in the caller's transaction (never commits)."""
    return DEFAULT_OUTBOX.enqueue(
        conn,
        topic,
        payload,
        key=key,
        headers=headers,
        message_id=message_id,
        content_type=content_type,
        destinations=destinations,
        subject=subject,
    )


async def enqueue_async(
    conn: Any,
    topic: str,
    payload: object,
    *,
    key: str | None = None,
    headers: Mapping[str, str] | None = None,
    message_id: object = None,
    content_type: str | None = None,
    destinations: Sequence[str] | None = None,
    subject: str | None = None,
) -> Message:
    """Async twin of :func:`enqueue` for asyncpg, psycopg async and SQLAlchemy async."""
    return await DEFAULT_OUTBOX.enqueue_async(
        conn,
        topic,
        payload,
        key=key,
        headers=headers,
        message_id=message_id,
        content_type=content_type,
        destinations=destinations,
        subject=subject,
    )


def enqueue_many(conn: Any, items: Iterable[Mapping[str, Any]]) -> list[Message]:
    return DEFAULT_OUTBOX.enqueue_many(conn, items)


async def enqueue_many_async(conn: Any, items: Iterable[Mapping[str, Any]]) -> list[Message]:
    return await DEFAULT_OUTBOX.enqueue_many_async(conn, items)
