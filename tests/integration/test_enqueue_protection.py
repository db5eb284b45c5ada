"""Encryption and claim-check on the write path, against the real PostgreSQL, MariaDB and SQLite:
the raw rows hold ciphertext only, and a rolled-back enqueue's object is swept."""

from __future__ import annotations

import dataclasses
import json
import os
import sqlite3
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from outboxer import Message, Outbox, PayloadError
from outboxer.claimcheck import (
    HEADER_CLAIM_CHECK,
    ClaimCheck,
    FileObjectStore,
    fetch_payload,
)
from outboxer.crypto import DecryptionError, KeyRing, MemorySubjectKeys, decrypt, generate_key
from outboxer.errors import ConfigError
from outboxer.payload_admin import connect, payload_table
from outboxer.stores.sqlite import sqlite_path
from tests.conftest import aiomysql_connect, mysql_connect

SECRET = "card 4111-1111-1111-1111 of alice@example.com"
SEALED = "sealed-header-value-8c1f"


@pytest.fixture(params=["postgres", "mysql", "sqlite"])
def db_url(request: pytest.FixtureRequest) -> str:
    fixture = {"postgres": "pg_url", "mysql": "mysql_url", "sqlite": "sqlite_url"}[request.param]
    url: str = request.getfixturevalue(fixture)
    return url


def writer(url: str) -> Any:
    """An application's connection, a transaction opened by its first statement."""
    if url.startswith("sqlite"):
        return sqlite3.connect(sqlite_path(url))
    if url.startswith("mysql"):
        return mysql_connect(url)
    import psycopg

    return psycopg.connect(url)


def raw_rows(url: str) -> list[Message]:
    """The rows exactly as stored, as messages (headers as the database's text)."""
    headers = "headers::text" if url.startswith("postgres") else "headers"
    table = "outboxer.outbox" if url.startswith("postgres") else "outbox"
    conn = connect(url)
    try:
        cursor = conn.cursor()
        cursor.execute(
            f"SELECT id, destination, topic, payload, content_type, {headers} "
            f"FROM {table} ORDER BY seq"
        )
        rows = cursor.fetchall()
    finally:
        conn.close()
    return [
        Message(
            id=uuid.UUID(str(identifier)),
            destination=destination,
            topic=topic,
            payload=bytes(payload),
            content_type=content_type,
            headers=json.loads(text),
        )
        for identifier, destination, topic, payload, content_type, text in rows
    ]


def keyring() -> KeyRing:
    return KeyRing({"k1": generate_key()}, subjects=MemorySubjectKeys())


def age(store: FileObjectStore, name: str, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(store.directory / name, (then, then))


def test_the_raw_rows_hold_no_plaintext(db_url: str) -> None:
    ring = keyring()
    outbox = Outbox(
        destinations=("internal", "partner"), encryption=ring, seal_headers=("customer",)
    )
    conn = writer(db_url)
    try:
        sent = outbox.enqueue(
            conn,
            "card.added",
            {"card": SECRET},
            key="user-7",
            headers={"customer": SEALED, "trace": "t-1"},
            subject="user-7",
        )
        conn.commit()
    finally:
        conn.close()

    assert json.loads(sent.payload) == {"card": SECRET}, "the caller gets its plaintext back"
    rows = raw_rows(db_url)
    assert [row.destination for row in rows] == ["internal", "partner"]
    for row in rows:
        stored_text = row.payload + json.dumps(dict(row.headers)).encode()
        assert b"4111" not in stored_text and b"alice" not in stored_text
        assert SEALED.encode() not in stored_text
        assert row.content_type == "application/octet-stream"
        assert row.headers["outboxer-key-id"] == "k1"
        assert row.headers["outboxer-subject"] == "user-7"
        assert row.headers["trace"] == "t-1", "headers stay plaintext unless sealed"
        plain = decrypt(row, ring)
        assert json.loads(plain.payload) == {"card": SECRET}
        assert plain.headers == {"customer": SEALED, "trace": "t-1"}
        assert plain.content_type == "application/json"
    internal, partner = rows
    assert internal.payload != partner.payload, "each destination's copy is encrypted apart"
    with pytest.raises(DecryptionError):
        decrypt(Message(**{**_fields(partner), "payload": internal.payload}), ring)


def _fields(message: Message) -> dict[str, Any]:
    return {name: getattr(message, name) for name in Message.__slots__}


def test_a_rolled_back_enqueue_leaves_an_orphan_the_sweep_removes(
    db_url: str, tmp_path: Path
) -> None:
    store = FileObjectStore(tmp_path / "claims")
    outbox = Outbox(encryption=keyring(), claim_check=ClaimCheck(store, threshold=64))
    big = {"blob": SECRET * 20}
    conn = writer(db_url)
    try:
        kept = outbox.enqueue(conn, "big", big)
        conn.commit()
        outbox.enqueue(conn, "big", big)
        conn.rollback()
    finally:
        conn.close()

    [row] = raw_rows(db_url)
    assert row.id == kept.id and row.payload == b""
    objects = [stored.name for stored in store.list_objects()]
    assert len(objects) == 2, "both objects were written before their INSERT"
    assert all(b"4111" not in store.get(name) for name in objects), "objects hold ciphertext"
    for name in objects:
        age(store, name, 7200)

    with payload_table(db_url) as table:
        assert table.sweep(store, grace=3600) == 1
    assert [stored.name for stored in store.list_objects()] == [row.headers[HEADER_CLAIM_CHECK]]
    assert json.loads(decrypt(fetch_payload(row, store), outbox.encryption).payload) == big  # type: ignore[arg-type]


@pytest.fixture(params=["asyncpg", "aiomysql"])
def async_driver(request: pytest.FixtureRequest) -> tuple[str, str]:
    fixture = "pg_url" if request.param == "asyncpg" else "mysql_url"
    return request.param, request.getfixturevalue(fixture)


async def test_enqueue_async_offloads_the_ciphertext_before_the_insert(
    async_driver: tuple[str, str], tmp_path: Path
) -> None:
    driver, url = async_driver
    store = FileObjectStore(tmp_path / "claims")
    ring = keyring()
    outbox = Outbox(
        destinations=("a", "b"), encryption=ring, claim_check=ClaimCheck(store, threshold=256)
    )
    big = {"blob": SECRET * 20}
    items = [{"topic": "big", "payload": big}, {"topic": "small", "payload": {"n": 1}}]
    if driver == "asyncpg":
        import asyncpg

        conn = await asyncpg.connect(url)
        async with conn.transaction():
            await outbox.enqueue_many_async(conn, items)
        await conn.close()
    else:
        conn = await aiomysql_connect(url)
        await outbox.enqueue_many_async(conn, items)
        await conn.commit()
        conn.close()

    rows = raw_rows(url)
    assert [(row.topic, row.destination) for row in rows] == [
        ("big", "a"),
        ("big", "b"),
        ("small", "a"),
        ("small", "b"),
    ]
    big_a, big_b, small_a, _ = rows
    assert big_a.payload == b"" and HEADER_CLAIM_CHECK in big_a.headers
    assert big_a.headers[HEADER_CLAIM_CHECK] != big_b.headers[HEADER_CLAIM_CHECK]
    assert HEADER_CLAIM_CHECK not in small_a.headers and small_a.payload
    for row in (big_a, big_b):
        assert b"4111" not in store.get(row.headers[HEADER_CLAIM_CHECK])
        assert json.loads(decrypt(fetch_payload(row, store), ring).payload) == big


def test_max_payload_bytes_counts_the_plaintext_and_refuses_before_any_write(
    sqlite_url: str, tmp_path: Path
) -> None:
    store = FileObjectStore(tmp_path / "claims")
    outbox = Outbox(
        encryption=keyring(), claim_check=ClaimCheck(store, threshold=10), max_payload_bytes=100
    )
    conn = writer(sqlite_url)
    try:
        outbox.enqueue(conn, "t", b"x" * 100)  # the ciphertext is 128 bytes: still accepted
        with pytest.raises(PayloadError, match="max_payload_bytes=100"):
            outbox.enqueue(conn, "t", b"x" * 101)
        conn.commit()
    finally:
        conn.close()
    assert len(raw_rows(sqlite_url)) == 1
    assert len(list(store.list_objects())) == 1, "the refused payload never reached the store"


def test_protection_options_are_checked_at_the_boundary(sqlite_url: str) -> None:
    with pytest.raises(PayloadError, match="subject= needs an outbox with encryption"):
        Outbox().build("t", {}, subject="user-1")
    with pytest.raises(PayloadError, match="subject must be"):
        Outbox(encryption=keyring()).build("t", {}, subject="")
    with pytest.raises(ConfigError, match="seal_headers needs encryption"):
        Outbox(seal_headers=True)
    with pytest.raises(ConfigError, match="encryption must be a KeyRing"):
        Outbox(encryption="k1=abc")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="claim_check must be a ClaimCheck"):
        Outbox(claim_check="file:///tmp/x")  # type: ignore[arg-type]
    # enqueue refuses outboxer-* headers itself; a message that holds one all the same
    # (built by hand) is refused by protect too.
    forged = [
        dataclasses.replace(m, headers={"outboxer-key-id": "forged"})
        for m in Outbox().build("t", {})
    ]
    with pytest.raises(PayloadError, match="encryption headers"):
        Outbox(encryption=keyring()).protect(forged)


def test_modes_that_store_one_copy_refuse_what_binds_copies_to_their_destination(
    tmp_path: Path,
) -> None:
    """The log, WAL and Debezium modes store one copy of a message for all its destinations;
    encryption and claim-check bind each copy to its own, so every destination but the
    first would get a copy it cannot read. And only the table and log modes keep a row that
    refers to a claim-checked object: in the others the orphan sweep would delete it."""
    checked = ClaimCheck(FileObjectStore(tmp_path), threshold=10)
    for mode in ("log", "wal", "debezium"):
        with pytest.raises(ConfigError, match="stores one copy of a message"):
            Outbox(mode=mode, encryption=keyring(), destinations=("a", "b"))
        one = Outbox(mode=mode, encryption=keyring())
        with pytest.raises(ConfigError, match="stores one copy of a message"):
            one.build("t", {}, destinations=["a", "b"])
        assert [m.destination for m in one.build("t", {}, destinations=["b"])] == ["b"]
    for mode in ("wal", "debezium"):
        with pytest.raises(ConfigError, match="claim_check needs mode 'table' or 'log'"):
            Outbox(mode=mode, claim_check=checked)
    Outbox(mode="log", claim_check=checked)  # one destination: its row refers to the object
    Outbox(mode="log", destinations=("a", "b"))  # no protection: one copy serves them all
