"""Replaying protected payloads on the real PostgreSQL, MariaDB and SQLite: each copy is
encrypted for its own id and has an object of its own, so the relay publishes it and a
consumer reads it after retention took the original and its object; a shredded subject's
message is not copied; a replay that cannot copy a row writes nothing, objects included."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest

from outboxer import Outbox, Relay, admin, load_settings
from outboxer.admin import HEADER_REPLAY_OF, MessageFilter, ReplayCopier
from outboxer.brokers.memory import memory_broker
from outboxer.claimcheck import (
    HEADER_CLAIM_CHECK,
    ClaimCheck,
    FileObjectStore,
    fetch_payload,
    sweep_orphans,
)
from outboxer.crypto import FileSubjectKeys, KeyRing, decrypt, generate_key
from outboxer.errors import ReplayError
from outboxer.payload_admin import payload_table
from outboxer.stores import create_store
from outboxer.stores.sqlite import sqlite_path
from tests.conftest import mysql_connect

K1 = generate_key()


@pytest.fixture(params=["sqlite", "postgres", "mysql"])
def db_url(request: pytest.FixtureRequest) -> str:
    fixture = {"sqlite": "sqlite_url", "postgres": "pg_url", "mysql": "mysql_url"}[request.param]
    return str(request.getfixturevalue(fixture))


def connect_sync(url: str) -> Any:
    if url.startswith("sqlite"):
        import sqlite3

        return sqlite3.connect(sqlite_path(url))
    if url.startswith("mysql"):
        return mysql_connect(url)
    import psycopg

    return psycopg.connect(url)


def settings_for(db_url: str, broker: str, tmp_path: Path) -> Any:
    return load_settings(
        {
            "db": db_url,
            "broker": f"memory://{broker}",
            "claim_check_store": f"file://{tmp_path / 'claims'}",
            "subject_keys": str(tmp_path / "subjects"),
            "exit_when_idle": True,
            "poll_interval": 0.05,
        },
        environ={"OUTBOXER_ENCRYPTION_KEYS": f"k1={K1}"},
    )


async def test_replayed_copies_are_protected_for_themselves_and_outlive_the_originals(
    db_url: str, tmp_path: Path
) -> None:
    broker = memory_broker(f"replay-{uuid.uuid4().hex[:8]}")
    settings = settings_for(db_url, broker.name, tmp_path)
    objects = FileObjectStore(tmp_path / "claims")
    subjects = FileSubjectKeys(tmp_path / "subjects")
    ring = KeyRing({"k1": K1}, subjects=subjects)
    sealed = Outbox(
        encryption=ring,
        seal_headers=("secret",),
        claim_check=ClaimCheck(objects, threshold=200),
    )
    plain = Outbox(claim_check=ClaimCheck(objects, threshold=200))
    conn = connect_sync(db_url)
    try:
        big = sealed.enqueue(
            conn, "big", {"blob": "x" * 400}, key="k", headers={"secret": "s", "shown": "v"}
        )
        small = sealed.enqueue(conn, "small", {"n": 2}, key="k", headers={"secret": "t"})
        reference = plain.enqueue(conn, "plain", {"blob": "y" * 400}, key="k")
        forgotten = sealed.enqueue(conn, "forgotten", {"n": 4}, subject="alice")
        conn.commit()
    finally:
        conn.close()
    await Relay.from_settings(settings).run()
    assert len(broker.messages) == 4
    ring.shred("alice")  # after publishing: the copy must not resurrect it
    broker.clear()

    async with create_store(db_url) as store:
        copier = admin.copier_from_settings(settings)
        try:
            result = await admin.replay(store, MessageFilter(), everything=True, copier=copier)
        finally:
            copier.close()
        assert (result.count, result.shredded) == (3, 1)
        # Retention takes the originals, then the sweep their objects (grace 0).
        originals = (big.id, small.id, reference.id, forgotten.id)
        assert (await admin.purge(store, MessageFilter(ids=originals))).count == 4
    with payload_table(db_url) as table:
        assert sweep_orphans(objects, table.referenced, grace=0) == 2

    await Relay.from_settings(settings).run()
    published = {m.topic: m for m in broker.messages}
    assert sorted(published) == ["big", "plain", "small"]
    assert [m.topic for m in broker.messages] == ["big", "small", "plain"], "key k in order"
    for topic, original in (("big", big), ("small", small), ("plain", reference)):
        copy = published[topic]
        assert copy.id != original.id and copy.headers[HEADER_REPLAY_OF] == str(original.id)
    # The relay decrypted the small copy; the claim-checked ones went out as references,
    # read as a consumer reads them: fetch (the object named after the copy), then decrypt.
    assert json.loads(published["small"].payload) == {"n": 2}
    assert published["small"].headers["secret"] == "t", "sealed header restored"
    big_copy = decrypt(fetch_payload(published["big"], objects), ring)
    assert json.loads(big_copy.payload) == {"blob": "x" * 400}
    assert (big_copy.headers["secret"], big_copy.headers["shown"]) == ("s", "v")
    assert published["big"].headers[HEADER_CLAIM_CHECK].startswith(str(published["big"].id))
    plain_copy = fetch_payload(published["plain"], objects)
    assert json.loads(plain_copy.payload) == {"blob": "y" * 400}


async def test_a_replay_that_cannot_copy_a_row_writes_nothing_and_leaves_no_object(
    db_url: str, tmp_path: Path
) -> None:
    objects = FileObjectStore(tmp_path / "claims")
    conn = connect_sync(db_url)
    try:
        Outbox(claim_check=ClaimCheck(objects, threshold=10)).enqueue(conn, "t", {"x": "y" * 20})
        Outbox(encryption=KeyRing({"k1": K1})).enqueue(conn, "t", {"n": 2})
        conn.commit()
    finally:
        conn.close()
    async with create_store(db_url) as store:
        claim = await store.claim("default", "relay-a", 10, 60.0, False)
        await store.settle("default", claim.lease, [m.stored_seq for m in claim], [], [], 5)
        before = sorted(o.name for o in objects.list_objects())
        without_keys = ReplayCopier(object_store=objects)
        with pytest.raises(ReplayError, match=r"encrypted.*OUTBOXER_ENCRYPTION_KEYS"):
            await admin.replay(store, MessageFilter(topics=("t",)), copier=without_keys)
        assert sorted(o.name for o in objects.list_objects()) == before, "its object deleted"
        counts = await store.count_matching(MessageFilter())
        assert counts == {"default": {"PUBLISHED": 2}}, "no copy committed"
        with pytest.raises(ReplayError, match="claim-check store"):
            await admin.replay(store, MessageFilter(topics=("t",)))
