"""The write path's key fetch: ``Outbox(encryption=KeyRing.from_callable(...))`` gets the
ring's current key at its first use through ``crypto.fetch_key_bounded_sync`` (``enqueue``)
or ``crypto.fetch_key_bounded`` (``enqueue_async``, off the event loop), within
``Outbox.key_fetch_timeout``, before any SQL. Before, the encryption called the KMS on the
caller's thread with no bound: a silent KMS held the application's request, inside its open
transaction, for ever (and the event loop with it, in ``enqueue_async``).
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import math
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from outboxer import Outbox, crypto
from outboxer.crypto import (
    MAX_ABANDONED_FETCHES,
    EncryptionError,
    EnqueueKeyUnavailableError,
    KeyRing,
    KeyRingUnavailableError,
    decrypt,
)
from outboxer.errors import ConfigError, OutboxerError
from outboxer.payload_relay import KEY_FETCH_TIMEOUT
from outboxer.stores.sqlite import sqlite_path
from tests.waiting import wait_for, within

BOUND = 0.3
SLACK = 1.0
KEY = os.urandom(32)
#: The module (``outboxer.enqueue`` is also the package's function of that name).
ENQUEUE: Any = importlib.import_module("outboxer.enqueue")


class SilentKms:
    """A key source whose calls wait for ``answer`` (set at the test's end), then return the
    key, or raise ``error`` at once when it is set."""

    def __init__(self) -> None:
        self.answer = threading.Event()
        self.error: Exception | None = None
        self.calls: list[str] = []
        #: The name of the thread each call ran in.
        self.threads: list[str] = []
        self._lock = threading.Lock()

    def __call__(self, key_id: str) -> bytes:
        with self._lock:
            self.calls.append(key_id)
            self.threads.append(threading.current_thread().name)
        if self.error is not None:
            raise self.error
        self.answer.wait(30)
        return KEY

    def outbox(self, bound: float = BOUND) -> Outbox:
        return Outbox(encryption=KeyRing.from_callable(self, "k2"), key_fetch_timeout=bound)


def fetch_threads() -> int:
    return sum(1 for thread in threading.enumerate() if thread.name == "outboxer-key-fetch")


@pytest.fixture
def kms() -> Iterator[SilentKms]:
    source = SilentKms()
    try:
        yield source
    finally:
        source.answer.set()
        wait_for(lambda: fetch_threads() == 0, 5, "key fetch threads did not end")


@pytest.fixture
def conn(sqlite_url: str) -> Iterator[sqlite3.Connection]:
    """The application's connection (used from the test's helper threads too)."""
    connection = sqlite3.connect(sqlite_path(sqlite_url), check_same_thread=False)
    try:
        yield connection
    finally:
        connection.close()


def rows(conn: sqlite3.Connection) -> list[tuple[str, str]]:
    return list(conn.execute("SELECT topic, headers FROM outbox ORDER BY seq"))


@pytest.mark.parametrize("bound", [0, -1, math.nan, math.inf, 1e300, True, "30", None])
def test_key_fetch_timeout_is_refused_unless_a_positive_number_of_seconds(bound: object) -> None:
    with pytest.raises(ConfigError, match="key_fetch_timeout must be a positive number"):
        Outbox(key_fetch_timeout=bound)  # type: ignore[arg-type]


def test_key_fetch_timeout_defaults_to_the_relays_bound_and_configure_sets_it() -> None:
    assert Outbox().key_fetch_timeout == KEY_FETCH_TIMEOUT == 30.0
    assert Outbox(key_fetch_timeout=5).key_fetch_timeout == 5
    before = ENQUEUE.DEFAULT_OUTBOX
    try:
        assert ENQUEUE.configure(key_fetch_timeout=2.5).key_fetch_timeout == 2.5
    finally:
        ENQUEUE.DEFAULT_OUTBOX = before


def test_a_silent_kms_fails_the_enqueue_within_its_bound_before_any_sql(
    kms: SilentKms, conn: sqlite3.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    outbox = kms.outbox()
    conn.execute("BEGIN")
    sent: list[str] = []
    conn.set_trace_callback(sent.append)
    began = time.monotonic()
    outcome = within(
        BOUND + SLACK,
        "the enqueue",
        lambda: outbox.enqueue(conn, "a", {"n": 1}, key="order-1"),
    )
    took = time.monotonic() - began
    assert isinstance(outcome, EnqueueKeyUnavailableError), outcome
    assert isinstance(outcome, KeyRingUnavailableError | EncryptionError | OutboxerError)
    assert (outcome.key_id, outcome.timeout) == ("k2", BOUND)
    text = str(outcome)
    assert "'k2'" in text and "key_fetch_timeout=0.3 s" in text and "nothing was written" in text
    assert BOUND <= took < BOUND + SLACK, took
    assert sent == [], "outboxer sent no SQL"
    conn.set_trace_callback(None)
    assert conn.in_transaction and rows(conn) == []
    assert kms.calls == ["k2"]

    # The caller rolls back; the late key is kept by the ring, and the next enqueue of the
    # same outbox encrypts with it, the KMS not asked again.
    conn.rollback()
    with caplog.at_level(logging.INFO, logger="outboxer.enqueue"):
        kms.answer.set()
        wait_for(lambda: fetch_threads() == 0, 5, "the late call did not end")
    assert "the enqueue waited 0.3 s" in caplog.text
    message = outbox.enqueue(conn, "a", {"n": 2}, key="order-1")
    conn.commit()
    assert kms.calls == ["k2"]
    [(topic, headers)] = rows(conn)
    assert topic == "a" and '"outboxer-key-id":"k2"' in headers.replace(" ", "")
    assert message.payload == b'{"n":2}'
    assert outbox.encryption is not None
    assert decrypt(outbox.protect([message])[0], outbox.encryption).payload == b'{"n":2}'


def test_a_failing_kms_is_the_typed_error_at_once_naming_no_secret(
    kms: SilentKms, conn: sqlite3.Connection
) -> None:
    kms.error = RuntimeError("denied: https://svc:hunter2-secret@kms.example/v1/keys/k2")
    outbox = kms.outbox(bound=5.0)
    began = time.monotonic()
    outcome = within(5, "the enqueue", lambda: outbox.enqueue(conn, "a", {"n": 1}))
    assert isinstance(outcome, EnqueueKeyUnavailableError), outcome
    assert time.monotonic() - began < 1, "a failure is not waited out"
    text = str(outcome)
    assert "'k2'" in text and "key_fetch_timeout=5 s" in text and "RuntimeError" in text
    assert "hunter2-secret" not in text
    assert rows(conn) == [] and not conn.in_transaction


def test_enqueue_async_waits_for_the_kms_off_the_event_loop(kms: SilentKms) -> None:
    outbox = kms.outbox()

    async def main() -> tuple[bool, BaseException | None]:
        # The connection is never reached: the key comes first.
        task = asyncio.create_task(outbox.enqueue_async(object(), "a", {"n": 1}))
        while not kms.calls:  # the loop runs this while the KMS is asked
            await asyncio.sleep(0.005)
        pending = not task.done()
        try:
            await task
        except BaseException as exc:  # the test reads it
            return pending, exc
        return pending, None

    outcome = within(BOUND + SLACK, "asyncio.run of the enqueue", lambda: asyncio.run(main()))
    assert isinstance(outcome, tuple), outcome
    pending, error = outcome
    assert pending, "the event loop ran while the KMS was asked"
    assert isinstance(error, EnqueueKeyUnavailableError), error
    assert "key_fetch_timeout=0.3 s" in str(error)


def test_enqueues_waiting_at_once_share_one_kms_call(
    kms: SilentKms, conn: sqlite3.Connection
) -> None:
    # A bound long enough for the three threads to start within the first one's wait.
    bound = 1.0
    outbox = kms.outbox(bound)
    items = [{"topic": "a", "payload": {"n": n}, "key": f"k{n}"} for n in range(3)]
    outcomes: list[object] = []
    writers = [
        threading.Thread(
            target=lambda: outcomes.append(
                within(bound + SLACK, "enqueue_many", lambda: outbox.enqueue_many(conn, items))
            ),
            daemon=True,
        )
        for _ in range(3)
    ]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(bound + SLACK + 1)
    assert len(outcomes) == 3
    assert all(isinstance(o, EnqueueKeyUnavailableError) for o in outcomes), outcomes
    assert kms.calls == ["k2"], "one call of the KMS for the three writers and their nine items"
    assert rows(conn) == []


def test_a_silent_kms_costs_at_most_the_rings_places_in_threads(
    kms: SilentKms, conn: sqlite3.Connection
) -> None:
    outbox = kms.outbox(bound=0.1)
    for _ in range(MAX_ABANDONED_FETCHES):
        outcome = within(2, "the enqueue", lambda: outbox.enqueue(conn, "a", {"n": 1}))
        assert isinstance(outcome, EnqueueKeyUnavailableError), outcome
    assert fetch_threads() == MAX_ABANDONED_FETCHES
    began = time.monotonic()
    outcome = within(2, "the enqueue", lambda: outbox.enqueue(conn, "a", {"n": 1}))
    assert isinstance(outcome, EnqueueKeyUnavailableError), outcome
    assert f"{MAX_ABANDONED_FETCHES} earlier fetches" in str(outcome)
    assert time.monotonic() - began < 0.1, "refused at once"
    assert len(kms.calls) == MAX_ABANDONED_FETCHES
    assert fetch_threads() == MAX_ABANDONED_FETCHES
    assert rows(conn) == []


def test_a_static_ring_or_a_key_held_costs_no_thread_and_no_fetch(
    kms: SilentKms, conn: sqlite3.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The fetching ring's first enqueue fetches (the KMS answers), never on the caller's
    # thread; every later one is a lookup.
    kms.answer.set()
    fetching = kms.outbox(bound=5.0)
    fetching.enqueue(conn, "first", {"n": 0})
    assert kms.threads == ["outboxer-key-fetch"]
    wait_for(lambda: fetch_threads() == 0, 5, "the fetch did not end")

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("no fetch for a key the ring holds")

    monkeypatch.setattr(crypto, "fetch_key_bounded_sync", refuse)
    monkeypatch.setattr(crypto, "fetch_key_bounded", refuse)
    spawned: list[str] = []
    start = threading.Thread.start

    def counted(thread: threading.Thread) -> None:
        spawned.append(thread.name)
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", counted)
    static = Outbox(encryption=KeyRing({"k1": KEY}), key_fetch_timeout=0.1)
    for outbox in (static, fetching):
        outbox.enqueue(conn, "one", {"n": 1})
        outbox.enqueue_many(conn, [{"topic": "many", "payload": {"n": n}} for n in range(2)])
        with pytest.raises(TypeError, match="sync connection"):  # past the key: the write
            asyncio.run(outbox.enqueue_async(conn, "async", {"n": 3}))
    conn.commit()
    assert spawned == []
    assert kms.calls == ["k2"]
    assert len(rows(conn)) == 7
