"""A consumer stopped while a sync handler hangs (SQLite, ``memory://``): ``run_async`` ends
within ``shutdown_timeout`` plus CANCELLED_WAIT, raising ConsumerShutdownError naming the
message; the handler's transaction never commits, even if it returns later; the message is
handed back and the next run applies it once. A second signal ends the wait at once."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
import uuid
from typing import Any

import pytest

from outboxer.brokers.memory import memory_broker
from outboxer.consumer import Consumer, Delivery
from outboxer.errors import ConsumerShutdownError
from outboxer.receivers.memory import group_state
from outboxer.testing import make_message


@pytest.fixture
def broker() -> str:
    name = f"a8g-{uuid.uuid4().hex[:8]}"
    memory_broker(name).clear()
    return name


@pytest.fixture
def db(sqlite_url: str) -> str:
    with sqlite3.connect(sqlite_url.removeprefix("sqlite:///")) as conn:
        conn.execute("CREATE TABLE applied (id TEXT)")
    return sqlite_url


def _rows(db: str, sql: str) -> list[Any]:
    with sqlite3.connect(db.removeprefix("sqlite:///"), timeout=5) as conn:
        return [row[0] for row in conn.execute(sql)]


def _transaction_ended(db: str) -> None:
    """Wait (busy_timeout) for the handler's transaction to end: committed or rolled back."""
    conn = sqlite3.connect(db.removeprefix("sqlite:///"), timeout=5, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("ROLLBACK")
    finally:
        conn.close()


class Blocking:
    """A sync handler that writes its row, then waits until released."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()

    def __call__(self, message: Delivery, conn: sqlite3.Connection) -> None:
        conn.execute("INSERT INTO applied (id) VALUES (?)", (str(message.id),))
        self.started.set()
        self.release.wait(30)


async def _stopped_while_hanging(
    db: str,
    broker: str,
    handler: Blocking,
    timeout: float,
    *,
    forced: bool = False,
    release_after: float | None = None,
) -> tuple[ConsumerShutdownError, float, str]:
    message = make_message("t", {"n": 0}, key="k")
    memory_broker(broker).messages.append(message)
    consumer = Consumer(
        db=db,
        broker=f"memory://{broker}",
        group="g",
        handler=handler,
        concurrency=1,
        shutdown_timeout=timeout,
    )
    running = asyncio.create_task(consumer.run_async())
    while not handler.started.is_set():
        await asyncio.sleep(0.005)
    consumer.signalled()
    stopped = time.monotonic()
    if release_after is not None:
        asyncio.get_running_loop().call_later(release_after, handler.release.set)
    if forced:
        await asyncio.sleep(0.05)
        consumer.signalled()
    # On the old code closing the session waited for the handler: for ever.
    with pytest.raises(ConsumerShutdownError) as caught:
        await asyncio.wait_for(running, 5)
    return caught.value, time.monotonic() - stopped, str(message.id)


def _applied_once_by_the_next_run(db: str, broker: str, message_id: str) -> None:
    assert _rows(db, "SELECT message_id FROM inbox") == []
    assert _rows(db, "SELECT id FROM applied") == []
    assert group_state(broker, "g").acked == set()

    def record(message: Delivery, conn: sqlite3.Connection) -> None:
        conn.execute("INSERT INTO applied (id) VALUES (?)", (str(message.id),))

    consumer = Consumer(
        db=db, broker=f"memory://{broker}", group="g", handler=record, exit_when_idle=True
    )
    asyncio.run(consumer.run_async())
    assert _rows(db, "SELECT id FROM applied") == [message_id]
    assert _rows(db, "SELECT message_id FROM inbox") == [message_id]


def test_a_hung_sync_handler_is_abandoned_at_the_bound(
    db: str, broker: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("outboxer.consumer.CANCELLED_WAIT", 0.2)
    handler = Blocking()
    error, took, message_id = asyncio.run(_stopped_while_hanging(db, broker, handler, 0.2))
    assert took < 0.2 + 0.2 + 0.5
    assert error.hung and error.message_ids == [message_id]
    assert message_id in str(error) and "shutdown_timeout" in str(error)
    # Returning after all, the handler must not commit what was handed back.
    handler.release.set()
    _transaction_ended(db)
    _applied_once_by_the_next_run(db, broker, message_id)


def test_a_handler_returning_while_it_is_cut_short_does_not_commit(db: str, broker: str) -> None:
    handler = Blocking()
    # Released after the bound (0.1 s), while the runner waits for the batch it cut short.
    error, _, message_id = asyncio.run(
        _stopped_while_hanging(db, broker, handler, 0.1, release_after=0.2)
    )
    assert not error.hung and error.message_ids == [message_id]
    _transaction_ended(db)
    _applied_once_by_the_next_run(db, broker, message_id)


def test_a_second_signal_ends_the_wait_at_once(
    db: str, broker: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("outboxer.consumer.CANCELLED_WAIT", 0.2)
    handler = Blocking()
    error, took, message_id = asyncio.run(
        _stopped_while_hanging(db, broker, handler, 60, forced=True)
    )
    assert took < 0.2 + 0.5
    assert error.hung and "second SIGTERM" in str(error)
    handler.release.set()
    _transaction_ended(db)
    _applied_once_by_the_next_run(db, broker, message_id)
