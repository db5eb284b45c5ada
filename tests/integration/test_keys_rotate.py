"""Key rotation and crypto-shredding on the real PostgreSQL, MariaDB and SQLite outbox tables."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from outboxer import Outbox
from outboxer.claimcheck import HEADER_CLAIM_CHECK, ClaimCheck, FileObjectStore, fetch_payload
from outboxer.crypto import (
    FileSubjectKeys,
    KeyRing,
    SubjectKeyDeletedError,
    decrypt,
    generate_key,
)
from outboxer.payload_admin import PayloadTable, connect, payload_table
from tests.integration.test_enqueue_protection import raw_rows, writer

K1, K2 = generate_key(), generate_key()


@pytest.fixture(params=["postgres", "mysql", "sqlite"])
def db_url(request: pytest.FixtureRequest) -> str:
    fixture = {"postgres": "pg_url", "mysql": "mysql_url", "sqlite": "sqlite_url"}[request.param]
    url: str = request.getfixturevalue(fixture)
    return url


def execute(url: str, sql: str, *params: object) -> None:
    """One statement in its own transaction (``?`` placeholders on every database)."""
    conn = connect(url)
    try:
        if not url.startswith("sqlite"):
            sql = sql.replace("?", "%s")
        table = "outboxer.outbox" if url.startswith("postgres") else "outbox"
        conn.cursor().execute(sql.replace("{outbox}", table), params)
        conn.commit()
    finally:
        conn.close()


def test_rotation_re_encrypts_unfinished_rows_and_keeps_every_message_readable(
    db_url: str, tmp_path: Path
) -> None:
    subjects = FileSubjectKeys(tmp_path / "subjects")
    store = FileObjectStore(tmp_path / "claims")
    old_ring = KeyRing({"k1": K1}, subjects=subjects)
    outbox = Outbox(encryption=old_ring, claim_check=ClaimCheck(store, threshold=200))
    conn = writer(db_url)
    try:
        sent = [
            outbox.enqueue(conn, "small", {"n": n}, subject="user-1" if n == 1 else None)
            for n in range(5)
        ]
        big = outbox.enqueue(conn, "big", {"blob": "x" * 500})
        shredded = outbox.enqueue(conn, "gone", {"n": 99}, subject="user-2")
        conn.commit()
    finally:
        conn.close()
    published, processing, failed = sent[2], sent[3], sent[4]
    execute(db_url, "UPDATE {outbox} SET status = 'PUBLISHED' WHERE id = ?", str(published.id))
    execute(db_url, "UPDATE {outbox} SET status = 'PROCESSING' WHERE id = ?", str(processing.id))
    execute(db_url, "UPDATE {outbox} SET status = 'FAILED' WHERE id = ?", str(failed.id))
    old_object = raw_rows(db_url)[5].headers[HEADER_CLAIM_CHECK]
    subjects.delete("user-2")

    new_ring = KeyRing({"k1": K1, "k2": K2}, subjects=subjects)
    with payload_table(db_url) as table:
        batches: list[int] = []
        result = table.rotate(
            new_ring,
            batch=2,
            claim_check=ClaimCheck(store),
            progress=lambda done: batches.append(done.rotated),
        )
    assert (result.rotated, result.shredded, result.failed) == (4, 1, [])
    assert batches == [2, 4, 4], "bounded batches, each committed on its own"

    only_k2 = KeyRing({"k2": K2}, subjects=subjects)
    rows = {row.id: row for row in raw_rows(db_url)}
    for message in (sent[0], sent[1], failed, big):
        row = rows[message.id]
        assert row.headers["outboxer-key-id"] == "k2"
        restored = decrypt(fetch_payload(row, store), only_k2)
        assert restored.payload == message.payload
    for untouched in (published, processing):
        assert rows[untouched.id].headers["outboxer-key-id"] == "k1"
        assert decrypt(rows[untouched.id], old_ring).payload == untouched.payload
    with pytest.raises(SubjectKeyDeletedError):
        decrypt(rows[shredded.id], new_ring)

    new_object = rows[big.id].headers[HEADER_CLAIM_CHECK]
    assert new_object != old_object
    assert {stored.name for stored in store.list_objects()} == {new_object}, (
        "the old object went once the new reference committed"
    )

    with payload_table(db_url) as table:
        again = table.rotate(new_ring, batch=2, claim_check=ClaimCheck(store))
    assert (again.rotated, again.shredded) == (0, 1), "nothing left under the old key"


@pytest.mark.parametrize("fixture", ["pg_url", "mysql_url"])
def test_a_row_claimed_during_the_batch_keeps_the_bytes_the_relay_read(
    fixture: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    url: str = request.getfixturevalue(fixture)
    ring = KeyRing({"k1": K1})
    conn = writer(url)
    try:
        message = Outbox(encryption=ring).enqueue(conn, "t", {"n": 1})
        conn.commit()
    finally:
        conn.close()
    [before] = raw_rows(url)

    original = PayloadTable._reencrypt

    def claimed_meanwhile(*args: Any) -> Any:
        # A relay claims the row after the batch read it, before the batch updates it.
        execute(url, "UPDATE {outbox} SET status = 'PROCESSING' WHERE id = ?", str(message.id))
        return original(*args)

    monkeypatch.setattr(PayloadTable, "_reencrypt", staticmethod(claimed_meanwhile))
    with payload_table(url) as table:
        result = table.rotate(KeyRing({"k1": K1, "k2": K2}))
    assert (result.rotated, result.skipped) == (0, 1)
    [after] = raw_rows(url)
    assert after.payload == before.payload and after.headers["outboxer-key-id"] == "k1"


def test_the_sweep_keeps_objects_of_rows_in_any_status(db_url: str, tmp_path: Path) -> None:
    store = FileObjectStore(tmp_path / "claims")
    outbox = Outbox(claim_check=ClaimCheck(store, threshold=10))
    conn = writer(db_url)
    try:
        published = outbox.enqueue(conn, "t", {"blob": "y" * 100})
        outbox.enqueue(conn, "t", {"blob": "z" * 100})
        conn.commit()
    finally:
        conn.close()
    execute(db_url, "UPDATE {outbox} SET status = 'PUBLISHED' WHERE id = ?", str(published.id))
    with payload_table(db_url) as table:
        assert table.sweep(store, grace=0) == 0
    assert len(list(store.list_objects())) == 2
    assert [
        json.loads(fetch_payload(row, store).payload)["blob"][0] for row in raw_rows(db_url)
    ] == [
        "y",
        "z",
    ]
