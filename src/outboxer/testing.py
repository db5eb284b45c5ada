"""Contract suites and test helpers that every adapter passes against its real server.

A broker adapter's test module subclasses :class:`PublisherContract` and fills
in a few methods (how to build a publisher on fresh names, how to consume what
arrived, which message the server rejects, how to restart the server); pytest
then runs every contract test against that adapter.

This module imports pytest, so import it only from tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from outboxer.brokers.base import OutcomeKind, Publisher
from outboxer.message import Message, encode_payload, uuid7
from outboxer.stores.base import Claim, Failure, SettleResult


@dataclass(frozen=True)
class Received:
    """A message as a consumer saw it, in broker-neutral form."""

    id: str
    topic: str
    key: str | None
    headers: dict[str, str]
    payload: bytes


class Consumer(ABC):
    """Reads what a publisher sent to one topic, subscribed before anything is published."""

    @abstractmethod
    async def receive(self, count: int, timeout: float = 10.0) -> list[Received]:
        """Return once ``count`` messages arrived (fewer if the timeout passes)."""

    async def close(self) -> None:
        return None


def make_message(
    topic: str,
    payload: object = None,
    *,
    key: str | None = None,
    headers: dict[str, str] | None = None,
) -> Message:
    body, content_type = encode_payload(payload if payload is not None else {"n": 1})
    return Message(
        id=uuid7(),
        topic=topic,
        payload=body,
        key=key,
        headers=headers or {},
        content_type=content_type,
    )


class PublisherContract(ABC):
    """The promises every Publisher keeps; subclass it once per adapter with a real server."""

    #: Seconds to wait for a consumer to see messages.
    receive_timeout = 15.0

    @abstractmethod
    def make_publisher(self) -> Publisher:
        """A publisher for the real server (not yet connected)."""

    @abstractmethod
    def make_unreachable_publisher(self) -> Publisher:
        """A publisher pointed at an address where nothing listens."""

    @abstractmethod
    async def start_consumer(self, topic: str) -> Consumer:
        """Subscribe to ``topic`` as the broker names it (before publishing).

        The consumer must see only messages published after it started: the
        restart test publishes to the topic before it starts its consumer.
        """

    @abstractmethod
    def rejected_message(self, topic: str) -> Message:
        """A message the server refuses for good (too large, forbidden, …)."""

    async def restart_server(self) -> None:
        """Stop and start the real server (or drop every connection to it)."""
        pytest.skip(f"{type(self).__name__} cannot restart its server")

    def fresh_topic(self) -> str:
        return f"contract.{uuid.uuid4().hex[:12]}"

    # ----- the contract -------------------------------------------------------------------

    async def test_confirmed_batch_arrives_unchanged(self) -> None:
        topic = self.fresh_topic()
        consumer = await self.start_consumer(topic)
        sent = [
            make_message(
                topic, {"order": 1, "text": "zürich ✓"}, key="k-1", headers={"trace": "abc"}
            ),
            make_message(topic, "plain text", key=None, headers={"a": "1", "b": "2"}),
            make_message(topic, b"\x00\x01binary\xff", key="k-2"),
        ]
        async with self.make_publisher() as publisher:
            outcomes = await publisher.publish_batch(sent)
        assert [o.kind for o in outcomes] == [OutcomeKind.PUBLISHED] * 3, outcomes
        received = {r.id: r for r in await consumer.receive(3, self.receive_timeout)}
        await consumer.close()
        assert set(received) == {str(m.id) for m in sent}
        for message in sent:
            got = received[str(message.id)]
            assert got.payload == message.payload
            assert got.key == message.key
            for name, value in message.headers.items():
                assert got.headers.get(name) == value

    async def test_per_key_order_within_and_across_batches(self) -> None:
        topic = self.fresh_topic()
        consumer = await self.start_consumer(topic)
        keys = [f"key-{n}" for n in range(5)]
        batches = [
            [
                make_message(topic, {"key": key, "n": batch * 20 + n}, key=key)
                for n in range(20)
                for key in keys
            ]
            for batch in range(3)
        ]
        async with self.make_publisher() as publisher:
            for batch in batches:
                outcomes = await publisher.publish_batch(batch)
                assert all(o.published for o in outcomes), outcomes
        total = sum(len(b) for b in batches)
        received = await consumer.receive(total, self.receive_timeout)
        await consumer.close()
        assert len(received) == total
        seen: dict[str, list[int]] = {}
        import json

        for item in received:
            body = json.loads(item.payload)
            seen.setdefault(body["key"], []).append(body["n"])
        for key in keys:
            assert seen[key] == sorted(seen[key]), f"order broken for {key}: {seen[key]}"

    async def test_unreachable_server_fails_each_message_retryably(self) -> None:
        topic = self.fresh_topic()
        publisher = self.make_unreachable_publisher()
        publisher.publish_timeout = min(publisher.publish_timeout, 5.0)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(publisher.connect(), 10)
        messages = [make_message(topic, {"n": n}, key=None) for n in range(3)]
        outcomes = await publisher.publish_batch(messages)
        await publisher.close()
        assert len(outcomes) == 3
        for outcome in outcomes:
            assert outcome.kind is OutcomeKind.FAILED
            assert outcome.retryable

    async def test_rejected_message_is_a_permanent_failure(self) -> None:
        topic = self.fresh_topic()
        consumer = await self.start_consumer(topic)
        good = make_message(topic, {"ok": True})
        bad = self.rejected_message(topic)
        async with self.make_publisher() as publisher:
            outcomes = await publisher.publish_batch([bad, good])
        await consumer.close()
        assert outcomes[0].kind is OutcomeKind.FAILED, outcomes
        assert outcomes[0].retryable is False, outcomes[0]
        assert outcomes[1].published, outcomes[1]

    async def test_reconnects_after_server_restart(self) -> None:
        topic = self.fresh_topic()
        publisher = self.make_publisher()
        await publisher.connect()
        try:  # closed whatever happens: a restart_server that skips leaves it connected
            warmup = await self.start_consumer(topic)  # a broker may refuse what nobody consumes
            first = await publisher.publish_batch([make_message(topic, {"n": 0})])
            assert first[0].published, first
            await warmup.close()
            await self.restart_server()
            consumer = await self.start_consumer(topic)
            message = make_message(topic, {"n": 1})
            deadline = time.monotonic() + 60
            outcome = None
            while time.monotonic() < deadline:
                if not publisher.connected:
                    try:
                        await publisher.connect()
                    except Exception:  # noqa: BLE001 -- the server is still restarting
                        await asyncio.sleep(0.5)
                        continue
                [outcome] = await publisher.publish_batch([message])
                if outcome.published:
                    break
                await asyncio.sleep(0.5)
        finally:
            await publisher.close()
        assert outcome is not None and outcome.published, outcome
        received = await consumer.receive(1, self.receive_timeout)
        await consumer.close()
        assert [r.id for r in received] == [str(message.id)]


# ----- a TCP proxy to cut a real server off without stopping it ----------------------------


@dataclass
class TcpProxy:
    """Forwards 127.0.0.1:<port> to a real server; ``cut()`` drops every connection.

    While cut, new connections are refused (the listening socket is closed), as
    when the server is down; ``restore()`` listens again on the same port.
    """

    target_host: str
    target_port: int
    port: int = 0
    _server: asyncio.Server | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    _writers: set[asyncio.StreamWriter] = field(default_factory=set)
    _blackholed: bool = False

    async def blackhole(self) -> None:
        """Keep every connection open but deliver nothing either way, as in a partition."""
        self._blackholed = True

    async def start(self) -> TcpProxy:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._blackholed:  # accept, then say nothing until restore() drops it
            self._writers.add(writer)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError:
            writer.close()
            return
        if self._server is None:  # cut() ran while this connection was being forwarded
            writer.transport.abort()
            up_writer.transport.abort()
            return
        self._writers.update((writer, up_writer))

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    if self._blackholed:
                        continue
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.close()

        for coro in (pump(reader, up_writer), pump(up_reader, writer)):
            task = asyncio.create_task(coro)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def cut(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
        # Dropped before waiting: since Python 3.12.1 wait_closed() returns only once every
        # accepted connection is closed, so waiting first would hang while a client holds one.
        for writer in list(self._writers):
            with contextlib.suppress(Exception):
                writer.transport.abort()
        self._writers.clear()
        if server is not None:
            await server.wait_closed()

    async def restore(self) -> None:
        if self._blackholed:
            # Streams that lost bytes are corrupt: drop them, the client reconnects.
            self._blackholed = False
            for writer in list(self._writers):
                with contextlib.suppress(Exception):
                    writer.transport.abort()
            self._writers.clear()
        if self._server is None:
            await self.start()

    async def stop(self) -> None:
        await self.cut()
        for task in list(self._tasks):
            task.cancel()


async def eventually(
    check: Callable[[], Awaitable[bool]], timeout: float = 15.0, interval: float = 0.05
) -> None:
    """Wait until ``check()`` is true, else fail the test."""
    deadline = time.monotonic() + timeout
    while True:
        if await check():
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(interval)


def ids(messages: Sequence[Message]) -> list[str]:
    return [str(m.id) for m in messages]


# ----- the store contract ------------------------------------------------------------------


class StoreContract(ABC):
    """The state machine every Store keeps; subclass it once per database with a real server.

    A subclass provides the ``url`` fixture (a fresh database with the schema applied),
    ``connect_sync`` (a DB-API connection for the write path and for looking at rows),
    ``table`` (the outbox table's qualified name) and ``shift_sql`` (SQL that moves a
    timestamp column ``seconds`` into the past).
    """

    table = "outbox"

    @abstractmethod
    def connect_sync(self, url: str) -> Any:
        """A DB-API connection (not autocommit) to the database at ``url``."""

    @abstractmethod
    def shift_sql(self, column: str, seconds: float) -> str:
        """An UPDATE moving ``column`` of every row ``seconds`` into the past."""

    def placeholder(self) -> str:
        return "%s"

    def refuse_sql(self, topic: str) -> str:
        """DDL after which the database refuses (a constraint, not an outage) to mark rows of
        ``topic`` PUBLISHED, or to store a ``last_error`` containing ``forbidden text``."""
        pytest.skip(f"{type(self).__name__} cannot make its database refuse a settle")

    # ----- helpers ------------------------------------------------------------------------

    def enqueue(self, url: str, *items: tuple[str, str | None]) -> list[Message]:
        """Commit one message per (topic, key), in one transaction, in order."""
        from outboxer.enqueue import enqueue

        conn = self.connect_sync(url)
        try:
            sent = [enqueue(conn, topic, {"n": n}, key=key) for n, (topic, key) in enumerate(items)]
            conn.commit()
        finally:
            conn.close()
        return sent

    def rows(self, url: str) -> list[dict[str, Any]]:
        conn = self.connect_sync(url)
        try:
            cursor = conn.cursor()
            cursor.execute(
                f"SELECT seq, id, key, status, attempts, last_error, locked_by FROM {self.table} ORDER BY seq"
            )
            names = [d[0] for d in cursor.description]
            return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]
        finally:
            conn.close()

    def execute(self, url: str, sql: str) -> None:
        conn = self.connect_sync(url)
        try:
            conn.cursor().execute(sql)
            conn.commit()
        finally:
            conn.close()

    def hold_row(self, url: str, message: Message) -> Any:
        """A connection holding ``message``'s row locked until it rolls back."""
        conn = self.connect_sync(url)
        conn.cursor().execute(f"SELECT seq FROM {self.table} WHERE id = '{message.id}' FOR UPDATE")
        return conn

    @pytest.fixture
    async def store(self, url: str) -> Any:
        from outboxer.stores import create_store

        store = create_store(url)
        await store.connect()
        yield store
        await store.close()

    async def claim(
        self,
        store: Any,
        relay: str = "relay-a",
        limit: int = 100,
        lock: float = 60.0,
        abandoned_blocks: bool = False,
        max_attempts: int = 5,
    ) -> Claim:
        claim: Claim = await store.claim(
            "default", relay, limit, lock, abandoned_blocks, max_attempts=max_attempts
        )
        return claim

    async def settle(
        self,
        store: Any,
        claim: Claim,
        published: Sequence[int] = (),
        failed: Sequence[Failure] = (),
        released: Sequence[int] = (),
        max_attempts: int = 5,
    ) -> SettleResult:
        """Settle rows of ``claim`` under its lease."""
        result: SettleResult = await store.settle(
            "default", claim.lease, published, failed, released, max_attempts
        )
        return result

    # ----- schema -------------------------------------------------------------------------

    async def test_schema_check_names_the_missing_migration(self, url: str, store: Any) -> None:
        from outboxer.errors import SchemaError
        from outboxer.stores.sqlfiles import migrations

        await store.check_schema()  # fully migrated: silent
        latest = migrations(store.dialect)[-1]
        self.execute(
            url, f"DELETE FROM {store.tokens()['migrations']} WHERE version = {latest.version}"
        )
        with pytest.raises(SchemaError, match=f"{latest.name}.*outboxer schema apply"):
            await store.check_schema()

    # ----- transitions --------------------------------------------------------------------

    async def test_claim_locks_due_rows_in_order_for_one_relay(self, url: str, store: Any) -> None:
        sent = self.enqueue(url, ("t", "a"), ("t", None), ("t", "b"))
        claimed = await self.claim(store, "relay-a")
        assert [m.id for m in claimed] == [m.id for m in sent]
        assert await self.claim(store, "relay-b") == []
        rows = self.rows(url)
        assert {r["status"] for r in rows} == {"PROCESSING"}
        assert {r["locked_by"] for r in rows} == {"relay-a"}

    async def test_published_settles_only_for_the_lease_holder(self, url: str, store: Any) -> None:
        from outboxer.stores import Lease

        self.enqueue(url, ("t", "a"), ("t", "b"))
        claim = await self.claim(store)
        first, second = claim
        for stranger in (Lease("relay-other", claim.lease.token), Lease.new("relay-a")):
            other = await store.settle("default", stranger, [first.stored_seq], [], [], 5)
            assert other.lost == 1 and other.published == 0, stranger
        result = await self.settle(store, claim, [first.stored_seq, second.stored_seq])
        assert result.published == 2 and result.lost == 0
        assert [r["status"] for r in self.rows(url)] == ["PUBLISHED", "PUBLISHED"]
        assert {r["locked_by"] for r in self.rows(url)} == {None}
        assert await self.claim(store) == []

    async def test_failure_records_attempt_error_and_backoff(self, url: str, store: Any) -> None:
        from outboxer.stores import Failure

        self.enqueue(url, ("t", "a"))
        claim = await self.claim(store)
        [message] = claim
        await self.settle(store, claim, failed=[Failure(message.stored_seq, "boom", 30.0, False)])
        [row] = self.rows(url)
        assert (row["status"], row["attempts"], row["last_error"]) == ("FAILED", 1, "boom")
        assert await self.claim(store) == [], "not due before its backoff"
        self.execute(url, self.shift_sql("next_attempt_at", 31))
        [again] = await self.claim(store)
        assert again.id == message.id and again.attempts == 1

    async def test_attempts_used_up_or_permanent_failure_abandons(
        self, url: str, store: Any
    ) -> None:
        from outboxer.stores import Failure

        self.enqueue(url, ("t", "a"), ("t", "b"))
        claim = await self.claim(store)
        first, second = claim
        self.execute(url, f"UPDATE {self.table} SET attempts = 2 WHERE seq = {first.stored_seq}")
        await self.settle(
            store,
            claim,
            failed=[
                Failure(first.stored_seq, "again", 0.0, False),
                Failure(second.stored_seq, "too large", 0.0, True),
            ],
            max_attempts=3,
        )
        rows = self.rows(url)
        assert [(r["status"], r["attempts"]) for r in rows] == [("ABANDONED", 3), ("ABANDONED", 1)]
        assert await self.claim(store) == []

    async def test_any_error_text_settles_and_reads_back_storable(
        self, url: str, store: Any
    ) -> None:
        """A broker's error may hold anything: a NUL (PostgreSQL refuses it in text), lone
        surrogates (no driver encodes them), bytes that are no UTF-8, a megabyte of body.
        Each is recorded, bounded and readable, and the row leaves PROCESSING."""
        from outboxer.stores import Failure
        from outboxer.stores.base import MAX_ERROR_LENGTH, storable_error

        raw = b"\xff\xfe body \x00 \xc3("
        errors = [
            "HTTP 500: \x00\x00 nul bytes \x00",
            "lone \ud800 surrogate \udfff",
            raw.decode("utf-8", "replace"),
            raw.decode("utf-8", "surrogateescape"),
            "x" * 1_000_000,
        ]
        self.enqueue(url, *[("t", None)] * len(errors))
        claimed = await self.claim(store)
        result = await self.settle(
            store,
            claimed,
            failed=[
                Failure(m.stored_seq, e, 30.0, False) for m, e in zip(claimed, errors, strict=True)
            ],
        )
        assert result.failed == len(errors)
        rows = self.rows(url)
        assert [(r["status"], r["attempts"]) for r in rows] == [("FAILED", 1)] * len(errors)
        for row, error in zip(rows, errors, strict=True):
            stored = row["last_error"]
            assert stored == storable_error(error)
            assert "\x00" not in stored and len(stored) <= MAX_ERROR_LENGTH
            stored.encode("utf-8")  # valid UTF-8: no lone surrogate left
        assert rows[0]["last_error"] == "HTTP 500: \ufffd\ufffd nul bytes \ufffd"
        assert rows[-1]["last_error"].endswith("[cut: 1000000 characters in all]")

    async def test_a_settle_the_database_refuses_raises_store_data_error(
        self, url: str, store: Any
    ) -> None:
        """Refused values are no outage: the relay must learn it cannot retry them as they are."""
        from outboxer.stores import Failure, StoreDataError

        self.execute(url, self.refuse_sql("stuck"))
        self.enqueue(url, ("stuck", None), ("t", None))
        claim = await self.claim(store)
        stuck, fine = claim
        with pytest.raises(StoreDataError):
            await self.settle(store, claim, [stuck.stored_seq, fine.stored_seq])
        with pytest.raises(StoreDataError):
            await self.settle(
                store, claim, failed=[Failure(fine.stored_seq, "forbidden text", 1.0, False)]
            )
        assert [r["status"] for r in self.rows(url)] == ["PROCESSING"] * 2, "nothing half-written"
        result = await self.settle(store, claim, [fine.stored_seq])
        assert result.published == 1, "only those values were refused: the store goes on"

    async def test_release_returns_rows_without_counting_an_attempt(
        self, url: str, store: Any
    ) -> None:
        self.enqueue(url, ("t", "a"))
        claim = await self.claim(store)
        [message] = claim
        result = await self.settle(store, claim, released=[message.stored_seq])
        assert result.released == 1
        [row] = self.rows(url)
        assert (row["status"], row["attempts"], row["locked_by"]) == ("PENDING", 0, None)
        assert [m.id for m in await self.claim(store, "relay-b")] == [message.id]

    async def test_expired_lease_is_taken_over_alone_and_counted(
        self, url: str, store: Any
    ) -> None:
        """The rows of a relay that died are taken over one a claim, in seq order: a message
        that kills its relay dies alone. A late settle of the dead holder changes nothing."""
        first, second, other = self.enqueue(url, ("t", "a"), ("t", "a"), ("t", None))
        dead = await self.claim(store, "relay-dead", lock=30)
        assert len(dead) == 3 and not dead.recovered
        assert await self.claim(store, "relay-b") == []
        self.execute(url, self.shift_sql("locked_until", 31))
        taken = await self.claim(store, "relay-b")
        assert [m.id for m in taken] == [first.id] and taken.recovered
        assert taken[0].attempts == 1
        again = await self.claim(store, "relay-c")
        assert [m.id for m in again] == [other.id], "a's second row waits for its first"
        await self.settle(store, taken, [taken[0].stored_seq])
        last = await self.claim(store, "relay-c")
        assert [m.id for m in last] == [second.id] and last.recovered, "a's first is done"
        late = await self.settle(store, dead, [m.stored_seq for m in dead])
        assert late.lost == 3 and late.published == 0, "the dead holder's late settle"
        rows = self.rows(url)
        assert [r["status"] for r in rows] == ["PUBLISHED", "PROCESSING", "PROCESSING"]
        assert [r["attempts"] for r in rows] == [1, 1, 1]
        assert "relay relay-dead died or stalled while publishing" in rows[1]["last_error"]
        assert [r["locked_by"] for r in rows] == [None, "relay-c", "relay-c"]

    async def test_a_claim_that_may_not_recover_takes_nothing_and_says_a_row_waits(
        self, url: str, store: Any
    ) -> None:
        """A relay holding other rows may not take over an expired lease (they would die with
        it): its claim takes nothing at all, and says why, so the relay drains first."""
        expired, _ = self.enqueue(url, ("t", "a"), ("t", "b"))
        await self.claim(store, "relay-dead", lock=30, limit=1)
        self.execute(url, self.shift_sql("locked_until", 31))
        busy = await store.claim("default", "relay-b", 100, 60.0, False, recover=False)
        assert busy == [] and busy.recovery_waiting and not busy.recovered
        idle = await store.claim("default", "relay-b", 100, 60.0, False, recover=True)
        assert [m.id for m in idle] == [expired.id] and idle.recovered
        assert not idle.recovery_waiting
        ordinary = await store.claim("default", "relay-b", 100, 60.0, False, recover=False)
        assert len(ordinary) == 1 and not ordinary.recovery_waiting, "nothing else expired"

    async def test_a_takeover_at_max_attempts_abandons(self, url: str, store: Any) -> None:
        """A message whose relay died on its last attempt is abandoned, not taken over again;
        the rest of its key follows abandoned_blocks."""
        poison, follower = self.enqueue(url, ("t", "k"), ("t", "k"))
        self.execute(url, f"UPDATE {self.table} SET attempts = 2")
        await self.claim(store, "relay-dead", lock=30)
        self.execute(url, self.shift_sql("locked_until", 31))
        held_back = await self.claim(store, "relay-b", max_attempts=3, abandoned_blocks=True)
        assert held_back == [] and [a.id for a in held_back.abandoned] == [poison.id, follower.id]
        abandoned = held_back.abandoned[0]
        assert abandoned.attempts == 3
        assert "abandoned after 3 attempts: relay relay-dead died or stalled" in abandoned.error
        rows = self.rows(url)
        assert [(r["status"], r["attempts"]) for r in rows] == [("ABANDONED", 3)] * 2
        assert rows[0]["last_error"] == abandoned.error and rows[0]["locked_by"] is None

    async def test_after_a_takeover_abandons_the_key_follows_abandoned_blocks(
        self, url: str, store: Any
    ) -> None:
        poison, follower = self.enqueue(url, ("t", "k"), ("t", "k"))
        claim = await self.claim(store, "relay-dead", lock=30, limit=1)
        assert [m.id for m in claim] == [poison.id]
        self.execute(url, self.shift_sql("locked_until", 31))
        held_back = await self.claim(store, "relay-b", max_attempts=1, abandoned_blocks=True)
        assert held_back == [] and [a.id for a in held_back.abandoned] == [poison.id]
        assert await self.claim(store, "relay-b", max_attempts=1, abandoned_blocks=True) == []
        claimed = await self.claim(store, "relay-b", max_attempts=1)
        assert [m.id for m in claimed] == [follower.id], "abandoned_blocks false: k goes on"

    async def test_renewal_extends_the_lease_and_a_stale_lease_changes_nothing(
        self, url: str, store: Any
    ) -> None:
        """Renewal keeps a slow batch from being taken over; a holder whose lease was taken
        over, even by another claim of the same relay (same relay_id), can neither renew nor
        settle those rows."""
        self.enqueue(url, ("t", "k"), ("t", None))
        slow = await self.claim(store, "relay-a", lock=30)
        seqs = [m.stored_seq for m in slow]
        self.execute(url, self.shift_sql("locked_until", 29))  # one second of the lease left
        assert await store.renew("default", slow.lease, seqs, 30) == 2
        self.execute(url, self.shift_sql("locked_until", 2))
        assert await self.claim(store, "relay-a") == [], "renewed: not taken over"
        self.execute(url, self.shift_sql("locked_until", 31))
        taken = await self.claim(store, "relay-a")  # another loop of the same relay
        assert taken.recovered and [m.stored_seq for m in taken] == seqs[:1]
        assert await store.renew("default", slow.lease, seqs, 30) == 1, "only the row not taken"
        late = await self.settle(store, slow, published=seqs)
        assert late.published == 1 and late.lost == 1
        [row] = [r for r in self.rows(url) if r["status"] == "PROCESSING"]
        assert row["seq"] == seqs[0] and row["attempts"] == 1, "the new holder's row, untouched"
        assert await store.renew("default", taken.lease, seqs[:1], 30) == 1
        assert (await self.settle(store, taken, released=seqs[:1])).released == 1

    async def test_key_waits_for_its_head(self, url: str, store: Any) -> None:
        from outboxer.stores import Failure

        self.enqueue(url, ("t", "k"), ("t", "k"), ("t", "other"), ("t", None))
        head = await self.claim(store, "relay-a", limit=1)
        assert head[0].key == "k"
        rest = await self.claim(store, "relay-b")
        assert [m.key for m in rest] == ["other", None], (
            "k's second row waits while its head is in flight"
        )
        await self.settle(store, head, failed=[Failure(head[0].stored_seq, "down", 60.0, False)])
        assert await self.claim(store, "relay-c") == [], "k waits while its head backs off"
        self.execute(url, self.shift_sql("next_attempt_at", 61))
        again = await self.claim(store, "relay-c")
        assert [m.stored_seq for m in again] == sorted(m.stored_seq for m in again)
        assert next(m.id for m in again) == head[0].id and len(again) == 2

    async def test_a_row_that_does_not_read_as_a_message_is_abandoned_not_its_batch(
        self, url: str, store: Any
    ) -> None:
        """A hand-written row whose headers are not a JSON object of strings: the claim
        abandons it (its error says why) and hands out the rest of its batch, instead of
        failing as if the database were down and leaving the batch PROCESSING."""
        bad, good, keyless = self.enqueue(url, ("t", "k1"), ("t", "k2"), ("t", None))
        self.execute(url, f"UPDATE {self.table} SET headers = '[1, 2]' WHERE id = '{bad.id}'")
        claimed = await self.claim(store, "relay-a")
        assert [m.id for m in claimed] == [good.id, keyless.id]
        [abandoned] = claimed.abandoned
        assert abandoned.id == bad.id and abandoned.key == "k1"
        assert "unreadable row" in abandoned.error and "JSON object" in abandoned.error
        by_id = {str(row["id"]): row for row in self.rows(url)}
        assert by_id[str(bad.id)]["status"] == "ABANDONED"
        assert "unreadable row" in by_id[str(bad.id)]["last_error"]
        assert {by_id[str(m.id)]["status"] for m in claimed} == {"PROCESSING"}

    async def test_an_earlier_row_not_yet_due_holds_back_its_key(
        self, url: str, store: Any
    ) -> None:
        """A PENDING row whose next_attempt_at lies ahead (released by a settle that read a
        later clock, or written before the clock stepped back) keeps its key's later rows
        waiting: key order must not rest on every relay's clock agreeing."""
        [first] = self.enqueue(url, ("t", "k"))
        self.execute(url, self.shift_sql("next_attempt_at", -30))  # due in 30 s
        later, other = self.enqueue(url, ("t", "k"), ("t", "other"))
        claimed = await self.claim(store, "relay-a")
        assert [m.id for m in claimed] == [other.id], "k's later row waits for its first"
        self.execute(url, self.shift_sql("next_attempt_at", 31))
        again = await self.claim(store, "relay-b")
        assert [m.id for m in again] == [first.id, later.id]

    async def test_a_key_never_overtakes_a_row_another_transaction_holds(
        self, url: str, store: Any
    ) -> None:
        # SKIP LOCKED passes over a committed row that someone else holds locked (a manual
        # SELECT ... FOR UPDATE; on MySQL also a row committed while the claim ran).
        first, later, other = self.enqueue(url, ("t", "k"), ("t", "k"), ("t", "other"))
        holder = self.hold_row(url, first)
        try:
            claimed = await self.claim(store, "relay-a")
            assert [m.id for m in claimed] == [other.id], "k's later row waits for its first"
        finally:
            holder.rollback()
            holder.close()
        claimed = await self.claim(store, "relay-b")
        assert [m.id for m in claimed] == [first.id, later.id]

    async def test_abandoned_head_blocks_its_key_only_when_configured(
        self, url: str, store: Any
    ) -> None:
        from outboxer.stores import Failure

        self.enqueue(url, ("t", "k"), ("t", "k"))
        claim = await self.claim(store, limit=1)
        [head] = claim
        await self.settle(store, claim, failed=[Failure(head.stored_seq, "rejected", 0.0, True)])
        assert await self.claim(store, abandoned_blocks=True) == []
        [follower] = await self.claim(store, abandoned_blocks=False)
        assert follower.stored_seq > head.stored_seq

    async def test_cleanup_deletes_old_finished_rows_in_bounded_batches(
        self, url: str, store: Any
    ) -> None:
        from outboxer.stores import Failure

        self.enqueue(url, *[("t", None)] * 5)
        claimed = await self.claim(store)
        await self.settle(
            store,
            claimed,
            [m.stored_seq for m in claimed[:4]],
            [Failure(claimed[4].stored_seq, "x", 0.0, True)],
        )
        assert await store.cleanup("PUBLISHED", 3600, 10) == 0, "too young"
        self.execute(url, self.shift_sql("updated_at", 7200))
        assert await store.cleanup("PUBLISHED", 3600, 3) == 3
        assert await store.cleanup("PUBLISHED", 3600, 3) == 1
        assert [r["status"] for r in self.rows(url)] == ["ABANDONED"]
        assert await store.cleanup("ABANDONED", 3600, 3) == 1
        assert self.rows(url) == []

    async def test_requeue_and_status(self, url: str, store: Any) -> None:
        from outboxer.stores import Failure

        sent = self.enqueue(url, ("t", "a"), ("t", "b"), ("t", "c"))
        claimed = await self.claim(store, limit=2)
        await self.settle(
            store,
            claimed,
            [claimed[0].stored_seq],
            [Failure(claimed[1].stored_seq, "no", 0.0, True)],
        )
        [report] = await store.status()
        assert report.counts == {"PUBLISHED": 1, "ABANDONED": 1, "PENDING": 1}
        assert report.retried == 1 and report.oldest_pending_age is not None
        listed = await store.list_messages(["ABANDONED"], 10)
        assert [str(r["id"]) for r in listed] == [str(sent[1].id)]
        assert await store.requeue(["default"], ["ABANDONED"], [str(sent[1].id)]) == 1
        [row] = [r for r in self.rows(url) if str(r["id"]) == str(sent[1].id)]
        assert (row["status"], row["attempts"]) == ("PENDING", 0)

    async def test_ping_and_status_report(self, url: str, store: Any) -> None:
        from outboxer.enqueue import enqueue
        from outboxer.stores.base import Store

        await store.ping()
        self.enqueue(url, ("t", None))
        self.execute(url, self.shift_sql("created_at", 90))
        report = await store.status_report()
        [entry] = report["destinations"]
        assert entry["destination"] == "default" and entry["counts"] == {"PENDING": 1}
        age = entry["oldest_pending_age_seconds"]
        assert 90 <= age < 90 + 60, f"the pending row was enqueued 90 s ago, not {age} s"
        reports_transactions = type(store).oldest_transaction is not Store.oldest_transaction
        assert report["oldest_transaction_age_seconds"] == (0 if reports_transactions else None)
        if not reports_transactions:
            return
        writer = self.connect_sync(url)  # a writing transaction left open for a while
        try:
            enqueue(writer, "t", {"n": 2})
            await asyncio.sleep(1.5)
            lag = (await store.status_report())["oldest_transaction_age_seconds"]
            assert 1.5 <= lag < 60, f"a writer open for 1.5 s, reported as {lag} s"
        finally:
            writer.rollback()
            writer.close()

    async def test_status_counts_unfinished_rows_exactly_beside_an_estimate(
        self, url: str, store: Any
    ) -> None:
        # Told that any table is big, a store estimates its PUBLISHED rows where it can; the
        # unfinished and ABANDONED rows, the retries and the oldest age stay exact.
        store.exact_status_rows = 0
        self.enqueue(url, *[("t", f"k{n}") for n in range(12)])
        claimed = await self.claim(store, limit=11)
        seqs = [m.stored_seq for m in claimed]
        await self.settle(
            store,
            claimed,
            seqs[:8],
            [Failure(seqs[8], "later", 60.0, False), Failure(seqs[9], "never", 0.0, True)],
        )  # seqs[10] stays in flight, the twelfth row PENDING

        def exact(report: Any) -> dict[str, int]:
            return {s: n for s, n in report.counts.items() if s != "PUBLISHED"}

        [report] = await store.status()
        assert exact(report) == {"PENDING": 1, "PROCESSING": 1, "FAILED": 1, "ABANDONED": 1}
        assert report.retried == 2 and report.oldest_pending_age is not None
        # Exact, or flagged as an estimate (of 12 seqs, a store may look at every one).
        assert report.counts.get("PUBLISHED") == 8 or report.published_estimated
        [entry] = (await store.status_report())["destinations"]
        assert entry["published_estimated"] is report.published_estimated

        self.enqueue(url, ("t", "k12"), ("t", "k13"))
        await self.settle(store, claimed, [seqs[10]])
        [report] = await store.status()
        assert exact(report) == {"PENDING": 3, "FAILED": 1, "ABANDONED": 1}
        assert report.counts.get("PUBLISHED") == 9 or report.published_estimated

    async def test_list_messages_newest_change_first(self, url: str, store: Any) -> None:
        sent = self.enqueue(url, *[("t", f"k{n}") for n in range(4)])
        claimed = await self.claim(store, limit=2)
        await self.settle(
            store, claimed, failed=[Failure(m.stored_seq, "no", 0.0, True) for m in claimed]
        )

        def ids(rows: Sequence[Mapping[str, Any]]) -> list[str]:
            return [str(row["id"]) for row in rows]

        # The ABANDONED rows changed last; rows changed at the same moment: the later seq first.
        newest = [str(sent[n].id) for n in (1, 0, 3, 2)]
        assert ids(await store.list_messages(["ABANDONED", "PENDING"], 10)) == newest
        assert ids(await store.list_messages(["PENDING", "ABANDONED"], 3)) == newest[:3]
        assert ids(await store.list_messages(["PENDING"], 1)) == newest[2:3]
        assert await store.list_messages(["PUBLISHED", "FAILED"], 10) == []
        # Every store gives the same types: a UUID, and aware UTC datetimes (None if unset).
        for row in await store.list_messages(["ABANDONED", "PENDING"], 10):
            assert isinstance(row["id"], uuid.UUID), row
            assert row["published_at"] is None, row
            for column in ("created_at", "updated_at", "next_attempt_at"):
                when = row[column]
                assert isinstance(when, datetime) and when.utcoffset() == timedelta(0), row
                assert abs((datetime.now(UTC) - when).total_seconds()) < 300, row
        await asyncio.sleep(0.01)  # a later clock reading than the settle's
        assert await store.requeue(["default"], ["ABANDONED"], [str(sent[0].id)]) == 1
        assert ids(await store.list_messages(["PENDING", "ABANDONED"], 2)) == [
            str(sent[0].id),
            str(sent[1].id),
        ]

    async def test_rollback_leaves_nothing(self, url: str, store: Any) -> None:
        from outboxer.enqueue import enqueue

        conn = self.connect_sync(url)
        enqueue(conn, "t", {"n": 1}, key="a")
        conn.rollback()
        conn.close()
        assert self.rows(url) == []
        assert await self.claim(store) == []

    async def test_a_commit_wakes_a_waiting_loop_of_every_destination(
        self, url: str, store: Any
    ) -> None:
        """A commit with rows for two destinations wakes a waiting loop of each: a wake-up
        taken by one destination's loop must not leave the other's asleep until its poll
        interval."""
        from outboxer.enqueue import Outbox

        destinations = ("internal", "partner")
        for destination in destinations:  # settle: a first wait may report a first look
            store.reset_wakeup(destination)
            for _ in range(5):
                if not await store.wait_for_wakeup(destination, 0.05):
                    break
        waiting = [
            asyncio.create_task(store.wait_for_wakeup(destination, 20))
            for destination in destinations
        ]
        await asyncio.sleep(0.3)
        conn = self.connect_sync(url)
        try:
            Outbox(destinations=destinations).enqueue(conn, "t", {"n": 1})
            conn.commit()
        finally:
            conn.close()
        started = time.monotonic()
        try:
            woken = await asyncio.wait_for(asyncio.gather(*waiting), 10)
        finally:
            for task in waiting:
                task.cancel()
        assert woken == [True, True]
        assert time.monotonic() - started < 3, "woken by the commit, long before the 20 s timeout"
