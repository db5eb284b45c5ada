"""Arbitrary topics, keys, headers, content types and payloads into ``enqueue`` on real databases.

The property, for every input: either the row is written and reads back equal to what was
given, or ``PayloadError`` is raised, nothing was written and the caller's open transaction
still takes statements. Any other exception fails the test, and hypothesis shrinks it to
the smallest input that raises it.

Deterministic for CI: ``derandomize=True`` draws the same examples on every run, and
``database=None`` keeps no example store that could change them.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import outboxer
from outboxer import PayloadError
from outboxer.message import BINARY, JSON, TEXT
from outboxer.stores.sqlite import sqlite_path

FUZZ = settings(
    max_examples=250,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

# ----- inputs ------------------------------------------------------------------------------
# A valid message with at most one field drawn from a wild strategy: wild values everywhere
# at once would almost never leave a message to write, and the written ones matter too.

#: Any code point but NUL and lone surrogates: what every database stores as text.
storable_character = st.characters(codec="utf-8", exclude_characters="\x00")
storable_text = st.text(storable_character, min_size=1, max_size=16)
#: Any code point, NUL, other controls and lone surrogates included.
any_character = st.characters(codec=None)
awkward_text = st.text(any_character, max_size=12) | st.sampled_from(
    ["", "\x00", "a\x00b", "\ud800", "\udfff", "\ud83d\ude00", "\U0001f600", " ", "\n"]
)
#: Topics and keys have 255 characters at most (VARCHAR(255) on MySQL).
just_under_the_limit = st.integers(250, 255).map(lambda n: "\u00e9" * n)
just_over_the_limit = st.integers(256, 260).map(lambda n: "\u00e9" * n)
not_text = (
    st.none()
    | st.integers()
    | st.floats()
    | st.booleans()
    | st.binary(max_size=4)
    | st.lists(st.integers(), max_size=2)
    | st.builds(object)
)


def json_values(text: st.SearchStrategy[str], *, finite: bool) -> st.SearchStrategy[Any]:
    return st.recursive(
        st.none()
        | st.booleans()
        | st.integers()
        | st.floats(allow_nan=not finite, allow_infinity=not finite)
        | text,
        lambda children: (
            st.lists(children, max_size=3) | st.dictionaries(text, children, max_size=3)
        ),
        max_leaves=12,
    )


#: Megabytes of text or bytes: what a caller serializing a whole document might send.
huge = st.sampled_from([64 * 1024, 1024 * 1024 + 1, 3 * 1024 * 1024]).flatmap(
    lambda size: st.sampled_from([b"\x00" * size, "\u00e9" * (size // 2), {"blob": "x" * size}])
)
#: A NUL inside a JSON string is escaped (\u0000) and kept: only text payloads refuse it.
json_text = st.text(st.characters(codec="utf-8"), max_size=12)
VALID: dict[str, st.SearchStrategy[Any]] = {
    "topic": storable_text | just_under_the_limit,
    "key": st.none() | storable_text,
    "headers": st.none() | st.dictionaries(storable_text, st.text(storable_character), max_size=3),
    "content_type": st.none()
    | st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=1, max_size=40),
    "payload": st.dictionaries(json_text, json_values(json_text, finite=True), max_size=4)
    | st.lists(json_values(json_text, finite=True), max_size=4)
    | st.text(storable_character, max_size=40)
    | st.binary(max_size=64)
    | st.binary(max_size=16).map(bytearray)
    | huge,
}
WILD: dict[str, st.SearchStrategy[Any]] = {
    "topic": awkward_text | just_over_the_limit | not_text,
    "key": awkward_text | just_over_the_limit | not_text,
    "headers": st.dictionaries(awkward_text, awkward_text, max_size=3)
    | st.dictionaries(awkward_text | st.integers(), awkward_text | not_text, max_size=2)
    | not_text,
    "content_type": st.sampled_from(["", "c" * 256, "text/plain\r\nX: 1"])
    | awkward_text
    | not_text,
    "payload": st.dictionaries(awkward_text, json_values(awkward_text, finite=False), max_size=4)
    | st.lists(json_values(awkward_text, finite=False), max_size=4)
    | awkward_text
    | not_text
    | st.sets(st.integers(), max_size=2),
}


@st.composite
def enqueue_arguments(draw: st.DrawFn) -> dict[str, Any]:
    arguments = {name: draw(strategy) for name, strategy in VALID.items()}
    wild = draw(st.sampled_from([None, None, *WILD]))
    if wild is not None:
        arguments[wild] = draw(WILD[wild])
    return arguments


#: None, or limits the huge payloads cross.
limits = st.sampled_from([None, 64, 1024 * 1024])


# ----- databases ---------------------------------------------------------------------------


class Database:
    """One connection in an open transaction; the statements a fuzz example needs."""

    def enqueue(self, outbox: outboxer.Outbox, arguments: dict[str, Any]) -> outboxer.Message:
        raise NotImplementedError

    def count(self) -> int:
        raise NotImplementedError

    def row(self, message_id: uuid.UUID) -> dict[str, Any]:
        raise NotImplementedError

    def rollback(self) -> None:
        raise NotImplementedError


class Psycopg(Database):
    def __init__(self, url: str) -> None:
        import psycopg
        from psycopg.rows import dict_row

        self.conn = psycopg.connect(url, row_factory=dict_row)

    def enqueue(self, outbox: outboxer.Outbox, arguments: dict[str, Any]) -> outboxer.Message:
        return outbox.enqueue(self.conn, **arguments)

    def count(self) -> int:
        row = self.conn.execute("SELECT count(*) AS n FROM outboxer.outbox").fetchone()
        assert row is not None
        return int(row["n"])

    def row(self, message_id: uuid.UUID) -> dict[str, Any]:
        row = self.conn.execute(
            "SELECT topic, key, payload, content_type, headers FROM outboxer.outbox WHERE id = %s",
            (message_id,),
        ).fetchone()
        assert row is not None
        return dict(row)

    def rollback(self) -> None:
        self.conn.rollback()


class Asyncpg(Database):
    """asyncpg, driven from the synchronous test: a server error would abort its transaction."""

    def __init__(self, url: str) -> None:
        import asyncpg

        self.runner = asyncio.Runner()
        self.conn = self.runner.run(asyncpg.connect(url))
        self.transaction: Any = None

    def _begin(self) -> None:
        if self.transaction is None:
            self.transaction = self.conn.transaction()
            self.runner.run(self.transaction.start())

    def enqueue(self, outbox: outboxer.Outbox, arguments: dict[str, Any]) -> outboxer.Message:
        self._begin()
        return self.runner.run(outbox.enqueue_async(self.conn, **arguments))

    def count(self) -> int:
        self._begin()
        return int(self.runner.run(self.conn.fetchval("SELECT count(*) FROM outboxer.outbox")))

    def row(self, message_id: uuid.UUID) -> dict[str, Any]:
        row = self.runner.run(
            self.conn.fetchrow(
                "SELECT topic, key, payload, content_type, headers FROM outboxer.outbox "
                "WHERE id = $1",
                message_id,
            )
        )
        assert row is not None
        return dict(row)

    def rollback(self) -> None:
        if self.transaction is not None:
            self.runner.run(self.transaction.rollback())
            self.transaction = None

    def close(self) -> None:
        self.runner.run(self.conn.close())
        self.runner.close()


class Sqlite(Database):
    def __init__(self, url: str) -> None:
        self.conn = sqlite3.connect(sqlite_path(url))

    def enqueue(self, outbox: outboxer.Outbox, arguments: dict[str, Any]) -> outboxer.Message:
        return outbox.enqueue(self.conn, **arguments)

    def count(self) -> int:
        return int(self.conn.execute("SELECT count(*) FROM outbox").fetchone()[0])

    def row(self, message_id: uuid.UUID) -> dict[str, Any]:
        cursor = self.conn.execute(
            "SELECT topic, key, payload, content_type, headers FROM outbox WHERE id = ?",
            (str(message_id),),
        )
        names = [column[0] for column in cursor.description]
        return dict(zip(names, cursor.fetchone(), strict=True))

    def rollback(self) -> None:
        self.conn.rollback()


@pytest.fixture(params=["psycopg", "asyncpg", "sqlite3"])
def database(request: pytest.FixtureRequest) -> Iterator[Database]:
    if request.param == "sqlite3":
        sqlite = Sqlite(request.getfixturevalue("sqlite_url"))
        yield sqlite
        sqlite.conn.close()
        return
    url = request.getfixturevalue("pg_url")
    if request.param == "psycopg":
        postgres = Psycopg(url)
        yield postgres
        postgres.conn.close()
        return
    pooled = Asyncpg(url)
    yield pooled
    pooled.close()


# ----- the property ------------------------------------------------------------------------


def expected_content_type(payload: object, content_type: object) -> str:
    if isinstance(content_type, str):
        return content_type
    if isinstance(payload, bytes | bytearray):
        return BINARY
    return TEXT if isinstance(payload, str) else JSON


def assert_reads_back_equal(row: dict[str, Any], arguments: dict[str, Any]) -> None:
    payload = arguments["payload"]
    stored = bytes(row["payload"])
    if isinstance(payload, bytes | bytearray):
        assert stored == bytes(payload)
    elif isinstance(payload, str):
        assert stored.decode("utf-8") == payload
    else:
        assert json.loads(stored) == payload
    stored_headers = row["headers"]
    if isinstance(stored_headers, str):  # sqlite3 and asyncpg hand back JSON text
        stored_headers = json.loads(stored_headers)
    assert (row["topic"], row["key"], stored_headers) == (
        arguments["topic"],
        arguments["key"],
        dict(arguments["headers"] or {}),
    )
    assert row["content_type"] == expected_content_type(payload, arguments["content_type"])


@FUZZ
@given(arguments=enqueue_arguments(), limit=limits)
def test_enqueue_writes_what_it_was_given_or_refuses_with_payload_error(
    database: Database, arguments: dict[str, Any], limit: int | None
) -> None:
    outbox = outboxer.Outbox(max_payload_bytes=limit)
    payload = arguments["payload"]
    try:
        database.enqueue(outbox, {"topic": "opener", "payload": {}})  # the caller's transaction
        before = database.count()
        try:
            message = database.enqueue(outbox, arguments)
        except PayloadError as refused:
            event(f"refused: {str(refused)[:30]}")  # pytest --hypothesis-show-statistics
            assert database.count() == before, "a refused message wrote nothing"
            database.enqueue(outbox, {"topic": "after", "payload": {}})  # the transaction works
            assert database.count() == before + 1
        else:
            event(f"written: {type(payload).__name__}, {len(message.payload) // 65536} x 64 KiB")
            assert database.count() == before + 1
            assert_reads_back_equal(database.row(message.id), arguments)
    finally:
        database.rollback()
