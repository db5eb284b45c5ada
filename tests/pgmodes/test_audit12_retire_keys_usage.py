"""`outboxer keys usage`: which stored messages are under which key, before one is retired.

After `outboxer keys rotate`, an operator removes the old key from the ring. Any stored
ciphertext still under it is then undecryptable for ever, and rotate rewrites only the
outbox table's unfinished rows. There was no way to ask where else an old key is still
needed: the log-mode table, the stream relay's dead letters, the table `schema
migrate-partitioned` left behind, the Debezium-layout table, the consumers' dead letters
(stored encrypted, as they arrived) and the outbox's finished rows. `keys usage` counts them
all, read-only, and with --retiring exits 1 naming where the key is still needed.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import uuid
from typing import Any

import psycopg
import pytest

from outboxer.cli import EXIT_ERROR, EXIT_OK, EXIT_USAGE, main
from outboxer.crypto import KeyRing, generate_key
from outboxer.enqueue import Outbox
from outboxer.payload_admin import key_usage
from outboxer.stores.pgdebezium import PgDebezium
from outboxer.stores.pglog import PgLog
from tests.conftest import mysql_connect

K1, K2 = generate_key(), generate_key()
RING1, RING2 = KeyRing({"k1": K1}), KeyRing({"k1": K1, "k2": K2})


def _headers(key_id: str) -> str:
    return json.dumps({"outboxer-encryption": "A256GCM", "outboxer-key-id": key_id})


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["keys", "usage", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _fill_postgres(url: str) -> None:
    async def apply() -> None:
        async with PgLog(url) as log:  # the log and the stream relay's tables
            await log.apply_schema()
        async with PgDebezium(url) as debezium:
            await debezium.apply_schema()

    asyncio.run(apply())
    with psycopg.connect(url) as conn:
        for ring in (RING1, RING2):
            # outbox: two unfinished under each key, one of which published below
            Outbox(encryption=ring).enqueue(conn, "orders", {"n": 1})
            Outbox(encryption=ring).enqueue(conn, "orders", {"n": 2})
            Outbox(mode="log", encryption=ring).enqueue(conn, "orders", {"n": 3})
        Outbox().enqueue(conn, "orders", {"plain": True})  # unencrypted: not counted
        conn.execute(
            "UPDATE outboxer.outbox SET status = 'PUBLISHED' WHERE seq IN "
            "(SELECT min(seq) FROM outboxer.outbox GROUP BY headers->>'outboxer-key-id')"
        )
        conn.execute("CREATE TABLE outboxer.outbox_plain (LIKE outboxer.outbox INCLUDING DEFAULTS)")
        for key_id, copies in (("k1", 3), ("k2", 1)):
            for n in range(copies):
                conn.execute(
                    "INSERT INTO outboxer.outbox_plain (seq, id, destination, topic, payload, "
                    "content_type, headers, status) VALUES (%s, %s, 'default', 't', '\\x00', "
                    "'application/octet-stream', %s, 'PUBLISHED')",
                    (copies * 10 + n, uuid.uuid4(), _headers(key_id)),
                )
            conn.execute(
                "INSERT INTO outboxer.outbox_stream_dead_letters (mode, destination, seq, "
                "message_id, topic, payload, content_type, headers, error, attempts) "
                "VALUES ('log', 'default', %s, %s, 't', '\\x00', 'application/octet-stream', "
                "%s, 'boom', 5)",
                (copies, uuid.uuid4(), _headers(key_id)),
            )
            conn.execute(
                "INSERT INTO outboxer.outbox_debezium (id, aggregatetype, aggregateid, type, "
                "payload, headers) VALUES (%s, 't', 'a', 't', '{}', %s)",
                (uuid.uuid4(), _headers(key_id)),
            )
            conn.execute(
                "INSERT INTO outboxer.dead_letters (consumer, message_id, topic, headers, "
                "content_type, payload, error, attempts) "
                "VALUES ('g', %s, 't', %s, 'application/octet-stream', '\\x00', 'boom', 5)",
                (uuid.uuid4(), _headers(key_id)),
            )


EXPECTED_POSTGRES = {
    "outbox": {"k1": 1, "k2": 1},
    "outbox finished": {"k1": 1, "k2": 1},
    "log": {"k1": 1, "k2": 1},
    "stream dead letters": {"k1": 1, "k2": 1},
    "plain": {"k1": 3, "k2": 1},
    "debezium": {"k1": 1, "k2": 1},
    "consumer dead letters": {"k1": 1, "k2": 1},
}


def test_postgres_every_place_counted_by_key(pg_url: str) -> None:
    _fill_postgres(pg_url)
    places = key_usage(pg_url)
    assert {p.place: p.keys for p in places} == EXPECTED_POSTGRES
    assert {p.place: p.table for p in places}["plain"] == '"outboxer"."outbox_plain"'


def test_postgres_missing_tables_are_skipped(pg_url: str) -> None:
    with psycopg.connect(pg_url) as conn:
        Outbox(encryption=RING1).enqueue(conn, "orders", {"n": 1})
    places = key_usage(pg_url)
    assert {p.place: p.keys for p in places} == {
        "outbox": {"k1": 1},
        "outbox finished": {},
        "consumer dead letters": {},
    }


def test_cli_refuses_a_retiring_key_still_in_use_naming_where(
    pg_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _fill_postgres(pg_url)
    monkeypatch.setenv("OUTBOXER_DB", pg_url)
    monkeypatch.setenv("OUTBOXER_ENCRYPTION_KEYS", f"k1={K1},k2={K2}")

    code, out, err = _run(capsys)
    assert (code, err) == (EXIT_OK, "")
    assert "key k1: 9 message(s)" in out and "key k2 (current): 7 message(s)" in out
    assert '  plain ("outboxer"."outbox_plain"): 3' in out

    code, out, err = _run(capsys, "--retiring", "k1")
    assert code == EXIT_ERROR
    assert err.startswith("outboxer keys usage: key k1 cannot be retired yet: ")
    for table in ("outbox", "outbox_log", "outbox_stream_dead_letters", "outbox_plain",
                  "outbox_debezium", "dead_letters"):  # fmt: skip
        assert f'"outboxer"."{table}"' in err, table
    assert "`outboxer keys rotate`" in err

    code, out, err = _run(capsys, "--retiring", "k2")  # the current key
    assert code == EXIT_ERROR and "it is the ring's current key" in err

    code, out, err = _run(capsys, "--retiring", "k1", "--json")
    assert code == EXIT_ERROR
    document = json.loads(out)
    assert {p["place"]: p["keys"] for p in document["places"]} == EXPECTED_POSTGRES
    assert document["ring"] == {"key_ids": ["k1", "k2"], "current": "k2"}
    assert document["retiring"]["k1"]["in_use"] is True
    assert len(document["retiring"]["k1"]["reasons"]) == 7

    # Once every place is clear of k1, it may go (k3 was never used at all).
    with psycopg.connect(pg_url) as conn:
        for table in ("outbox", "outbox_log", "outbox_stream_dead_letters", "outbox_plain",
                      "outbox_debezium", "dead_letters"):  # fmt: skip
            conn.execute(f"DELETE FROM outboxer.{table} WHERE headers->>'outboxer-key-id' = 'k1'")
    code, out, err = _run(capsys, "--retiring", "k1", "--retiring", "k3")
    assert (code, err) == (EXIT_OK, "")
    assert "key k1: no stored message needs it; it can leave the ring" in out
    assert "key k1: 0 message(s)" in out


def test_cli_rejects_a_malformed_key_id(
    pg_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OUTBOXER_DB", pg_url)
    code, _, err = _run(capsys, "--retiring", "no such key!")
    assert code == EXIT_USAGE and "key id 'no such key!'" in err


def _fill_generic(conn: Any, dialect: str) -> None:
    placeholder = "?" if dialect == "sqlite" else "%s"
    for ring in (RING1, RING2):
        Outbox(encryption=ring).enqueue(conn, "orders", {"n": 1})
        Outbox(encryption=ring).enqueue(conn, "orders", {"n": 2})
    cursor = conn.cursor()
    cursor.execute("UPDATE outbox SET status = 'ABANDONED' WHERE seq = 1")
    for n, key_id in enumerate(("k1", "k1", "k2")):
        cursor.execute(
            "INSERT INTO dead_letters (consumer, message_id, topic, headers, content_type, "
            f"payload, error, attempts) VALUES ('g', {placeholder}, 't', {placeholder}, "
            f"'application/octet-stream', {placeholder}, 'boom', 5)",
            (str(uuid.uuid4()), _headers(key_id), b"\x00" * (n + 1)),
        )
    conn.commit()


EXPECTED_GENERIC = {
    "outbox": {"k1": 1, "k2": 2},
    "outbox finished": {"k1": 1},
    "consumer dead letters": {"k1": 2, "k2": 1},
}


def test_sqlite(sqlite_url: str, capsys: pytest.CaptureFixture[str],
                monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    from outboxer.stores.sqlite import sqlite_path

    conn = sqlite3.connect(sqlite_path(sqlite_url))
    try:
        _fill_generic(conn, "sqlite")
        # Read-only: no write lock taken, even while another connection writes.
        conn.execute("BEGIN IMMEDIATE")
        assert {p.place: p.keys for p in key_usage(sqlite_url)} == EXPECTED_GENERIC
        conn.rollback()
    finally:
        conn.close()
    monkeypatch.setenv("OUTBOXER_DB", sqlite_url)
    code, _, err = _run(capsys, "--retiring", "k1")
    assert code == EXIT_ERROR and '2 in "dead_letters" (consumer dead letters' in err


def test_mysql(mysql_url: str, capsys: pytest.CaptureFixture[str],
               monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    conn = mysql_connect(mysql_url)
    try:
        _fill_generic(conn, "mysql")
    finally:
        conn.close()
    monkeypatch.setenv("OUTBOXER_DB", mysql_url)
    assert {p.place: p.keys for p in key_usage(mysql_url)} == EXPECTED_GENERIC
    code, out, err = _run(capsys, "--retiring", "k1", "--json")
    assert code == EXIT_ERROR and "1 in `outbox` (outbox finished" in err
    assert {p["place"]: p["keys"] for p in json.loads(out)["places"]} == EXPECTED_GENERIC


def test_several_databases_each_counted_and_one_down_is_not_a_pass(
    pg_url: str,
    sqlite_url: str,
    tmp_path: Any,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from outboxer.stores.sqlite import sqlite_path

    with psycopg.connect(pg_url) as conn:
        Outbox(encryption=RING1).enqueue(conn, "orders", {"n": 1})
    conn2 = sqlite3.connect(sqlite_path(sqlite_url))
    try:
        Outbox(encryption=RING2).enqueue(conn2, "orders", {"n": 1})
        conn2.commit()
    finally:
        conn2.close()
    config = tmp_path / "outboxer.toml"
    config.write_text(
        f'[databases.orders]\nurl = "{pg_url}"\n[databases.billing]\nurl = "{sqlite_url}"\n',
        "utf-8",
    )
    code, out, err = _run(capsys, "--config", str(config), "--retiring", "k1")
    assert code == EXIT_ERROR
    assert "database orders:\n  key k1: 1 message(s)" in out
    assert "database billing:\n  key k2: 1 message(s)" in out
    assert "key k1 cannot be retired yet: database orders: 1 in" in err
    code, out, err = _run(capsys, "--config", str(config), "--retiring", "k2", "--json")
    assert code == EXIT_ERROR and "database billing: 1 in" in err
    assert json.loads(out)["databases"]["orders"]["places"][0]["keys"] == {"k1": 1}

    # A database that does not answer: nothing can be vouched for there.
    gone = "postgresql://postgres@127.0.0.1:1/none?connect_timeout=2"
    config.write_text(
        f'[databases.orders]\nurl = "{gone}"\n[databases.billing]\nurl = "{sqlite_url}"\n',
        "utf-8",
    )
    code, out, err = _run(capsys, "--config", str(config), "--retiring", "k1")
    assert code == EXIT_ERROR
    assert "database orders:\n  unavailable: " in out
    assert "database(s) orders did not answer" in err
    assert "can leave the ring" not in out
