"""``dead-letters replay`` on PostgreSQL: a replay whose transaction waits for a lock until
lock_timeout runs out (another transaction holds the message's inbox claim, or its dead
letter) is not an attempt, as the consumer counts none for such a wait: the dead letter is
left as it was (attempts, error) and counted as skipped, for a later replay.

Before, it was "failed again": one more attempt recorded, with the lock error as the dead
letter's error, or (the dead letter's row held) the replay itself failed with the lock
error of the statement recording that attempt."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psycopg
import pytest

from outboxer.consumer import Consumer, Delivery
from outboxer.consumer_db import Session
from outboxer.inbox import Inbox
from tests.integration.test_audit10_replaydl_reads import insert_letters
from tests.integration.test_audit11_lockwait_claim_timeout import ShortAsyncpg, ShortPsycopg

GROUP = "g"


def _letter(url: str, message_id: uuid.UUID) -> tuple[int, str]:
    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT attempts, error FROM outboxer.dead_letters WHERE message_id = %s",
            (message_id,),
        ).fetchone()
    assert row is not None
    return row[0], row[1]


@pytest.mark.parametrize("driver", ["psycopg", "asyncpg"])
@pytest.mark.parametrize("held", ["inbox claim", "dead letter"])
async def test_a_replay_that_waits_for_a_lock_in_vain_is_not_an_attempt(
    pg_url: str, driver: str, held: str
) -> None:
    message_id = uuid.uuid4()
    insert_letters(pg_url, [(GROUP, message_id, "k", 1)])
    handled: list[uuid.UUID] = []

    def sync_handler(delivery: Delivery, conn: Any) -> None:
        handled.append(delivery.id)

    async def async_handler(delivery: Delivery, conn: Any) -> None:
        handled.append(delivery.id)

    def sessions(executor: ThreadPoolExecutor) -> Session:
        if driver == "asyncpg":
            return ShortAsyncpg(pg_url, "outboxer")
        return ShortPsycopg(pg_url, "outboxer", executor)

    make: Callable[..., Session] = sessions
    consumer = Consumer(
        db=pg_url,
        broker=None,
        group=GROUP,
        handler=async_handler if driver == "asyncpg" else sync_handler,
        sessions=make,
        abandoned_blocks_key=True,
    )
    blocker = psycopg.connect(pg_url)  # another transaction, left open
    try:
        if held == "inbox claim":  # a consumer applying the message's redelivery
            assert Inbox().claim(blocker, GROUP, message_id)
        else:  # another replay (or the admin) on the dead letter
            blocker.execute(
                "SELECT 1 FROM outboxer.dead_letters WHERE message_id = %s FOR UPDATE",
                (message_id,),
            )
        counts = await consumer.replay_dead_letters()
    finally:
        blocker.rollback()
        blocker.close()
    assert counts == {"replayed": 0, "duplicates": 0, "failed": 0, "skipped": 1}
    assert _letter(pg_url, message_id) == (1, "e"), "charged for another's lock"
    # The lock gone, the same replay applies it.
    counts = await consumer.replay_dead_letters()
    assert counts == {"replayed": 1, "duplicates": 0, "failed": 0, "skipped": 0}
    assert handled[-1] == message_id
