"""The stream relay (log mode) after a failover whose old primary stays up, read-only (see
test_audit20_failover_relay.py): its URL names both hosts with
``target_session_attrs=read-write``, the primary is fenced (``default_transaction_read_only``)
and the standby promoted.

Before, the reader's next write on its connection to the old primary (the offset's commit,
or the partition upkeep while idle) failed with "cannot execute UPDATE in a read-only
transaction" (SQLSTATE 25006), which ``is_database_outage`` did not know: the relay stopped
with the error (``outboxer stream-relay`` exited), where a database that went away is waited
for and reconnected to. Now a read-only answer is an outage: the relay reconnects, and the
new connection reaches the promoted standby. An idle relay, which writes nothing, asks whether
its server still takes writes at most once a second, and reconnects if not.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable, Sequence

import psycopg

from outboxer.brokers.memory import MemoryPublisher, memory_broker
from outboxer.enqueue import Outbox
from outboxer.message import Message
from outboxer.stores.pglog import PgLog
from outboxer.streamrelay import StreamRelay
from tests import relaying
from tests.failover import primary_and_standby

DB = "outboxer_failover_stream"
#: Seconds the relay has to publish what was written after the failover.
BOUND = 10.0


class HeldPublisher(MemoryPublisher):
    """A broker that holds the messages of ``n`` 3 and on until ``go`` is set: a batch at
    the broker while the failover happens, whose offset is then committed after it."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.go = asyncio.Event()
        self.held = asyncio.Event()

    async def _publish_wave(self, messages: Sequence[Message]) -> list[BaseException | None]:
        if any(json.loads(m.payload)["n"] >= 3 for m in messages) and not self.go.is_set():
            self.held.set()
            await self.go.wait()
        return await super()._publish_wave(messages)


def write(url: str, *numbers: int) -> None:
    with psycopg.connect(url) as conn:
        for n in numbers:
            Outbox(mode="log").enqueue(conn, "orders", {"n": n})


async def test_log_relay_goes_on_on_the_new_primary_after_the_fence() -> None:
    with primary_and_standby(DB) as pair:
        url = pair.url(DB)
        async with PgLog(url) as log:
            await log.apply_schema()
        name = f"stream-failover-{uuid.uuid4().hex[:8]}"
        broker = memory_broker(name)
        source = PgLog(url).reader("default")
        await source.connect()
        publisher = HeldPublisher(f"memory://{name}")
        relay = StreamRelay(source, publisher, poll_interval=0.02, outage_backoff_max=0.2)
        stop = asyncio.Event()
        task = asyncio.create_task(relay.run(stop))

        def published() -> set[int]:
            return {json.loads(m.payload)["n"] for m in broker.messages}

        try:
            write(url, 1, 2)
            await relaying.until(lambda: len(broker.messages) == 2, "published before", BOUND)
            write(url, 3, 4)  # read by the relay from the old primary, held at the broker
            await asyncio.wait_for(publisher.held.wait(), BOUND)
            pair.caught_up(DB)
            pair.fence()
            pair.promote()
            failed_over = time.monotonic()
            publisher.go.set()  # published; the offset's commit meets the fence
            write(url, 5, 6)  # on the new primary
            await relaying.until(
                lambda: task.done() or {5, 6} <= published(),
                f"5 and 6 not published within {BOUND:g}s of the failover",
                BOUND,
            )
            assert not task.done(), f"the stream relay stopped: {task.exception()!r}"
            print(f"published {time.monotonic() - failed_over:.2f}s after the failover")
        finally:
            stop.set()
            try:
                await asyncio.wait_for(asyncio.shield(task), 5)
            except BaseException as exc:
                print(f"the relay ended with {exc!r}")
            await source.close()
        # At least once: 3 and 4 again from the new primary's offset (the old one's commit
        # was refused), nothing lost.
        assert published() == {1, 2, 3, 4, 5, 6}
        assert relay.stats.outages >= 1


async def test_an_idle_log_relay_finds_the_new_primary_after_the_fence() -> None:
    """Nothing in flight at the failover: the relay's last round committed its offset
    before the fence, and it reads the old primary (reads succeed there), where nothing new
    comes. Before, it wrote nothing, so nothing told it: the messages written on the new
    primary waited for its next write, the partition upkeep (hourly), unpublished."""
    with primary_and_standby(DB) as pair:
        url = pair.url(DB)
        async with PgLog(url) as log:
            await log.apply_schema()
        name = f"stream-failover-{uuid.uuid4().hex[:8]}"
        broker = memory_broker(name)
        source = PgLog(url).reader("default")
        await source.connect()
        relay = StreamRelay(
            source,
            MemoryPublisher(f"memory://{name}"),
            poll_interval=0.02,
            outage_backoff_max=0.2,
        )
        stop = asyncio.Event()
        task = asyncio.create_task(relay.run(stop))

        def published() -> set[int]:
            return {json.loads(m.payload)["n"] for m in broker.messages}

        try:
            write(url, 1, 2)
            await relaying.until(lambda: published() == {1, 2}, "published before", BOUND)
            await asyncio.sleep(0.2)  # the round's offset committed, the relay idle
            pair.caught_up(DB)
            pair.fence()
            pair.promote()
            failed_over = time.monotonic()
            write(url, 3, 4)  # on the new primary
            found = await _within(lambda: task.done() or {3, 4} <= published(), 5)
            assert not task.done(), f"the stream relay stopped: {task.exception()!r}"
            assert found, "what the new primary got was not published within 5 s"
            print(f"published {time.monotonic() - failed_over:.2f}s after the failover")
        finally:
            stop.set()
            try:
                await asyncio.wait_for(asyncio.shield(task), 5)
            except BaseException as exc:
                print(f"the relay ended with {exc!r}")
            await source.close()
        assert published() == {1, 2, 3, 4}
        assert relay.stats.outages >= 1


async def _within(check: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True
