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
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from outboxer.brokers.base import OutcomeKind, Publisher
from outboxer.message import Message, encode_payload, uuid7


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
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for writer in list(self._writers):
            with contextlib.suppress(Exception):
                writer.transport.abort()
        self._writers.clear()

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
    ) -> list[Message]:
        return list(await store.claim("default", relay, limit, lock, abandoned_blocks))

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

    async def test_published_settles_only_for_the_lock_holder(self, url: str, store: Any) -> None:
        self.enqueue(url, ("t", "a"), ("t", "b"))
        first, second = await self.claim(store)
        other = await store.settle("default", "relay-other", [first.stored_seq], [], [], 5)
        assert other.lost == 1 and other.published == 0
        result = await store.settle(
            "default", "relay-a", [first.stored_seq, second.stored_seq], [], [], 5
        )
        assert result.published == 2 and result.lost == 0
        assert [r["status"] for r in self.rows(url)] == ["PUBLISHED", "PUBLISHED"]
        assert {r["locked_by"] for r in self.rows(url)} == {None}
        assert await self.claim(store) == []

    async def test_failure_records_attempt_error_and_backoff(self, url: str, store: Any) -> None:
        from outboxer.stores import Failure

        self.enqueue(url, ("t", "a"))
        [message] = await self.claim(store)
        await store.settle(
            "default", "relay-a", [], [Failure(message.stored_seq, "boom", 30.0, False)], [], 5
        )
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
        first, second = await self.claim(store)
        self.execute(url, f"UPDATE {self.table} SET attempts = 2 WHERE seq = {first.stored_seq}")
        await store.settle(
            "default",
            "relay-a",
            [],
            [
                Failure(first.stored_seq, "again", 0.0, False),
                Failure(second.stored_seq, "too large", 0.0, True),
            ],
            [],
            3,
        )
        rows = self.rows(url)
        assert [(r["status"], r["attempts"]) for r in rows] == [("ABANDONED", 3), ("ABANDONED", 1)]
        assert await self.claim(store) == []

    async def test_release_returns_rows_without_counting_an_attempt(
        self, url: str, store: Any
    ) -> None:
        self.enqueue(url, ("t", "a"))
        [message] = await self.claim(store)
        result = await store.settle("default", "relay-a", [], [], [message.stored_seq], 5)
        assert result.released == 1
        [row] = self.rows(url)
        assert (row["status"], row["attempts"], row["locked_by"]) == ("PENDING", 0, None)
        assert [m.id for m in await self.claim(store, "relay-b")] == [message.id]

    async def test_expired_lock_is_taken_over_and_counted(self, url: str, store: Any) -> None:
        self.enqueue(url, ("t", "a"), ("t", "a"))
        first = await self.claim(store, "relay-dead", lock=30)
        assert len(first) == 2
        assert await self.claim(store, "relay-b") == []
        self.execute(url, self.shift_sql("locked_until", 31))
        taken = await self.claim(store, "relay-b")
        assert [m.id for m in taken] == [m.id for m in first]
        rows = self.rows(url)
        assert {r["locked_by"] for r in rows} == {"relay-b"}
        assert all(r["attempts"] == 1 and "relay-dead" in r["last_error"] for r in rows)
        late = await store.settle("default", "relay-dead", [m.stored_seq for m in first], [], [], 5)
        assert late.lost == 2, "the dead relay's late settle must not touch the new owner's rows"

    async def test_key_waits_for_its_head(self, url: str, store: Any) -> None:
        from outboxer.stores import Failure

        self.enqueue(url, ("t", "k"), ("t", "k"), ("t", "other"), ("t", None))
        head = await self.claim(store, "relay-a", limit=1)
        assert head[0].key == "k"
        rest = await self.claim(store, "relay-b")
        assert [m.key for m in rest] == ["other", None], (
            "k's second row waits while its head is in flight"
        )
        await store.settle(
            "default", "relay-a", [], [Failure(head[0].stored_seq, "down", 60.0, False)], [], 5
        )
        assert await self.claim(store, "relay-c") == [], "k waits while its head backs off"
        self.execute(url, self.shift_sql("next_attempt_at", 61))
        again = await self.claim(store, "relay-c")
        assert [m.stored_seq for m in again] == sorted(m.stored_seq for m in again)
        assert next(m.id for m in again) == head[0].id and len(again) == 2

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
        [head] = await self.claim(store, limit=1)
        await store.settle(
            "default", "relay-a", [], [Failure(head.stored_seq, "rejected", 0.0, True)], [], 5
        )
        assert await self.claim(store, abandoned_blocks=True) == []
        [follower] = await self.claim(store, abandoned_blocks=False)
        assert follower.stored_seq > head.stored_seq

    async def test_cleanup_deletes_old_finished_rows_in_bounded_batches(
        self, url: str, store: Any
    ) -> None:
        from outboxer.stores import Failure

        self.enqueue(url, *[("t", None)] * 5)
        claimed = await self.claim(store)
        await store.settle(
            "default",
            "relay-a",
            [m.stored_seq for m in claimed[:4]],
            [Failure(claimed[4].stored_seq, "x", 0.0, True)],
            [],
            5,
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
        await store.settle(
            "default",
            "relay-a",
            [claimed[0].stored_seq],
            [Failure(claimed[1].stored_seq, "no", 0.0, True)],
            [],
            5,
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
