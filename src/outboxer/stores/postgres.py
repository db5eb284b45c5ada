"""PostgreSQL store for the relay, on asyncpg.

The write path (``outboxer.enqueue``) does not use this class: it runs the same
``insert`` query on the caller's own connection, whatever its driver.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import socket
import uuid
from collections.abc import Awaitable, Sequence
from typing import Any, TypeVar

from outboxer.config import Settings
from outboxer.errors import MissingDependencyError, StoreError
from outboxer.message import Message
from outboxer.redact import get_logger
from outboxer.stores.base import (
    AbandonedRow,
    Claim,
    DestinationStatus,
    Failure,
    Lease,
    SettleResult,
    Store,
    StoreDataError,
    fold_counts,
)
from outboxer.stores.sqlfiles import migrations, queries, render, to_numbered
from outboxer.stores.wakeups import WakeUps

logger = get_logger("outboxer.store")

T = TypeVar("T")


_MIGRATIONS_TABLE = """
CREATE SCHEMA IF NOT EXISTS {schema};
CREATE TABLE IF NOT EXISTS {migrations} (
    version    integer PRIMARY KEY,
    name       text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);
"""


def _asyncpg() -> Any:
    try:
        import asyncpg
    except ImportError as exc:
        raise MissingDependencyError("asyncpg", "postgres") from exc
    return asyncpg


@functools.cache
def _connection_class() -> Any:
    asyncpg = _asyncpg()

    class RelayConnection(asyncpg.Connection):  # type: ignore[misc,name-defined]
        """Skips asyncpg's reset on every release to the pool (a round trip per statement):
        the relay leaves no session state behind, its locks end with its transactions and
        it LISTENs on a connection of its own."""

        def get_reset_query(self) -> str:
            return ""

    return RelayConnection


def asyncpg_dsn(url: str) -> str:
    """asyncpg accepts postgresql:// and postgres:// only."""
    for prefix in ("postgresql+asyncpg://", "postgresql+psycopg://", "postgresql+psycopg2://"):
        if url.startswith(prefix):
            return "postgresql://" + url[len(prefix) :]
    return url


class PostgresStore(Store):
    dialect = "postgres"
    gathers_batches = True  # busy, wait_for_wakeup polls every wakeups.CHASE_POLL seconds
    migrations_table_sql = _MIGRATIONS_TABLE

    def __init__(
        self, url: str, *, schema: str = "outboxer", table: str = "outbox", pool_size: int = 10
    ) -> None:
        super().__init__(url, schema=schema, table=table)
        self.pool_size = pool_size
        self._pool: Any = None
        self._listener: Any = None
        #: When the relay's waiting loops wake (nudges, the chase, the registration's timing).
        self._wakeups = WakeUps()
        #: This store's name among the idle listeners.
        self._listener_name = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        #: The relay's loops share one listening connection: one query on it at a time.
        self._listener_lock = asyncio.Lock()
        self._unregistering: asyncio.Task[None] | None = None
        tokens = self.tokens()
        self._sql: dict[str, tuple[str, tuple[str, ...]]] = {
            name: to_numbered(render(sql, tokens)) for name, sql in queries("postgres").items()
        }

    # ----- connections ---------------------------------------------------------------------

    async def connect(self) -> None:
        if self._pool is not None:
            return
        asyncpg = _asyncpg()
        try:
            self._pool = await asyncpg.create_pool(
                asyncpg_dsn(self.url),
                min_size=1,
                max_size=self.pool_size,
                connection_class=_connection_class(),
                command_timeout=60,
                # The relay's own commits (claim, settle, cleanup) need not wait for the WAL
                # flush: one lost in a crash only makes its rows publish again, in order,
                # which at-least-once allows. The writers' commits, which make the rows exist,
                # keep their own setting; operators' changes ask for a flush (_durably).
                server_settings={"application_name": "outboxer-relay", "synchronous_commit": "off"},
            )
        except (OSError, asyncpg.PostgresError) as exc:
            raise StoreError(f"cannot connect to PostgreSQL: {exc}") from exc

    async def close(self) -> None:
        if self._unregistering is not None:
            await asyncio.gather(self._unregistering, return_exceptions=True)
        if self._listener is not None:
            listener, self._listener = self._listener, None
            if not listener.is_closed():
                sql, args = self._args("unregister_listener", {"relay": self._listener_name})
                with contextlib.suppress(Exception):  # best effort: the row expires anyway
                    await listener.execute(sql, *args)
                await listener.close()
        if self._pool is not None:
            pool, self._pool = self._pool, None
            await pool.close()

    def _args(self, name: str, params: dict[str, Any]) -> tuple[str, list[Any]]:
        sql, names = self._sql[name]
        return sql, [params[n] for n in names]

    # ----- schema --------------------------------------------------------------------------

    async def apply_schema(self) -> list[str]:
        await self.connect()
        tokens = self.tokens()
        applied: list[str] = []
        async with self._pool.acquire() as conn, conn.transaction():
            await _durably(conn)
            # One schema change at a time, whoever runs it.
            await conn.execute("SELECT pg_advisory_xact_lock($1)", self.lock_key("schema"))
            await conn.execute(render(_MIGRATIONS_TABLE, tokens))
            done = {
                row["version"]
                for row in await conn.fetch(f"SELECT version FROM {tokens['migrations']}")
            }
            for migration in migrations("postgres"):
                if migration.version in done:
                    continue
                await conn.execute(render(migration.sql, tokens))
                await conn.execute(
                    f"INSERT INTO {tokens['migrations']} (version, name) VALUES ($1, $2)",
                    migration.version,
                    migration.name,
                )
                applied.append(migration.name)
        return applied

    async def applied_migrations(self) -> set[int]:
        await self.connect()
        table = self.tokens()["migrations"]
        async with self._pool.acquire() as conn:
            if await conn.fetchval("SELECT to_regclass($1)", table) is None:
                return set()
            return {row["version"] for row in await conn.fetch(f"SELECT version FROM {table}")}

    # ----- the relay's statements ----------------------------------------------------------

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
    ) -> Claim:
        lease = Lease.new(relay_id)
        sql, args = self._args(
            "claim",
            {
                "destination": destination,
                "relay_id": relay_id,
                "lease": lease.token,
                "limit": limit,
                "lock_seconds": float(lock_seconds),
                "abandoned_blocks": abandoned_blocks,
                "max_attempts": max_attempts,
                "recover": recover,
                "lock_key": self.lock_key(destination),
            },
        )
        async with self._pool.acquire() as conn:
            rows = await conn.fetch(sql, *args)
        kinds = {row["taken"] for row in rows}
        taken = sorted((row for row in rows if row["taken"] in _TAKEN), key=_by_seq)
        if taken:
            self._wakeups.worked()
            if self._wakeups.registered:
                self._stop_listening()
        return Claim(
            (
                Message(
                    id=row["id"],
                    topic=row["topic"],
                    payload=bytes(row["payload"]),
                    key=row["key"],
                    headers=_headers(row["headers"]),
                    content_type=row["content_type"],
                    destination=row["destination"],
                    created_at=row["created_at"],
                    attempts=row["attempts"],
                    seq=row["seq"],
                )
                for row in taken
            ),
            lease=lease,
            recovered="recovered" in kinds,
            recovery_waiting="recovery_waiting" in kinds,
            abandoned=[
                AbandonedRow(
                    row["id"],
                    row["seq"],
                    row["topic"],
                    row["key"],
                    row["attempts"],
                    row["last_error"],
                )
                for row in sorted((row for row in rows if row["taken"] == "abandoned"), key=_by_seq)
            ],
        )

    async def renew(
        self, destination: str, lease: Lease, seqs: Sequence[int], lock_seconds: float
    ) -> int:
        sql, args = self._args(
            "renew",
            {
                "destination": destination,
                "relay_id": lease.relay_id,
                "lease": lease.token,
                "seqs": list(seqs),
                "lock_seconds": float(lock_seconds),
            },
        )
        async with self._pool.acquire() as conn:
            return int(await _refusing_data(conn.fetchval(sql, *args)))

    async def settle(
        self,
        destination: str,
        lease: Lease,
        published: Sequence[int],
        failed: Sequence[Failure],
        released: Sequence[int],
        max_attempts: int,
    ) -> SettleResult:
        sql, args = self._args(
            "settle",
            {
                "destination": destination,
                "relay_id": lease.relay_id,
                "lease": lease.token,
                "lock_key": self.lock_key(destination),
                "max_attempts": max_attempts,
                "published": list(published),
                "failed": [f.seq for f in failed],
                "errors": [f.error for f in failed],
                "delays": [float(f.delay) for f in failed],
                "permanent": [f.permanent for f in failed],
                "released": list(released),
            },
        )
        async with self._pool.acquire() as conn:
            row = await _refusing_data(conn.fetchrow(sql, *args))
        result = SettleResult(
            published=row["n_published"], failed=row["n_failed"], released=row["n_released"]
        )
        expected = len(published) + len(failed) + len(released)
        result.lost = expected - result.published - result.failed - result.released
        return result

    async def cleanup(self, status: str, retention: float, limit: int) -> int:
        sql, args = self._args(
            "cleanup", {"status": status, "retention": float(retention), "limit": limit}
        )
        async with self._pool.acquire() as conn:
            return _count(await conn.execute(sql, *args))

    async def cleanup_inbox(self, retention: float, limit: int) -> int:
        sql, args = self._args("inbox_cleanup", {"retention": float(retention), "limit": limit})
        async with self._pool.acquire() as conn:
            return _count(await conn.execute(sql, *args))

    # ----- operations ----------------------------------------------------------------------

    async def status(self) -> list[DestinationStatus]:
        sql, args = self._args("counts", {})
        async with self._pool.acquire() as conn:
            rows = await conn.fetch(sql, *args)
        return fold_counts(rows)

    async def ping(self) -> None:
        await self.connect()
        async with self._pool.acquire() as conn:
            await conn.fetchval("SELECT 1")

    async def oldest_transaction(self) -> float:
        """Seconds the oldest open writing transaction has run (it may hold a key's lock)."""
        sql, args = self._args("oldest_transaction", {})
        async with self._pool.acquire() as conn:
            return float(await conn.fetchval(sql, *args) or 0.0)

    async def list_messages(self, statuses: Sequence[str], limit: int) -> list[dict[str, object]]:
        sql, args = self._args("list", {"statuses": list(statuses), "limit": limit})
        async with self._pool.acquire() as conn:
            return [dict(row) for row in await conn.fetch(sql, *args)]

    async def requeue(
        self, destinations: Sequence[str], statuses: Sequence[str], ids: Sequence[str] | None
    ) -> int:
        sql, args = self._args(
            "requeue",
            {
                "destinations": list(destinations),
                "statuses": list(statuses),
                "ids": [uuid.UUID(i) for i in ids] if ids is not None else None,
            },
        )
        lock_sql, _ = self._sql["destination_lock"]
        async with self._pool.acquire() as conn, conn.transaction():
            await _durably(conn)
            for destination in destinations:
                await conn.execute(lock_sql, self.lock_key(destination))
            return _count(await conn.execute(sql, *args))

    # ----- wake-ups ------------------------------------------------------------------------

    def reset_wakeup(self, destination: str) -> None:
        # The claim that follows sees everything committed before this point.
        self._wakeups.reset(destination)

    def nudge(self, destination: str) -> None:
        """Wake one of the destination's waiting loops (a loop that found a full batch)."""
        self._wakeups.nudge(destination)

    async def _ensure_listener(self) -> None:
        if self._listener is not None and not self._listener.is_closed():
            return
        asyncpg = _asyncpg()
        self._listener = await asyncpg.connect(
            asyncpg_dsn(self.url), server_settings={"application_name": "outboxer-relay-listen"}
        )
        await self._listener.add_listener(self.channel, self._on_notify)
        # Anything committed before LISTEN took effect was not announced: look once.
        self._wakeups.nudge_all()

    async def _drop_listener(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None and not listener.is_closed():
            listener.terminate()  # it may be broken: do not wait for a goodbye

    def _on_notify(self, *_: object) -> None:
        # A NOTIFY does not say which destinations the commit wrote rows for.
        self._wakeups.nudge_all()

    async def wait_for_wakeup(self, destination: str, timeout: float) -> bool:
        """Wait for work: by polling while the relay is busy, else for a NOTIFY (or the timeout).

        A NOTIFY holds a cluster-wide lock through the writer's commit, WAL flush included,
        so writers that notify commit one at a time. Writers notify only while a relay is
        registered as idle (migration 0003), and a relay registers only after a quiet spell
        (see stores.wakeups): while busy, one loop of each destination polls, and a claim
        that finds work withdraws the registration. Under a steady stream of writes nobody
        notifies; a trickle is still announced, and a NOTIFY wakes a loop of every
        destination.

        Right after a fresh registration this returns at once, so the relay looks for work
        once more: a writer that committed just before the registration did not notify.
        """
        wakeups = self._wakeups
        wakeups.seen(destination)
        if wakeups.busy:
            return await wakeups.chase(destination, timeout)
        try:
            async with self._listener_lock:
                await self._ensure_listener()
                registered_before = wakeups.registered
                if wakeups.registration_due(timeout):  # renew before it lapses
                    sql, args = self._args(
                        "register_listener",
                        {
                            "relay": self._listener_name,
                            "seconds": wakeups.registration_seconds(timeout),
                        },
                    )
                    await self._listener.execute(sql, *args)
                    wakeups.registered_for(timeout)
            if not registered_before:
                return True
        except Exception as exc:  # noqa: BLE001 -- asyncpg's errors too: poll instead, never stop the relay
            wakeups.withdraw()
            await self._drop_listener()
            logger.warning("cannot LISTEN for wake-ups, polling instead: %s", exc, exc_info=False)
        return await wakeups.wait(destination, timeout)

    def _stop_listening(self) -> None:
        """Withdraw this relay's idle registration (it is busy), in the background."""
        self._wakeups.withdraw()
        if self._unregistering is None or self._unregistering.done():
            self._unregistering = asyncio.get_running_loop().create_task(self._unregister())

    async def _unregister(self) -> None:
        try:
            async with self._listener_lock:
                listener = self._listener
                if listener is None or listener.is_closed() or self._wakeups.registered:
                    return  # no listener, or registered again since
                sql, args = self._args("unregister_listener", {"relay": self._listener_name})
                await listener.execute(sql, *args)
        except Exception as exc:  # noqa: BLE001 -- asyncpg's errors too; the registration lapses anyway
            logger.info("could not withdraw the idle registration (it lapses by itself): %s", exc)


async def _refusing_data(statement: Awaitable[T]) -> T:
    """Await ``statement``; a data error or a violated constraint (SQLSTATE classes 22 and
    23, or an argument asyncpg cannot encode) becomes StoreDataError: no outage, and the
    same statement would fail again."""
    asyncpg = _asyncpg()
    try:
        return await statement
    except (asyncpg.DataError, asyncpg.IntegrityConstraintViolationError) as exc:
        raise StoreDataError(f"PostgreSQL refused the values: {exc}") from exc


async def _durably(conn: Any) -> None:
    """This transaction's commit waits for the WAL flush (the pool's default does not)."""
    await conn.execute("SET LOCAL synchronous_commit = on")


#: What the claim function says it did with the rows it returns that it took.
_TAKEN = ("claimed", "recovered")


def _by_seq(row: Any) -> int:
    return int(row["seq"])


def _headers(text: str) -> dict[str, str]:
    # Most messages carry no headers: skip the JSON parser for them (hot path, once per row).
    return {} if text == "{}" else dict(json.loads(text))


def _count(command_tag: str) -> int:
    """Rows affected, from a command tag like ``UPDATE 12`` or ``DELETE 3``."""
    return int(command_tag.rsplit(" ", 1)[-1])
