"""A claim-check read that times out in the webhook receiver is a failed attempt of the
message, as ``outboxer consume`` counts it: retried after the backoff (``Retry-After``), a
dead letter after ``max_attempts``, reported as the store's trouble (its own log line and
counter), not the database's. Before, it was a "database error" 503 for ever: the relay
retried it without limit and it was never dead-lettered. A missing object stays distinct
from a timeout (its own counter and message)."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest

from outboxer.brokers.memory import memory_broker
from outboxer.brokers.webhook import WebhookPublisher
from outboxer.claimcheck import ClaimCheck, FileObjectStore
from outboxer.consumer import Consumer, ConsumerCollector, Delivery
from outboxer.message import Message
from outboxer.receivers.memory import group_state
from outboxer.receivers.webhook import WebhookReceiver
from outboxer.retry import Backoff
from outboxer.testing import make_message

#: Generous bound for what takes well under a second: only a regression reaches it.
BOUND = 20.0


class HangingStore(FileObjectStore):
    """Its reads block until ``release`` is set (a dead NFS server's never answer)."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.release = threading.Event()

    def get(self, name: str) -> bytes:
        self.release.wait(BOUND)
        return super().get(name)

    def get_at_most(self, name: str, max_size: int) -> bytes:
        self.release.wait(BOUND)
        return super().get_at_most(name, max_size)


def _offloaded(store: FileObjectStore) -> tuple[Message, dict[str, str]]:
    message = ClaimCheck(store, threshold=10).offload(
        make_message("t", {"n": 1, "x": "y" * 50}, key="k1")
    )
    headers = {
        name.lower(): value
        for name, value in WebhookPublisher("http://127.0.0.1:9/").request_headers(message).items()
    }
    return message, headers


def _receiver(url: str, store: FileObjectStore, seen: list[Any]) -> WebhookReceiver:
    def handler(delivery: Delivery, conn: Any) -> None:
        seen.append(delivery.payload)

    return WebhookReceiver(
        db=url,
        group="hooks",
        handler=handler,
        secret=None,
        object_store=store,
        object_store_timeout=0.2,
        max_attempts=2,
        backoff=Backoff(base=3, multiplier=1, cap=3, jitter=0),
    )


def _dead_letters(url: str) -> list[tuple[str, int, str]]:
    conn = sqlite3.connect(url.removeprefix("sqlite:///"))
    try:
        return conn.execute("SELECT message_id, attempts, error FROM dead_letters").fetchall()
    finally:
        conn.close()


async def test_a_hung_store_is_a_failed_attempt_then_a_dead_letter(
    sqlite_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = HangingStore(tmp_path / "objects")
    message, headers = _offloaded(store)
    seen: list[Any] = []
    receiver = _receiver(sqlite_url, store, seen)
    caplog.set_level(logging.WARNING, logger="outboxer.consumer.webhook")
    try:
        status, body, extra = await receiver.handle(headers, message.payload)
        assert (status, body.get("attempt"), extra) == (503, 1, {"retry-after": "3"}), body
        assert "ObjectReadTimeoutError" in body["error"], body
        stats = receiver.stats
        assert (stats.database_errors, stats.failed, stats.claim_check_timeouts) == (0, 1, 1)
        assert stats.claim_check_missing == 0
        logged = [record.getMessage() for record in caplog.records]
        assert not any("database error" in line for line in logged), logged
        assert any("claim-check store did not answer" in line for line in logged), logged
        # The second attempt is the last (max_attempts=2): a dead letter, acknowledged.
        status, body, extra = await receiver.handle(headers, message.payload)
        assert (status, body.get("result")) == (200, "dead-lettered"), body
        assert (stats.database_errors, stats.failed, stats.dead_lettered) == (0, 2, 1)
        [(message_id, attempts, error)] = _dead_letters(sqlite_url)
        assert (message_id, attempts) == (str(message.id), 2)
        assert "ObjectReadTimeoutError" in error
        assert seen == []
        # The dead letter holds its object: retention's sweep keeps it for a replay.
        assert store.held() == {message.headers["outboxer-claim-check"]}
    finally:
        store.release.set()
        await receiver.close()


async def test_a_missing_object_is_a_failed_attempt_of_its_own_kind(
    sqlite_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = FileObjectStore(tmp_path / "objects")
    message, headers = _offloaded(store)
    for stored in store.list_objects():
        store.delete(stored.name)
    seen: list[Any] = []
    receiver = _receiver(sqlite_url, store, seen)
    caplog.set_level(logging.WARNING, logger="outboxer.consumer.webhook")
    try:
        status, body, extra = await receiver.handle(headers, message.payload)
        assert (status, body.get("attempt"), extra) == (503, 1, {"retry-after": "3"}), body
        assert "ObjectNotFoundError" in body["error"], body
        stats = receiver.stats
        assert (stats.database_errors, stats.failed, stats.claim_check_missing) == (0, 1, 1)
        assert stats.claim_check_timeouts == 0
        logged = [record.getMessage() for record in caplog.records]
        assert any("claim-check object is missing" in line for line in logged), logged
        status, body, _ = await receiver.handle(headers, message.payload)
        assert (status, body.get("result")) == (200, "dead-lettered"), body
        assert [row[:2] for row in _dead_letters(sqlite_url)] == [(str(message.id), 2)]
    finally:
        await receiver.close()


async def test_consume_counts_the_same_timeout_the_same_way(
    sqlite_url: str, tmp_path: Path
) -> None:
    """`outboxer consume` (the broker consumer): a failed attempt, then a dead letter, with
    the timeout counter and its metric; no database error."""
    store = HangingStore(tmp_path / "objects")
    message, _ = _offloaded(store)
    broker = f"cctimeout-{uuid.uuid4().hex[:8]}"
    memory_broker(broker).clear()
    memory_broker(broker).messages.append(message)
    consumer = Consumer(
        db=sqlite_url,
        broker=f"memory://{broker}",
        group="g",
        handler=lambda delivery, conn: None,
        concurrency=1,
        max_attempts=2,
        backoff=Backoff(base=0.05, multiplier=1, cap=0.05, jitter=0),
        object_store=store,
        object_store_timeout=0.2,
    )
    running = asyncio.create_task(consumer.run_async())
    loop = asyncio.get_running_loop()
    deadline = loop.time() + BOUND
    try:
        while group_state(broker, "g").acked != {0}:
            assert loop.time() < deadline and not running.done(), consumer.stats
            await asyncio.sleep(0.02)
    finally:
        consumer.stop()
        store.release.set()
        stats = await running
    assert (stats.failed, stats.dead_lettered, stats.database_errors) == (2, 1, 0)
    assert (stats.claim_check_timeouts, stats.claim_check_missing) == (2, 0)
    families = {family.name: family for family in ConsumerCollector([consumer]).collect()}
    [sample] = families["outboxer_consumer_claim_check_timeouts"].samples
    assert sample.value == 2
