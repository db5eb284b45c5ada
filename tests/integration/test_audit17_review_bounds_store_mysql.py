"""Review of MySQLStore's bound on each round trip (``statement_timeout``): the round trips
that still waited for ever on a MySQL that stopped answering.

* A free connection that died (the server closed it: ``wait_timeout``, a restart, a proxy's
  idle timeout) is replaced inside aiomysql's ``acquire``: a new connection's handshake,
  which the store took for "no round trip" and did not bound.
* A replay writes its copies on the transaction's raw connection (the write path's code),
  past the bounded cursor.
* A claim whose COMMIT the bound cut was to be released at the next claim; but the cut comes
  a whole ``statement_timeout`` after the COMMIT was sent, and by then the claim's lease
  (60 s by default, as the bound) had run out: the release was skipped, and each row went to
  recovery, one a claim, charged an attempt it never had.

The bound is shortened here (a minute by default) by setting it on the store."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Sequence
from urllib.parse import urlsplit

import pytest

from outboxer import create_store
from outboxer.admin import MessageFilter
from outboxer.errors import StoreError
from outboxer.message import Message
from outboxer.stores.mysql import MySQLStore
from outboxer.testing import TcpProxy
from tests.integration.test_audit17_bounds_mysql_hung import BOUND, GIVE_UP, _through
from tests.integration.test_http_api import connect_sync
from tests.relaying import enqueue, until


def _free_connections_dead(store: MySQLStore) -> bool:
    pool = store._pool
    return bool(pool._free) and all(
        conn._reader.at_eof() or conn._reader.exception() is not None for conn in pool._free
    )


async def test_a_dead_free_connection_replaced_on_a_stalled_mysql_fails_within_the_bound(
    mysql_url: str,
) -> None:
    proxy = await TcpProxy("127.0.0.1", urlsplit(mysql_url).port or 3306).start()
    store = create_store(_through(mysql_url, proxy.port))
    assert isinstance(store, MySQLStore)
    store.statement_timeout = BOUND
    try:
        await store.ping()
        # The server side of the idle connection goes away; new connections get accepted
        # and never answered (the database behind the proxy hangs).
        await proxy.cut()
        await proxy.blackhole()
        await proxy.start()
        await until(lambda: _free_connections_dead(store), "the client sees it closed", 3)
        assert store._pool.freesize == 1  # taken for a connection ready to use
        started = time.monotonic()
        async with asyncio.timeout(GIVE_UP):  # the old code waited for the handshake for ever
            with pytest.raises(StoreError, match=r"did not answer within 0\.5s"):
                await store.ping()
        assert time.monotonic() - started < 3 * BOUND + 1
        await proxy.restore()
        await store.ping()  # and the store works again once the database answers
    finally:
        await proxy.restore()
        await store.close()
        await proxy.stop()


def _mark_published(url: str) -> None:
    conn = connect_sync(url)
    try:
        with conn.cursor() as cursor:
            cursor.execute("UPDATE outbox SET status = 'PUBLISHED', published_at = NOW(6)")
        conn.commit()
    finally:
        conn.close()


def _rows(url: str) -> int:
    conn = connect_sync(url)
    try:
        with conn.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM outbox")
            return int(cursor.fetchone()[0])
    finally:
        conn.close()


async def test_a_replay_whose_writes_get_no_answer_fails_within_the_bound(mysql_url: str) -> None:
    (original,) = enqueue(mysql_url, ("order.placed", "k"))
    _mark_published(mysql_url)
    proxy = await TcpProxy("127.0.0.1", urlsplit(mysql_url).port or 3306).start()
    store = create_store(_through(mysql_url, proxy.port))
    assert isinstance(store, MySQLStore)
    store.statement_timeout = BOUND
    loop = asyncio.get_running_loop()

    def copy(messages: Sequence[Message]) -> list[Message]:
        # The database stops answering between the replay's reads and its writes.
        asyncio.run_coroutine_threadsafe(proxy.blackhole(), loop).result()
        return [
            Message(id=uuid.uuid4(), topic=m.topic, payload=m.payload, key=m.key) for m in messages
        ]

    try:
        where = MessageFilter(ids=(str(original.id),), statuses=("PUBLISHED",))
        started = time.monotonic()
        async with asyncio.timeout(GIVE_UP):  # the old code waited for the insert for ever
            with pytest.raises(StoreError, match=r"did not answer within 0\.5s"):
                await store.replay(where, copy)
        assert time.monotonic() - started < 3 * BOUND + 1
        await proxy.restore()
        assert _rows(mysql_url) == 1  # rolled back: no copy
    finally:
        await proxy.restore()
        await store.close()
        await proxy.stop()


class _CommitSwallower:
    """Forwards to MySQL; once ``armed``, the next COMMIT reaches the server and its answer,
    and every later one on that connection, is dropped (the network stalls right then)."""

    def __init__(self, port: int) -> None:
        self.target_port = port
        self.armed = False
        self.swallowed = False
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._writers += [writer, up_writer]
        stalled = False

        async def upstream() -> None:
            nonlocal stalled
            while data := await reader.read(65536):
                if self.armed and b"\x03COMMIT" in data:
                    self.armed, stalled = False, True
                up_writer.write(data)
            up_writer.close()

        async def downstream() -> None:
            while data := await up_reader.read(65536):
                if stalled:
                    self.swallowed = True
                    continue
                writer.write(data)
            writer.close()

        await asyncio.gather(upstream(), downstream(), return_exceptions=True)

    async def stop(self) -> None:
        self._server.close()
        for writer in self._writers:
            writer.transport.abort()


def _status(url: str) -> tuple[str, int]:
    conn = connect_sync(url)
    try:
        with conn.cursor() as cursor:
            cursor.execute("SELECT status, attempts FROM outbox")
            status, attempts = cursor.fetchone()
            return str(status), int(attempts)
    finally:
        conn.close()


async def test_a_claim_whose_commit_the_bound_cut_is_released_not_recovered(
    mysql_url: str,
) -> None:
    enqueue(mysql_url, ("order.placed", "k"))
    swallower = _CommitSwallower(urlsplit(mysql_url).port or 3306)
    store = create_store(_through(mysql_url, await swallower.start()))
    assert isinstance(store, MySQLStore)
    store.statement_timeout = BOUND
    try:
        await store.ping()
        swallower.armed = True
        async with asyncio.timeout(GIVE_UP):
            with pytest.raises(StoreError, match=r"did not answer within 0\.5s \(COMMIT\)"):
                # The lease as long as the bound, as by default (60 s each).
                await store.claim("default", "relay-1", 10, BOUND, False)
        assert swallower.swallowed
        assert _status(mysql_url) == ("PROCESSING", 0)  # the COMMIT went through
        again = await store.claim("default", "relay-1", 10, 30.0, False)
        # Before: recovered alone from the expired lease, an attempt counted.
        assert [m.attempts for m in again] == [0]
        assert not again.recovered
    finally:
        await store.close()
        await swallower.stop()
