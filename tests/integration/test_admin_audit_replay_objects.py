"""One ReplayCopier serves every database of a replay (``outboxer replay`` and ``POST
/messages/replay`` with several databases): a later database's failed replay must delete
only the claim-check objects of its own rolled-back copies, never those of the copies an
earlier database committed, and count only its own shredded messages; a cancelled replay
must not delete objects that copies its store still commits refer to. On the real
PostgreSQL, MariaDB and SQLite."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from pathlib import Path

import psycopg
import pytest

from outboxer import Outbox, admin
from outboxer.admin import MessageFilter, ReplayCopier
from outboxer.claimcheck import ClaimCheck, ClaimCheckError, FileObjectStore, fetch_payload
from outboxer.crypto import FileSubjectKeys, KeyRing, generate_key
from outboxer.errors import ReplayError
from outboxer.stores import create_store
from outboxer.stores.sqlite import sqlite_path
from tests.conftest import mysql_connect


async def test_a_failed_replay_keeps_the_objects_of_another_databases_committed_copies(
    pg_url: str, mysql_url: str, tmp_path: Path
) -> None:
    objects = FileObjectStore(tmp_path / "claims")
    with psycopg.connect(pg_url) as conn:  # a claim-checked message, published
        Outbox(claim_check=ClaimCheck(objects, threshold=10)).enqueue(conn, "t", {"x": "y" * 40})
        conn.execute("UPDATE outboxer.outbox SET status = 'PUBLISHED'")
    conn = mysql_connect(mysql_url)  # an encrypted one, which a copier without keys refuses
    try:
        Outbox(encryption=KeyRing({"k1": generate_key()})).enqueue(conn, "t", {"n": 2})
        conn.cursor().execute("UPDATE outbox SET status = 'PUBLISHED'")
        conn.commit()
    finally:
        conn.close()

    copier = ReplayCopier(object_store=objects)
    async with create_store(pg_url) as store:
        first = await admin.replay(store, MessageFilter(), everything=True, copier=copier)
        [copy] = [m for m in await store.list_messages(["PENDING"], 10)]
    assert first.count == 1
    async with create_store(mysql_url) as store:
        with pytest.raises(ReplayError, match="is encrypted"):
            await admin.replay(store, MessageFilter(), everything=True, copier=copier)

    async with create_store(pg_url) as store:
        claim = await store.claim("default", "relay-a", 10, 60.0, False)
    [pending] = list(claim)
    assert pending.id == copy["id"]
    try:
        fetched = fetch_payload(pending, objects)
    except ClaimCheckError as exc:
        pytest.fail(f"the committed copy lost its object: {exc}")
    assert fetched.payload == b'{"x":"' + b"y" * 40 + b'"}'


async def test_each_databases_replay_counts_only_its_own_shredded_messages(
    pg_url: str, mysql_url: str, tmp_path: Path
) -> None:
    ring = KeyRing({"k1": generate_key()}, subjects=FileSubjectKeys(tmp_path / "subjects"))
    with psycopg.connect(pg_url) as conn:  # alice's message, published, then her key shredded
        Outbox(encryption=ring).enqueue(conn, "t", {"n": 1}, subject="alice")
        conn.execute("UPDATE outboxer.outbox SET status = 'PUBLISHED'")
    ring.shred("alice")
    conn = mysql_connect(mysql_url)  # nobody's message
    try:
        Outbox().enqueue(conn, "t", {"n": 2})
        conn.cursor().execute("UPDATE outbox SET status = 'PUBLISHED'")
        conn.commit()
    finally:
        conn.close()

    copier = ReplayCopier(keyring=ring)
    results = []
    for url in (pg_url, mysql_url):
        async with create_store(url) as store:
            results.append(
                await admin.replay(store, MessageFilter(), everything=True, copier=copier)
            )
    assert [(r.count, r.shredded) for r in results] == [(0, 1), (1, 0)]
    assert "not copied" not in "\n".join(results[1].lines())


class _GatedStore(FileObjectStore):
    """Puts the second copy's object only once the test lets it (the first goes at once)."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.puts = 0
        self.waiting, self.go_on = threading.Event(), threading.Event()

    def put(self, name: str, data: bytes) -> None:
        self.puts += 1
        if self.puts == 2:
            self.waiting.set()
            assert self.go_on.wait(30)
        super().put(name, data)


async def test_a_cancelled_replay_leaves_the_objects_its_store_may_still_commit(
    sqlite_url: str, tmp_path: Path
) -> None:
    """SQLite copies in a worker thread, which a cancelled replay (Ctrl-C, a request cut
    short) does not stop: the copies it commits afterwards must find their objects."""
    conn = sqlite3.connect(sqlite_path(sqlite_url))
    try:
        outbox = Outbox(claim_check=ClaimCheck(FileObjectStore(tmp_path / "claims"), threshold=10))
        for n in range(2):
            outbox.enqueue(conn, "t", {"n": n, "x": "y" * 40})
        conn.execute("UPDATE outbox SET status = 'PUBLISHED'")
        conn.commit()
    finally:
        conn.close()
    objects = _GatedStore(tmp_path / "claims")

    async with create_store(sqlite_url) as store:
        copier = ReplayCopier(object_store=objects)
        replay = asyncio.create_task(
            admin.replay(store, MessageFilter(), everything=True, copier=copier)
        )
        assert await asyncio.to_thread(objects.waiting.wait, 30)
        replay.cancel()
        with pytest.raises(asyncio.CancelledError):
            await replay
        objects.go_on.set()
        # The next statement waits for the replay's thread to finish (one connection).
        claim = await store.claim("default", "relay-a", 10, 60.0, False)
    copies = list(claim)
    assert copies, "the worker thread committed its copies after the cancel"
    for copy in copies:
        try:
            fetch_payload(copy, objects)
        except ClaimCheckError as exc:
            pytest.fail(f"a committed copy lost its object: {exc}")
