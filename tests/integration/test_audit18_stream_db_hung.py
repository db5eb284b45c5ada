"""The stream relay (log mode, WAL outbox) facing a database that stops answering: a proxy
in front of PostgreSQL that keeps every connection open and forwards nothing.

Its asyncpg connections had no statement bound: the relay's commit (log mode) or its
slot's advance (WAL) waited for ever, and the relay looked alive. Now a statement gives up
after COMMAND_TIMEOUT (a call that decodes WAL is watched instead: it may take minutes),
the relay records an outage, reconnects with back-off once the database answers again,
and its checkpoint never passes what the broker confirmed: the message whose commit got no
answer is published again, none is skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Sequence
from typing import Any

import psycopg
import pytest

from outboxer.brokers.base import Outcome
from outboxer.brokers.memory import MemoryPublisher, memory_broker
from outboxer.enqueue import Outbox
from outboxer.message import Message
from outboxer.stores import pgmodes
from outboxer.stores.pglog import PgLog
from outboxer.stores.pgwal import PgWal
from outboxer.streamrelay import StreamRelay, StreamSource
from outboxer.testing import TcpProxy, eventually
from tests.pgmodes.conftest import logical_pg, logical_url  # noqa: F401 -- fixtures

#: The statement bound here, and every other bound a silent database meets.
BOUND = 0.4


@pytest.fixture(autouse=True)
def _short_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    # raising=False: the code before the fix has no such settings, and hangs instead.
    monkeypatch.setattr(pgmodes, "COMMAND_TIMEOUT", BOUND, raising=False)
    monkeypatch.setattr(pgmodes, "CONNECT_TIMEOUT", BOUND, raising=False)
    monkeypatch.setattr(pgmodes, "CLOSE_TIMEOUT", BOUND, raising=False)
    monkeypatch.setattr(pgmodes, "LOCK_CHECK_SECONDS", BOUND)


def through(proxy: TcpProxy, url: str) -> str:
    return re.sub(r"@[^/@]+/", f"@127.0.0.1:{proxy.port}/", url, count=1)


def target(url: str) -> tuple[str, int]:
    conninfo = psycopg.conninfo.conninfo_to_dict(url)
    return str(conninfo.get("host") or "127.0.0.1"), int(conninfo.get("port") or 5432)


class SilencesAfter(MemoryPublisher):
    """Publishes as the memory broker; after publishing topic ``cut`` once, the database
    proxy stops forwarding: the relay's next statement (its commit) gets no answer."""

    def __init__(self, url: str, proxy: TcpProxy) -> None:
        super().__init__(url)
        self.proxy = proxy
        self.armed = True
        self.silenced = asyncio.Event()

    async def publish_batch(
        self, messages: Sequence[Message], known: list[Outcome | None] | None = None
    ) -> list[Outcome]:
        outcomes = await super().publish_batch(messages, known)
        if self.armed and any(m.topic == "cut" for m in messages):
            self.armed = False
            await self.proxy.blackhole()
            self.silenced.set()
        return outcomes


@contextlib.asynccontextmanager
async def running(
    source: StreamSource, publisher: MemoryPublisher, proxy: TcpProxy
) -> AsyncIterator[StreamRelay]:
    relay = StreamRelay(source, publisher, poll_interval=0.02, outage_backoff_max=0.2)
    stop = asyncio.Event()
    await source.connect()
    task = asyncio.create_task(relay.run(stop))
    try:
        yield relay
    finally:
        stop.set()
        done, _ = await asyncio.wait((task,), timeout=5)
        if not done:  # the code before the fix, stuck on a statement: cut it loose
            task.cancel()
        await proxy.stop()  # drops every connection: nothing left waits for an answer
        await asyncio.wait((task,), timeout=5)
        await asyncio.wait_for(source.close(), 5)
        if task.done() and not task.cancelled():
            task.result()


async def _true(value: bool) -> bool:
    return value


def topics(name: str) -> list[str]:
    return [m.topic for m in memory_broker(name).messages]


async def silenced_then_back(relay: StreamRelay, publisher: SilencesAfter, name: str) -> float:
    """Wait for the outage the silence makes, and time it; the database answers again."""
    loop = asyncio.get_running_loop()
    await asyncio.wait_for(publisher.silenced.wait(), 5)
    silenced_at = loop.time()

    async def outage() -> bool:
        return relay.stats.outages >= 1 and any(
            p.startswith("database: ") for p in relay.health_problems()
        )

    await eventually(outage, timeout=5, interval=0.01)
    took = loop.time() - silenced_at
    problems = relay.health_problems()
    assert any("did not answer" in p or "does not answer" in p for p in problems), problems
    assert relay.stats.published == 1, "the commit that got no answer counted nothing"
    await publisher.proxy.restore()
    return took


async def test_log_relay_commit_unanswered_is_an_outage_and_its_message_published_again(
    pg_url: str,
) -> None:
    log = PgLog(pg_url)
    async with log:
        await log.apply_schema()
    proxy = await TcpProxy(*target(pg_url)).start()
    name = "audit18-stream-log-hung"
    memory_broker(name).clear()
    publisher = SilencesAfter(f"memory://{name}", proxy)
    source = PgLog(through(proxy, pg_url)).reader("default")

    def enqueue(topic: str) -> None:
        with psycopg.connect(pg_url) as conn:
            Outbox(mode="log").enqueue(conn, topic, {"t": topic})

    async def stored_offset() -> Any:
        log = PgLog(pg_url)
        async with log:
            return await log.offset("default")

    async with running(source, publisher, proxy) as relay:
        enqueue("first")
        await eventually(lambda: _true(relay.stats.published == 1), timeout=5)
        first = await stored_offset()
        enqueue("cut")
        took = await silenced_then_back(relay, publisher, name)
        assert took < 3 * BOUND + 1.0, f"the outage took {took:.2f}s to be seen"
        assert await stored_offset() == first, "the offset moved past an unconfirmed commit"
        enqueue("after")
        await eventually(lambda: _true(topics(name)[-1:] == ["after"]), timeout=5)
        # At least once: the message whose commit got no answer is published again.
        assert topics(name) == ["first", "cut", "cut", "after"]
        await eventually(lambda: _true(relay.health_problems() == []), timeout=5)
    log = PgLog(pg_url)
    async with log:
        readers = {reader: offset for reader, offset, _ in await log.readers()}
        assert readers["default"] > first


async def test_wal_relay_waits_for_a_long_decode_but_not_for_a_silent_database(
    logical_url: str,  # noqa: F811 -- the fixture
) -> None:
    prefix = logical_url.rsplit("/", 1)[1]
    wal = PgWal(logical_url, slot_prefix=prefix)
    async with wal:
        await wal.apply_schema()
        assert await wal.create_slot("default")
    with psycopg.connect(logical_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE bulk (n int, filler text)")
    proxy = await TcpProxy(*target(logical_url)).start()
    name = "audit18-stream-wal-hung"
    memory_broker(name).clear()
    publisher = SilencesAfter(f"memory://{name}", proxy)
    source = PgWal(through(proxy, logical_url), slot_prefix=prefix).reader("default")

    def enqueue(topic: str, bulk_rows: int = 0) -> float:
        """Commits the message (after ``bulk_rows`` rows of WAL); the loop's time just
        before the COMMIT: no peek can return the message before it."""
        with psycopg.connect(logical_url) as conn:
            if bulk_rows:  # WAL the peek must decode before it reaches the message
                conn.execute(
                    "INSERT INTO bulk SELECT n, repeat('x', 100) FROM generate_series(1, %s) n",
                    (bulk_rows,),
                )
            Outbox(mode="wal").enqueue(conn, topic, {"t": topic})
            committing = asyncio.get_running_loop().time()
        return committing

    async def confirmed() -> int:
        wal = PgWal(logical_url, slot_prefix=prefix)
        async with wal:
            return await wal.reader("default").confirmed_lsn()

    async with running(source, publisher, proxy) as relay:
        # A peek that decodes for several statement bounds is waited for: the server says
        # it is still at it. A fixed bound would cancel it at every try, for ever.
        # Timed from just before the COMMIT: timed from its return, a loaded box's slow
        # close let the peek start first and showed a decode too short (0.71 s for ~1 s).
        committing = enqueue("first", bulk_rows=600_000)
        await eventually(lambda: _true(relay.stats.published == 1), timeout=8)
        assert relay.stats.outages == 0, relay.health_problems()
        slow = asyncio.get_running_loop().time() - committing
        first = await confirmed()
        enqueue("cut")
        took = await silenced_then_back(relay, publisher, name)
        # The advance's watch: a bound, then the lock session's question, unanswered.
        assert took < 3 * BOUND + 1.0, f"the outage took {took:.2f}s to be seen"
        assert await confirmed() == first, "the slot moved past an unconfirmed advance"
        enqueue("after")
        await eventually(lambda: _true(topics(name)[-1:] == ["after"]), timeout=5)
        assert topics(name) == ["first", "cut", "cut", "after"]
        await eventually(lambda: _true(relay.health_problems() == []), timeout=5)
    assert await confirmed() > first
    assert slow > 2 * BOUND, f"the decode took {slow:.2f}s: too short to show the watch"
