"""Destination names that differ only by surrounding whitespace. The MySQL tables' utf8mb4_bin
collation is PAD SPACE: destination = 'orders' also matched 'orders ', so on MariaDB the
relay of 'orders' claimed (and published to its broker) a row enqueued for 'orders ', which
PostgreSQL and SQLite leave for a relay of 'orders ' that never comes. Such names are now
refused before any SQL, and the MySQL statements compare destinations byte for byte, for
the rows an older version wrote."""

from __future__ import annotations

import asyncio
import uuid

import pytest

import outboxer
from outboxer.admin import MessageFilter
from tests.conftest import mysql_connect
from tests.relaying import connect_sync, rows


def insert_row(url: str, destination: str, key: str | None = None, status: str = "PENDING") -> str:
    """A row for ``destination``, written as an older version would have."""
    message_id = str(uuid.uuid4())
    conn = mysql_connect(url)
    try:
        with conn.cursor() as cursor:
            cursor.execute(
                "INSERT INTO outbox (id, destination, topic, `key`, payload, content_type, "
                "headers, status, attempts, locked_by, lease, locked_until) "
                "VALUES (%s, %s, 't', %s, '{}', 'application/json', '{}', %s, 1, 'r', "
                "IF(%s = 'PROCESSING', UUID(), NULL), "
                "IF(%s = 'PROCESSING', UTC_TIMESTAMP(6) + INTERVAL 1 HOUR, NULL))",
                (message_id, destination, key, status, status, status),
            )
        conn.commit()
    finally:
        conn.close()
    return message_id


def statuses(url: str) -> dict[str, str]:
    conn = mysql_connect(url)
    try:
        with conn.cursor() as cursor:
            cursor.execute("SELECT id, status FROM outbox")
            return {str(row[0]): str(row[1]) for row in cursor.fetchall()}
    finally:
        conn.close()


async def test_a_claim_takes_only_its_own_destinations_rows(mysql_url: str) -> None:
    padded = insert_row(mysql_url, "orders ")
    async with outboxer.create_store(mysql_url) as store:
        assert await store.claim("orders", "r", 10, 60, True, max_attempts=5) == []
        plain = insert_row(mysql_url, "orders")
        claimed = await store.claim("orders", "r", 10, 60, True, max_attempts=5)
        assert [str(m.id) for m in claimed] == [plain]
        assert {m.destination for m in claimed} == {"orders"}
    assert padded != plain


async def test_a_padded_destinations_key_holds_back_nothing_of_another(mysql_url: str) -> None:
    padded = insert_row(mysql_url, "orders ", key="k")
    conn = mysql_connect(mysql_url)
    try:
        with conn.cursor() as cursor:  # in flight for a dead relay: it blocks its key
            cursor.execute(
                "UPDATE outbox SET status = 'FAILED', attempts = 1, "
                "next_attempt_at = UTC_TIMESTAMP(6) + INTERVAL 1 HOUR WHERE id = %s",
                (padded,),
            )
        conn.commit()
    finally:
        conn.close()
    plain = insert_row(mysql_url, "orders", key="k")
    async with outboxer.create_store(mysql_url) as store:
        claimed = await store.claim("orders", "r", 10, 60, True, max_attempts=5)
    assert [str(m.id) for m in claimed] == [plain]


async def test_status_counts_each_destination_apart(mysql_url: str) -> None:
    insert_row(mysql_url, "orders ")
    insert_row(mysql_url, "orders")
    insert_row(mysql_url, "orders")
    async with outboxer.create_store(mysql_url) as store:
        counts = await store.count_matching(MessageFilter(destinations=("orders",)))
        assert counts == {"orders": {"PENDING": 2}}
        counts = await store.count_matching(MessageFilter())
        assert counts == {"orders": {"PENDING": 2}, "orders ": {"PENDING": 1}}
        exact = await store.status()
        store.exact_status_rows = 0  # a big table's path: counts_tally and a sample
        tallied = await store.status()
    for status in (exact, tallied):
        assert {entry.destination: entry.counts for entry in status} == {
            "orders": {"PENDING": 2},
            "orders ": {"PENDING": 1},
        }


async def test_requeue_by_destination_leaves_the_padded_ones(mysql_url: str) -> None:
    padded = insert_row(mysql_url, "orders ", status="ABANDONED")
    plain = insert_row(mysql_url, "orders", status="ABANDONED")
    async with outboxer.create_store(mysql_url) as store:
        assert await store.requeue(["orders"], ["ABANDONED"], None) == 1
    assert statuses(mysql_url) == {padded: "ABANDONED", plain: "PENDING"}


async def test_a_padded_destinations_flight_defers_no_requeue_of_another(mysql_url: str) -> None:
    plain = insert_row(mysql_url, "orders", key="k", status="ABANDONED")
    flying = insert_row(mysql_url, "orders ", key="k", status="PROCESSING")
    where = MessageFilter(destinations=("orders",))
    async with outboxer.create_store(mysql_url) as store:
        assert await store.count_requeue_deferred(where) == 0
        assert await store.requeue_matching(where) == 1
    assert statuses(mysql_url) == {plain: "PENDING", flying: "PROCESSING"}


@pytest.mark.parametrize("name", ["orders ", " orders", "orders\t", "\norders", " "])
@pytest.mark.parametrize("database", ["mysql", "pg"])
def test_enqueue_refuses_a_padded_destination_and_the_transaction_goes_on(
    name: str, database: str, request: pytest.FixtureRequest
) -> None:
    url = request.getfixturevalue(f"{database}_url")
    conn = connect_sync(url)
    try:
        outboxer.enqueue(conn, "t", {"n": 1})
        with pytest.raises(outboxer.ConfigError, match="destination"):
            outboxer.enqueue(conn, "t", {"n": 2}, destinations=["orders", name])
        with pytest.raises(outboxer.ConfigError, match="destination"):
            outboxer.enqueue_many(conn, [{"topic": "t", "payload": {}, "destinations": [name]}])
        with pytest.raises(outboxer.ConfigError, match="destination"):
            outboxer.Outbox(destinations=(name,))
        outboxer.enqueue(conn, "t", {"n": 3})
        conn.commit()
    finally:
        conn.close()
    assert [row["destination"] for row in asyncio.run(rows(url))] == ["default", "default"]
