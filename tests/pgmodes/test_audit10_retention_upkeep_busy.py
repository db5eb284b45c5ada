"""The partitioned outbox's upkeep beside a long-running transaction: its DDL waits at most
one lock_timeout per round, so the relay's claims queued behind it stall at most that long.
Each partition past retention waited its own lock_timeout in turn, and the claims (and
settles) stalled again behind each one."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time

import psycopg
import pytest

from outboxer.config import DAY
from outboxer.stores.pgpartitions import LOCK_TIMEOUT, PartitionPolicy
from outboxer.stores.postgres import PostgresStore
from tests.pgmodes.test_partitioned import TABLE, enqueue_one, execute

#: Old, empty partitions, each past retention and each a DROP that needs the table's lock.
EXPIRED = 4
LOCK_TIMEOUT_SECONDS = float(LOCK_TIMEOUT.removesuffix("s"))


def make_expired_partitions(url: str) -> None:
    start = dt.datetime(2020, 1, 1, tzinfo=dt.UTC)
    statements = []
    for index in range(EXPIRED):
        lower, upper = start + dt.timedelta(days=index), start + dt.timedelta(days=index + 1)
        statements.append(
            f"CREATE TABLE {TABLE}_p{lower:%Y%m%d} PARTITION OF {TABLE} "
            f"FOR VALUES FROM ('{lower.isoformat()}') TO ('{upper.isoformat()}')"
        )
    execute(url, *statements)


async def test_upkeep_blocked_by_an_open_writer_stalls_claims_at_most_one_lock_timeout(
    pg_partitioned_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    url = pg_partitioned_url
    make_expired_partitions(url)
    policy = PartitionPolicy(published_retention=7 * DAY, abandoned_retention=30 * DAY)
    async with PostgresStore(url) as store:
        await store.claim("default", "relay-a", 10, 60, False)  # the pool warmed up
        # An application's transaction that enqueued a row and has not committed: it holds
        # the table's ROW EXCLUSIVE lock, which every DROP of a partition waits for.
        with psycopg.connect(url) as writer:
            enqueue_one(writer)
            with caplog.at_level(logging.WARNING, logger="outboxer.partitions"):
                upkeep_started = time.monotonic()
                upkeep = asyncio.create_task(store.maintain_partitions(policy))
                claims_waited = 0.0
                longest = 0.0
                while not upkeep.done():
                    began = time.monotonic()
                    await store.claim("default", "relay-a", 10, 60, False)
                    took = time.monotonic() - began
                    claims_waited += took
                    longest = max(longest, took)
                    await asyncio.sleep(0.01)
                report = await upkeep
                upkeep_took = time.monotonic() - upkeep_started
            writer.rollback()
        assert report.dropped == []
        assert len(report.busy) == EXPIRED, "every expired partition is left for the next round"
        margin = 1.0  # a busy box; the old code waited EXPIRED (4) lock timeouts
        assert longest < LOCK_TIMEOUT_SECONDS + margin
        assert claims_waited < LOCK_TIMEOUT_SECONDS + margin, (
            f"the claims waited {claims_waited:.1f} s in all behind {EXPIRED} DROPs, each "
            f"waiting {LOCK_TIMEOUT} for the writer's transaction"
        )
        assert upkeep_took < LOCK_TIMEOUT_SECONDS + margin
        assert any(
            record.levelno == logging.WARNING and "next round" in record.getMessage()
            for record in caplog.records
        ), "the operator is told the upkeep gave up"
        # The writer gone, the next round drops them all.
        report = await store.maintain_partitions(policy)
        assert len(report.dropped) == EXPIRED and report.busy == []
