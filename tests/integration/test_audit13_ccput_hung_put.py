"""A claim-check put that hangs (an S3 endpoint that accepts the connection and never
answers: a private TCP listener) used to hold the caller's open transaction, its row
locks and outboxer's key lock, for botocore's 60 s read timeout times its 3 attempts, and a
hung file store (a dead NFS mount) for ever. ClaimCheck's ``put_timeout`` bounds it: the
enqueue raises ClaimCheckStoreError (ETIMEDOUT), writes no row, the transaction stays
usable, and an object that lands after the caller gave up is deleted."""

from __future__ import annotations

import asyncio
import errno
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import psycopg
import pytest

from outboxer import Outbox
from outboxer.claimcheck import ClaimCheck, ClaimCheckStoreError, FileObjectStore, S3ObjectStore
from tests.s3 import CREDENTIALS, REGION, silent_listener

BIG = {"blob": "x" * 5000}
TIMEOUT = 0.5


@pytest.fixture
def hung_s3() -> Iterator[S3ObjectStore]:
    """An S3 store whose endpoint accepts connections and never answers."""
    with silent_listener() as endpoint:
        yield S3ObjectStore(
            "bucket", endpoint_url=f"http://{endpoint}", region=REGION, **CREDENTIALS
        )


def _check_timed_out(error: ClaimCheckStoreError, store: object, elapsed: float) -> None:
    assert error.errno == errno.ETIMEDOUT
    assert isinstance(error, OSError)
    assert error.store == repr(store)
    assert f"{TIMEOUT:g} s" in str(error)
    assert TIMEOUT <= elapsed < TIMEOUT + 1.5, elapsed


def test_a_hung_s3_put_fails_a_psycopg_enqueue_within_put_timeout(
    pg_url: str, hung_s3: S3ObjectStore
) -> None:
    outbox = Outbox(claim_check=ClaimCheck(hung_s3, threshold=1000, put_timeout=TIMEOUT))
    with psycopg.connect(pg_url) as conn:
        started = time.monotonic()
        with pytest.raises(ClaimCheckStoreError) as raised:
            outbox.enqueue(conn, "report.ready", BIG, key="k")
        _check_timed_out(raised.value, hung_s3, time.monotonic() - started)
        # No row, and the transaction still takes statements: the caller decides.
        assert conn.execute("SELECT count(*) FROM outboxer.outbox").fetchone() == (0,)
        conn.rollback()


def test_a_hung_s3_put_fails_a_sqlite_enqueue_within_put_timeout(
    sqlite_url: str, hung_s3: S3ObjectStore
) -> None:
    outbox = Outbox(claim_check=ClaimCheck(hung_s3, threshold=1000, put_timeout=TIMEOUT))
    conn = sqlite3.connect(sqlite_url.removeprefix("sqlite:///"))
    try:
        conn.execute("BEGIN IMMEDIATE")
        started = time.monotonic()
        with pytest.raises(ClaimCheckStoreError) as raised:
            outbox.enqueue(conn, "report.ready", BIG)
        _check_timed_out(raised.value, hung_s3, time.monotonic() - started)
        assert conn.execute("SELECT count(*) FROM outbox").fetchone() == (0,)
        conn.rollback()
    finally:
        conn.close()


@pytest.mark.parametrize("driver", ["asyncpg", "psycopg"])
async def test_a_hung_s3_put_fails_an_async_enqueue_without_stalling_the_loop(
    pg_url: str, hung_s3: S3ObjectStore, driver: str
) -> None:
    outbox = Outbox(claim_check=ClaimCheck(hung_s3, threshold=1000, put_timeout=TIMEOUT))
    worst = 0.0
    stop = asyncio.Event()

    async def ticker() -> None:
        nonlocal worst
        last = time.monotonic()
        while not stop.is_set():
            await asyncio.sleep(0.01)
            now = time.monotonic()
            worst = max(worst, now - last)
            last = now

    ticking = asyncio.create_task(ticker())
    if driver == "asyncpg":
        conn = await asyncpg.connect(pg_url)
        try:
            async with conn.transaction():
                started = time.monotonic()
                with pytest.raises(ClaimCheckStoreError) as raised:
                    await outbox.enqueue_async(conn, "report.ready", BIG)
                elapsed = time.monotonic() - started
                assert await conn.fetchval("SELECT count(*) FROM outboxer.outbox") == 0
        finally:
            await conn.close()
    else:
        async with await psycopg.AsyncConnection.connect(pg_url) as aconn:
            started = time.monotonic()
            with pytest.raises(ClaimCheckStoreError) as raised:
                await outbox.enqueue_async(aconn, "report.ready", BIG)
            elapsed = time.monotonic() - started
            cursor = await aconn.execute("SELECT count(*) FROM outboxer.outbox")
            assert await cursor.fetchone() == (0,)
            await aconn.rollback()
    stop.set()
    await ticking
    _check_timed_out(raised.value, hung_s3, elapsed)
    assert worst < 0.2, f"the event loop stalled {worst:.3f} s"


class _StalledDirectory(FileObjectStore):
    """A real directory store whose puts wait for ``release`` first (a stalled mount)."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.release = threading.Event()
        self.stored = threading.Event()

    def put(self, name: str, data: bytes) -> None:
        self.release.wait(10)
        super().put(name, data)
        self.stored.set()


def test_an_object_that_lands_after_the_put_timed_out_is_deleted(
    pg_url: str, tmp_path: Path
) -> None:
    store = _StalledDirectory(tmp_path / "claims")
    outbox = Outbox(claim_check=ClaimCheck(store, threshold=1000, put_timeout=TIMEOUT))
    with psycopg.connect(pg_url) as conn:
        with pytest.raises(ClaimCheckStoreError) as raised:
            outbox.enqueue(conn, "report.ready", BIG, message_id=uuid.uuid4())
        conn.rollback()
    assert raised.value.errno == errno.ETIMEDOUT
    store.release.set()
    assert store.stored.wait(5)
    deadline = time.monotonic() + 5
    while any(store.directory.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert list(store.directory.iterdir()) == []


def test_put_timeout_must_be_positive(tmp_path: Path) -> None:
    from outboxer.errors import ConfigError

    with pytest.raises(ConfigError):
        ClaimCheck(FileObjectStore(tmp_path), put_timeout=0)


def test_asyncio_run_returns_after_an_async_enqueue_whose_put_hung(
    pg_url: str, hung_s3: S3ObjectStore
) -> None:
    """The put went through asyncio's default executor, which asyncio.run joins at its end:
    a program whose enqueue_async gave up on a hung store never exited."""
    outbox = Outbox(claim_check=ClaimCheck(hung_s3, threshold=1000, put_timeout=TIMEOUT))
    raised: list[BaseException] = []

    async def main() -> None:
        async with await psycopg.AsyncConnection.connect(pg_url) as aconn:
            try:
                await outbox.enqueue_async(aconn, "report.ready", BIG)
            except ClaimCheckStoreError as exc:
                raised.append(exc)

    program = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    program.start()
    program.join(5)
    assert not program.is_alive(), "asyncio.run did not return"
    assert [type(e) for e in raised] == [ClaimCheckStoreError]
