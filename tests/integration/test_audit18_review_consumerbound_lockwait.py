"""PostgreSQL: a round trip of the runner's own that the bound cuts off while the server is
still working on it (the inbox claim of a redelivered message, waiting for the row lock of
another consumer of the group whose handler still runs) leaves a backend behind: PostgreSQL
does not see its client gone while it waits for a lock. Before, each retry after the outage
left one more (one a minute a worker with the default bound, for as long as the holder
runs): connection slots of the whole database, each holding the claims it made. Now the
session's next connection ends the one it cut off (``pg_terminate_backend``, by pid and
backend_start), so at most the retry in progress waits.

The fault: a transaction of the test holds the inbox row of the message, uncommitted (the
first consumer's claim while its handler runs)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from outboxer.brokers.memory import memory_broker
from outboxer.consumer import Consumer
from outboxer.consumer_db import (
    BatchFailed,
    DaemonThreadPool,
    NoAnswerError,
    Result,
    session_factory,
)
from outboxer.receivers.base import Delivery
from outboxer.receivers.memory import group_state
from outboxer.testing import make_message
from tests.relaying import until

BOUND = 0.5
#: Drivers: (async handler, async_driver).
KINDS = {
    "psycopg": (False, None),
    "asyncpg": (True, "asyncpg"),
    "psycopg-async": (True, "psycopg"),
}
#: How long a terminated backend takes to go, at most (it goes at once here).
GONE_WITHIN = 3.0


def _waiting(url: str) -> set[int]:
    """The backends of ``url``'s database waiting for a lock."""
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock'"
        ).fetchall()
    return {row[0] for row in rows}


@pytest.fixture
def stack() -> Iterator[contextlib.ExitStack]:
    with contextlib.ExitStack() as exits:
        yield exits


@contextlib.contextmanager
def _held(url: str, message_id: uuid.UUID) -> Iterator[psycopg.Connection[Any]]:
    """A transaction holding the inbox row of ``message_id`` for group g (claimed, not
    committed: the first consumer's handler still runs); its connection."""
    holder = psycopg.connect(url)
    try:
        holder.execute(
            "INSERT INTO outboxer.inbox (consumer, message_id) VALUES ('g', %s)", (message_id,)
        )
        yield holder
    finally:
        holder.close()


def _delivery(message_id: uuid.UUID) -> Delivery:
    return Delivery(
        id=message_id,
        topic="t",
        key=None,
        headers={},
        payload={},
        body=b"{}",
        content_type="application/json",
    )


@pytest.mark.parametrize("kind", list(KINDS))
async def test_a_claim_cut_off_on_a_lock_leaves_no_backend_behind_once_reconnected(
    kind: str, pg_url: str, stack: contextlib.ExitStack
) -> None:
    message_id = uuid.uuid4()
    holder = stack.enter_context(_held(pg_url, message_id))
    is_async, driver = KINDS[kind]
    pool = DaemonThreadPool(1, thread_name_prefix="audit18-lockwait")
    session = session_factory(pg_url, "outboxer", is_async=is_async, async_driver=driver)(pool)
    session.statement_timeout = BOUND
    calls: list[uuid.UUID] = []

    def handler(delivery: Delivery, conn: Any) -> None:
        calls.append(delivery.id)

    async def async_handler(delivery: Delivery, conn: Any) -> None:
        calls.append(delivery.id)

    apply = async_handler if is_async else handler
    try:
        for _ in range(3):  # an outage again and again while the holder's handler runs
            await session.open()
            # The connection cut off before, if any, is gone: its claim waits no more.
            await until(lambda: not _waiting(pg_url), "no backend left waiting", GONE_WITHIN)
            with pytest.raises(BatchFailed) as failed:
                await session.apply("g", [_delivery(message_id)], apply, hold_keys=False)
            assert isinstance(failed.value.cause, NoAnswerError)
            assert session.lost(failed.value)  # an outage: no attempt charged
            assert len(_waiting(pg_url)) == 1  # the claim just cut off, still waiting
            await session.close()
        holder.rollback()  # the first consumer's handler failed: the message is to apply
        await session.open()
        results = await session.apply("g", [_delivery(message_id)], apply, hold_keys=False)
        assert results == [Result.APPLIED]
        assert calls == [message_id]
    finally:
        holder.rollback()
        await session.close()
        pool.shutdown(wait=False)


async def test_the_runner_retrying_a_claim_held_by_another_consumer_piles_up_no_backends(
    pg_url: str, stack: contextlib.ExitStack
) -> None:
    """The runner's own reconnect after the outage ends the backend it cut off; the message
    is applied once the holder rolls back, no attempt charged for the outages."""
    broker = f"audit18-{uuid.uuid4().hex[:8]}"
    message = make_message("t", {"n": 1})
    memory_broker(broker).messages.append(message)
    holder = stack.enter_context(_held(pg_url, message.id))
    called = threading.Event()

    def handler(delivery: Delivery, conn: Any) -> None:
        called.set()

    consumer = Consumer(db=pg_url, broker=f"memory://{broker}", group="g", handler=handler)
    consumer.statement_timeout = BOUND
    most = 0

    def outages(count: int) -> bool:
        nonlocal most
        most = max(most, len(_waiting(pg_url)))
        return consumer.stats.database_errors >= count

    acked = group_state(broker, "g").acked
    run = asyncio.create_task(consumer.run_async())
    try:
        await until(lambda: outages(3), "three outages on the held claim", 8)
        # The claim in progress, and at most the one just cut off before the reconnect
        # ended it (before: one more each outage).
        assert most <= 2, most
        await until(lambda: len(_waiting(pg_url)) <= 1, "the cut-off ones ended", GONE_WITHIN)
        assert not called.is_set()
        holder.rollback()
        await until(lambda: len(acked) == 1, "the message applied once the holder let go", 8)
    finally:
        holder.rollback()
        consumer.stop()
        await asyncio.wait_for(run, 10)
    assert called.is_set()
    assert consumer.stats.failed == 0
    assert consumer.stats.dead_lettered == 0
