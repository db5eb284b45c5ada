"""A message whose ``outboxer-created-at`` carries no offset (written by another producer):
read as UTC, as every outboxer time without an offset is, whatever the consumer host's time
zone. It was left naive: the handler got a naive time, and its dead letter stored it as
the host's local time on PostgreSQL and SQLite but as UTC on MariaDB (hours apart)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

import pytest

from outboxer.consumer_db import session_factory
from outboxer.receivers.base import Delivery, decode
from tests.relaying import db  # noqa: F401 -- the fixture: each test runs on every database

WRITTEN = datetime(2024, 5, 1, 12, 0, 0, tzinfo=UTC)


@pytest.fixture
def new_york(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The consumer host's local time is New York's (UTC-4 on that day)."""
    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def naive_delivery() -> Delivery:
    headers = {
        "outboxer-id": str(uuid.uuid4()),
        "outboxer-topic": "t",
        "outboxer-created-at": "2024-05-01T12:00:00",
    }
    return decode(headers, b"{}").delivery


@pytest.mark.usefixtures("new_york")
def test_a_time_without_offset_is_utc() -> None:
    assert naive_delivery().created_at == WRITTEN
    created = naive_delivery().created_at
    assert created is not None and created.tzinfo is UTC


@pytest.mark.usefixtures("new_york")
async def test_the_dead_letter_keeps_the_creation_time_on_every_database(db: str) -> None:  # noqa: F811
    delivery = naive_delivery()
    with ThreadPoolExecutor(1) as executor:
        session = session_factory(db, "outboxer", is_async=False, async_driver=None)(executor)
        await session.open()
        try:
            await session.record_dead_letter("g", delivery, "boom", 1)
            [letter] = await session.dead_letters("g", 10)
        finally:
            await session.close()
    assert letter.delivery.created_at == WRITTEN


@pytest.mark.usefixtures("new_york")
async def test_the_dead_letter_keeps_the_creation_time_with_asyncpg(pg_url: str) -> None:
    delivery = naive_delivery()
    with ThreadPoolExecutor(1) as executor:
        session = session_factory(pg_url, "outboxer", is_async=True, async_driver="asyncpg")(
            executor
        )
        await session.open()
        try:
            await session.record_dead_letter("g", delivery, "boom", 1)
            [letter] = await session.dead_letters("g", 10)
        finally:
            await session.close()
    assert letter.delivery.created_at == WRITTEN
