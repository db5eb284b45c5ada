"""The relay after a failover whose old primary stays up, read-only: a primary fenced with
``default_transaction_read_only`` (Patroni, pg_auto_failover; Aurora's old writer turned
reader keeps its sessions) and its streaming standby promoted, the relay's URL naming both
hosts with ``target_session_attrs=read-write``.

Before, the relay kept its connections to the old primary: every claim (and every settle)
failed there with "cannot execute UPDATE in a read-only transaction" (SQLSTATE 25006), was
backed off and tried again on the same connections, for ever; nothing written on the new
primary was published, and what it had claimed stayed PROCESSING there. Now a connection
that answers read-only is closed, with the rest of the pool's, and the next statement
connects anew: the writable host.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import asyncpg
import psycopg
import pytest

import outboxer
from outboxer.brokers.memory import memory_broker
from outboxer.message import Message
from tests import relaying
from tests.failover import primary_and_standby
from tests.rabbit import RabbitConsumer

DB = "outboxer_failover"
#: Seconds the relay has to publish what was written after the failover.
BOUND = 15.0


async def stop(relay: outboxer.Relay, task: asyncio.Task[outboxer.RelayStats]) -> None:
    """Stop the relay; cancelled if it has not stopped within 5 s (a settle it goes on
    retrying at its stop), so that the test's own failure is what it reports."""
    relay.stop()
    done, _ = await asyncio.wait({task}, timeout=5)
    if not done:
        task.cancel()
        await asyncio.wait({task})


async def statuses(url: str) -> dict[str, str]:
    return {str(row["id"]): str(row["status"]) for row in await relaying.rows(url)}


async def test_audit20_relay_publishes_what_the_promoted_standby_gets_after_the_fence(
    rabbit_consumer: RabbitConsumer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    with primary_and_standby(DB) as pair:
        url = pair.url(DB)
        async with outboxer.create_store(url) as store:
            await store.apply_schema()
        relay = relaying.relay(url, rabbit_consumer.broker_url, concurrency=4)
        task = asyncio.create_task(relay.run())
        try:
            before = relaying.enqueue(url, ("failover.before", "a"), ("failover.before", "b"))
            ids = {str(m.id) for m in before}

            async def settled_on_standby() -> bool:
                try:
                    found = await statuses(pair.standby_url(DB))
                except asyncpg.UndefinedTableError:
                    return False  # the schema not replayed on the standby yet (a loaded box)
                return set(found.values()) == {"PUBLISHED"}

            await relaying.until(settled_on_standby, "published before the failover", BOUND)
            pair.fence()
            # No writable host until the promotion: an outage, on /health meanwhile.
            await relaying.until(
                lambda: bool(relay.health_problems()), "no outage on /health", BOUND
            )
            await asyncio.sleep(1.0)  # claims meet no writable host (no host matches)
            pair.promote()
            failed_over = time.monotonic()
            after = relaying.enqueue(url, ("failover.after", "a"), ("failover.after", "c"))
            ids |= {str(m.id) for m in after}

            def delivered() -> bool:
                return {d.message_id for d in rabbit_consumer.received} >= ids

            await relaying.until(
                delivered, f"nothing written after the failover published in {BOUND:g}s", BOUND
            )
            print(f"published {time.monotonic() - failed_over:.2f}s after the failover")
            new_primary = pair.standby_url(DB)
            await relaying.until(
                lambda: relaying.drained(new_primary), "left unsettled on the new primary", BOUND
            )
            assert set(await statuses(new_primary)) == ids
            await relaying.until(lambda: not relay.health_problems(), "still on /health", BOUND)

            def listening_on_new_primary() -> bool:
                with psycopg.connect(pair.standby_url(DB), autocommit=True) as conn:
                    row = conn.execute(
                        "SELECT count(*) FROM pg_stat_activity "
                        "WHERE application_name = 'outboxer-relay-listen'"
                    ).fetchone()
                return bool(row and row[0])

            # Its wake-ups too: the listener left the old primary, where no writer notifies.
            await relaying.until(listening_on_new_primary, "no listener on the new primary", BOUND)
        finally:
            await stop(relay, task)
    # Said as the database's trouble, the connections replaced.
    assert any("read-only" in r.getMessage() for r in caplog.records if r.name == "outboxer.store")


async def test_audit20_relay_settles_on_the_new_primary_what_it_claimed_on_the_old() -> None:
    """The failover strikes between a claim and its settle: the settle, refused by the old
    primary, is tried again on the new one, where the claim had been replicated. Nothing is
    left PROCESSING, nothing is published twice."""
    with primary_and_standby(DB) as pair:
        url = pair.url(DB)
        async with outboxer.create_store(url) as store:
            await store.apply_schema()
        name = f"failover-{uuid.uuid4().hex[:8]}"
        broker = memory_broker(name)
        failed_over: list[float] = []

        def fail_over(_: Message) -> None:
            # Blocking the loop for a few tens of ms: the relay waits to publish meanwhile.
            if not failed_over:
                pair.caught_up(DB)  # the claim reached the standby
                pair.fence()
                pair.promote()
                failed_over.append(time.monotonic())

        broker.fail = fail_over
        sent = relaying.enqueue(url, *((f"failover.{n}", f"k{n}") for n in range(3)))
        relay = relaying.relay(url, f"memory://{name}")
        task = asyncio.create_task(relay.run())
        try:
            new_primary = pair.standby_url(DB)

            async def settled() -> bool:
                return bool(failed_over) and await relaying.drained(new_primary)

            await relaying.until(settled, f"not settled in {BOUND:g}s of the failover", BOUND)
            print(f"settled {time.monotonic() - failed_over[0]:.2f}s after the failover")
        finally:
            await stop(relay, task)
    published = [str(m.id) for m in broker.messages]
    assert sorted(published) == sorted(str(m.id) for m in sent)
