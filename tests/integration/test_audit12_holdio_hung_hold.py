"""A consumer's claim-check hold, and its KMS key fetch, are bounded by object_store_timeout.

A hold (ObjectStore.put_hold) is put before the dead letter of a claim-checked message is
written. Before, it had no bound: a store that never answered (a dead NFS mount, an S3
endpoint that accepts and then says nothing) stalled the consumer's lane for ever, and a
hold that failed was counted as a database error and logged as a failed dead-letter write.
Now it is given up after object_store_timeout, in a daemon thread, as a failed hold: the dead
letter is not written, the message is not acked, and it is tried again after a backoff;
counted in claim_check_hold_errors and logged as the store's trouble, in the broker
consumer and the webhook receiver alike. A KMS key fetch that hangs is bounded the same way,
in a daemon thread (asyncio's default executor, which asyncio.run joins at exit, kept a
program from exiting).
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from outboxer.claimcheck import ClaimCheck, FileObjectStore
from outboxer.consumer import Consumer, ConsumerCollector, ConsumerStats, Delivery
from outboxer.crypto import KeyRing, encrypt_message, generate_key
from outboxer.testing import make_message
from tests.integration.test_audit12_ccretain_dead_letter_hold import PAYLOAD, dead_letter_all
from tests.integration.test_consumer_handler_errors import table
from tests.integration.test_http_api import connect_sync
from tests.unit.test_audit12_cctimeout_webhook import _offloaded, _receiver

#: Generous bound for what takes well under a second: only a regression reaches it.
BOUND = 8.0


class HungHoldStore(FileObjectStore):
    """Its first put_hold blocks until ``release`` is set (a store that never answers);
    later ones are put at once."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.release = threading.Event()
        self.calls = 0
        self.daemon: list[bool] = []

    def put_hold(self, name: str, holder: str) -> None:
        self.calls += 1
        self.daemon.append(threading.current_thread().daemon)
        if self.calls == 1:
            self.release.wait(BOUND)
        super().put_hold(name, holder)


def dead_letter_count(url: str) -> int:
    conn = connect_sync(url)
    try:
        cur = conn.cursor()
        cur.execute(f"SELECT count(*) FROM {table(url, 'dead_letters')}")
        return int(cur.fetchone()[0])
    finally:
        conn.close()


@pytest.mark.parametrize("db", ["sqlite_url", "pg_url"])
def test_a_hung_hold_times_out_and_the_dead_letter_waits_for_a_hold(
    db: str, tmp_path: Path, request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture
) -> None:
    url = request.getfixturevalue(db)
    store = HungHoldStore(tmp_path / "claims")
    sent = ClaimCheck(store, threshold=10).offload(make_message("t", PAYLOAD))
    caplog.set_level(logging.WARNING, logger="outboxer")
    started = time.monotonic()
    try:
        # The old code waited in the hung put_hold until release, after BOUND seconds.
        stats: ConsumerStats = dead_letter_all(url, store, [sent], object_store_timeout=0.2)
        elapsed = time.monotonic() - started
    finally:
        store.release.set()
    assert elapsed < BOUND / 2, elapsed
    # The hung hold was given up; the dead letter was written once a second hold was put.
    assert store.calls == 2
    assert (stats.dead_lettered, stats.claim_check_hold_errors, stats.database_errors) == (1, 1, 0)
    assert dead_letter_count(url) == 1
    assert store.held() == {sent.headers["outboxer-claim-check"]}
    assert all(store.daemon), store.daemon  # never a thread the interpreter joins at exit
    logged = [record.getMessage() for record in caplog.records]
    assert any("did not answer within 0.2 s" in line for line in logged), logged
    assert not any("recording message" in line for line in logged), logged


async def test_the_webhook_answers_503_while_the_hold_hangs(
    sqlite_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = HungHoldStore(tmp_path / "objects")
    message, headers = _offloaded(store)
    for stored in store.list_objects():  # missing: the second attempt dead-letters it
        store.delete(stored.name)
    receiver = _receiver(sqlite_url, store, [])  # object_store_timeout=0.2, max_attempts=2
    caplog.set_level(logging.WARNING, logger="outboxer")
    try:
        status, body, _ = await receiver.handle(headers, message.payload)
        assert (status, body.get("attempt")) == (503, 1), body
        # The last attempt needs the hold, which hangs: not dead-lettered, 503, no ack.
        status, body, extra = await asyncio.wait_for(
            receiver.handle(headers, message.payload), BOUND / 2
        )
        assert (status, extra) == (503, {"retry-after": "1"}), body
        assert "HoldTimeoutError" in body["error"], body
        stats = receiver.stats
        assert (stats.claim_check_hold_errors, stats.database_errors) == (1, 0)
        assert stats.dead_lettered == 0
        conn = sqlite3.connect(sqlite_url.removeprefix("sqlite:///"))
        try:
            assert conn.execute("SELECT count(*) FROM dead_letters").fetchone()[0] == 0
        finally:
            conn.close()
        logged = [record.getMessage() for record in caplog.records]
        assert any("not dead-lettered yet" in line for line in logged), logged
        assert not any("database error" in line for line in logged), logged
        # Tried again, the store answers: now the dead letter is written.
        status, body, _ = await receiver.handle(headers, message.payload)
        assert (status, body.get("result")) == (200, "dead-lettered"), body
        assert store.held() == {message.headers["outboxer-claim-check"]}
        families = {f.name: f for f in ConsumerCollector([receiver.consumer]).collect()}
        [sample] = families["outboxer_consumer_claim_check_hold_errors"].samples
        assert sample.value == 1
    finally:
        store.release.set()
        await receiver.close()


def test_a_hung_kms_fetch_is_a_failed_attempt_in_a_daemon_thread(sqlite_url: str) -> None:
    from outboxer.brokers.memory import memory_broker

    writer = KeyRing({"k1": generate_key()})
    sent = encrypt_message(make_message("t", {"n": 1}), writer)
    release = threading.Event()
    daemon: list[bool] = []

    def kms(key_id: str) -> bytes:
        daemon.append(threading.current_thread().daemon)
        release.wait(BOUND)
        return writer.key(key_id)

    broker = f"holdio-{time.monotonic_ns()}"
    memory_broker(broker).clear()
    memory_broker(broker).messages.append(sent)
    seen: list[Delivery] = []

    def keep(delivery: Delivery, conn: Any) -> None:
        seen.append(delivery)

    consumer = Consumer(
        db=sqlite_url,
        broker=f"memory://{broker}",
        group="g",
        handler=keep,
        exit_when_idle=True,
        max_attempts=1,
        keyring=KeyRing(current="k1", resolve=kms),
        object_store_timeout=0.2,
    )
    started = time.monotonic()
    try:
        stats = asyncio.run(consumer.run_async())  # old code: waited BOUND in the fetch
        elapsed = time.monotonic() - started
    finally:
        release.set()
    assert elapsed < BOUND / 2, elapsed
    assert daemon == [True]  # not asyncio's default executor, joined at exit
    assert (stats.failed, stats.dead_lettered, stats.applied) == (1, 1, 0)
    assert seen == []
    assert dead_letter_count(sqlite_url) == 1


class HungReleaseStore(FileObjectStore):
    """Its delete_hold blocks until ``release`` is set."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.release = threading.Event()

    def delete_hold(self, name: str, holder: str) -> None:
        self.release.wait(BOUND)
        super().delete_hold(name, holder)


def test_a_hung_hold_release_does_not_stall_a_replay(
    sqlite_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = HungReleaseStore(tmp_path / "claims")
    sent = ClaimCheck(store, threshold=10).offload(make_message("t", PAYLOAD))
    assert dead_letter_all(sqlite_url, store, [sent]).dead_lettered == 1
    seen: list[Delivery] = []

    def keep(delivery: Delivery, conn: Any) -> None:
        seen.append(delivery)

    replayer = Consumer(
        db=sqlite_url,
        broker=None,
        group="g",
        handler=keep,
        object_store=store,
        object_store_timeout=0.2,
    )
    caplog.set_level(logging.WARNING, logger="outboxer")
    started = time.monotonic()
    try:
        counts = asyncio.run(replayer.replay_dead_letters())  # old code: waited BOUND
        elapsed = time.monotonic() - started
    finally:
        store.release.set()
    assert elapsed < BOUND / 2, elapsed
    assert counts["replayed"] == 1, counts
    assert [d.payload for d in seen] == [PAYLOAD]
    logged = [record.getMessage() for record in caplog.records]
    assert any("releasing the hold" in line and "did not answer" in line for line in logged)
