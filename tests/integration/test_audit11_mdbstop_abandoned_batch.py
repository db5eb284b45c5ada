"""A batch that shutdown gave up on (``Session.abandoned``, set by the runner while one of
its handlers still ran or its thread waited on a lock) runs none of its later handlers: its
messages were handed back to the broker, perhaps to another consumer applying them at the
same time, and what a handler does outside the transaction would not roll back with it.
Before, every later handler of the batch ran, and only the commit was refused."""

from __future__ import annotations

import asyncio
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from outboxer.consumer_db import BatchFailed, Result, Session, session_factory
from outboxer.receivers.base import Delivery, decode
from tests.relaying import db  # noqa: F401 -- the fixture: each test runs on every database


def delivery(n: int) -> Delivery:
    headers = {"outboxer-id": str(uuid.uuid4()), "outboxer-topic": "t", "outboxer-key": f"k{n}"}
    return decode(headers, b"{}").delivery


async def _check(session: Session, handler_of: Any) -> None:
    """Apply two messages; the first handler's run is where shutdown abandons the batch."""
    deliveries = sorted([delivery(1), delivery(2)], key=lambda d: d.id)
    handled: list[uuid.UUID] = []
    await session.open()
    try:
        with pytest.raises(BatchFailed):
            await session.apply("g", deliveries, handler_of(session, handled), hold_keys=True)
        assert handled == [deliveries[0].id], "a handler ran after the batch was abandoned"
        # Nothing committed: both are first deliveries still.
        session.abandoned = False
        results = await session.apply("g", deliveries, handler_of(None, []), hold_keys=True)
        assert results == [Result.APPLIED, Result.APPLIED]
    finally:
        await session.close()


async def test_a_sync_batch_abandoned_runs_no_further_handler(db: str) -> None:  # noqa: F811
    def handler_of(session: Session | None, handled: list[uuid.UUID]) -> Any:
        def handler(delivery: Delivery, conn: Any) -> None:
            handled.append(delivery.id)
            if session is not None:
                session.abandoned = True  # what _shutdown does while the handler runs

        return handler

    with ThreadPoolExecutor(1) as executor:
        await _check(
            session_factory(db, "outboxer", is_async=False, async_driver=None)(executor),
            handler_of,
        )


@pytest.mark.parametrize("driver", ["asyncpg", "psycopg"])
async def test_an_async_batch_abandoned_runs_no_further_handler(pg_url: str, driver: str) -> None:
    def handler_of(session: Session | None, handled: list[uuid.UUID]) -> Any:
        async def handler(delivery: Delivery, conn: Any) -> None:
            handled.append(delivery.id)
            if session is not None:
                session.abandoned = True  # a handler that ignored its cancellation
            await asyncio.sleep(0)

        return handler

    with ThreadPoolExecutor(1) as executor:
        await _check(
            session_factory(pg_url, "outboxer", is_async=True, async_driver=driver)(executor),
            handler_of,
        )
