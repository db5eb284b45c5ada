"""`outboxer keys rotate` and the PostgreSQL log mode (``<table>_log``, append-only).

The log's rows are never re-encrypted, so a rotation that reported success while some of
them, not yet relayed, were under the old key let the operator retire a key the log's relay
still needed: those messages then failed for good. It now counts them and exits non-zero.
"""

from __future__ import annotations

import asyncio

import psycopg
import pytest

from outboxer.cli import EXIT_ERROR, EXIT_OK, main
from outboxer.crypto import KeyNotFoundError, KeyRing, decrypt, generate_key
from outboxer.enqueue import Outbox
from outboxer.message import Message
from outboxer.payload_admin import payload_table
from outboxer.stores.pglog import LogOffset, PgLog

K1, K2 = generate_key(), generate_key()


def _offsets(url: str) -> list[LogOffset]:
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT order_xid::text, position FROM outboxer.outbox_log ORDER BY order_xid, position"
        ).fetchall()
    return [LogOffset(int(xid), int(position)) for xid, position in rows]


def _seek(url: str, offset: LogOffset) -> None:
    async def seek() -> None:
        async with PgLog(url) as log:
            await log.seek("default", offset=offset)

    asyncio.run(seek())


def _log_rows(url: str) -> list[Message]:
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT id, topic, payload, headers, content_type FROM outboxer.outbox_log "
            "ORDER BY order_xid, position"
        ).fetchall()
    return [
        Message(
            id=row[0],
            topic=row[1],
            payload=bytes(row[2]),
            headers=row[3],
            content_type=row[4],
            destination="default",
        )
        for row in rows
    ]


def _apply_log_schema(url: str) -> None:
    async def apply() -> None:
        async with PgLog(url) as log:
            await log.apply_schema()

    asyncio.run(apply())


def _run(capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["keys", "rotate"])
    out, err = capsys.readouterr()
    return code, out, err


def test_rotation_fails_loudly_while_unrelayed_log_rows_are_under_an_old_key(
    pg_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _apply_log_schema(pg_url)
    old = KeyRing({"k1": K1})
    with psycopg.connect(pg_url) as conn:
        for n in range(3):
            Outbox(mode="log", encryption=old).enqueue(conn, "orders", {"n": n})
        Outbox(encryption=old).enqueue(conn, "orders", {"n": 99})  # the plain table

    monkeypatch.setenv("OUTBOXER_DB", pg_url)
    monkeypatch.setenv("OUTBOXER_ENCRYPTION_KEYS", f"k1={K1},k2={K2}")

    # No reader has registered yet: a reader starts at the beginning, so all three count.
    code, out, err = _run(capsys)
    assert out.splitlines()[0] == "re-encrypted 1 message(s) under key k2"
    assert code == EXIT_ERROR, (out, err)
    assert "3 log-mode message(s) in outboxer.outbox_log" in err
    assert "k1 (3)" in err and "keep those keys in the ring" in err

    # The reader relayed the first row: two remain unrelayed, one only a replay needs.
    offsets = _offsets(pg_url)
    _seek(pg_url, offsets[0])
    with payload_table(pg_url) as table:
        result = table.rotate(KeyRing({"k1": K1, "k2": K2}))
    assert (result.rotated, result.log_unrelayed, result.log_relayed) == (0, {"k1": 2}, {"k1": 1})
    code, out, err = _run(capsys)
    assert code == EXIT_ERROR
    assert "2 log-mode message(s)" in err and "k1 (2)" in err
    assert "1 relayed log-mode message(s)" in out

    # What the error protects: the log was not rewritten, and without k1 its rows are lost.
    rows = _log_rows(pg_url)
    assert [row.headers["outboxer-key-id"] for row in rows] == ["k1", "k1", "k1"]
    with pytest.raises(KeyNotFoundError):
        decrypt(rows[2], KeyRing({"k2": K2}))
    assert decrypt(rows[2], old).payload == b'{"n":2}'

    # Every row relayed: k1 may go (a replay of the retained rows would still need it).
    _seek(pg_url, offsets[-1])
    code, out, err = _run(capsys)
    assert (code, err) == (EXIT_OK, "")
    assert "3 relayed log-mode message(s)" in out and "k1 (3)" in out


def test_log_rows_under_the_current_key_or_unencrypted_are_not_counted(
    pg_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _apply_log_schema(pg_url)
    with psycopg.connect(pg_url) as conn:
        Outbox(mode="log", encryption=KeyRing({"k2": K2})).enqueue(conn, "orders", {"n": 1})
        Outbox(mode="log").enqueue(conn, "orders", {"n": 2})
    monkeypatch.setenv("OUTBOXER_DB", pg_url)
    monkeypatch.setenv("OUTBOXER_ENCRYPTION_KEYS", f"k1={K1},k2={K2}")
    assert _run(capsys) == (EXIT_OK, "re-encrypted 0 message(s) under key k2\n", "")
