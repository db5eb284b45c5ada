"""The write path on every supported driver, against the real PostgreSQL, SQLite and MariaDB."""

from __future__ import annotations

import json
import sqlite3
import uuid
from typing import Any

import MySQLdb
import pytest

import outboxer
from outboxer import PayloadError
from outboxer.stores.mysql import mysql_connect_args
from outboxer.stores.sqlite import sqlite_path
from tests.conftest import aiomysql_connect, mysql_connect


def stored(url: str) -> list[dict[str, Any]]:
    import psycopg
    from psycopg.rows import dict_row

    with psycopg.connect(url, row_factory=dict_row) as conn:
        return conn.execute(
            "SELECT id, topic, key, payload, content_type, headers, status, destination "
            "FROM outboxer.outbox ORDER BY seq"
        ).fetchall()


def check_one(rows: list[dict[str, Any]], message: outboxer.Message) -> None:
    assert len(rows) == 1
    [row] = rows
    assert row["id"] == message.id
    assert (row["topic"], row["key"], row["status"]) == (message.topic, message.key, "PENDING")
    assert bytes(row["payload"]) == message.payload
    assert row["headers"] == dict(message.headers)


def test_psycopg_commit_and_rollback(pg_url: str) -> None:
    import psycopg

    with psycopg.connect(pg_url) as conn:
        message = outboxer.enqueue(
            conn,
            "order.placed",
            {"id": 1, "note": "ünïcode"},
            key="order-1",
            headers={"trace": "t-1"},
        )
        assert stored(pg_url) == [], "not visible before the caller commits"
        conn.commit()
        with conn.transaction(force_rollback=True):
            outboxer.enqueue(conn, "order.placed", {"id": 2})
    check_one(stored(pg_url), message)
    assert json.loads(message.payload) == {"id": 1, "note": "ünïcode"}
    assert message.content_type == "application/json"
    assert message.id.version == 7


def test_psycopg_enqueue_many_keeps_order(pg_url: str) -> None:
    import psycopg

    with psycopg.connect(pg_url) as conn:
        sent = outboxer.enqueue_many(
            conn,
            [{"topic": "t", "payload": {"n": n}, "key": f"k{n % 2}"} for n in range(5)]
            + [{"topic": "t", "payload": b"\x00raw"}],
        )
    rows = stored(pg_url)
    assert [row["id"] for row in rows] == [m.id for m in sent]
    assert (
        bytes(rows[-1]["payload"]) == b"\x00raw"
        and rows[-1]["content_type"] == "application/octet-stream"
    )


async def test_psycopg_async(pg_url: str) -> None:
    import psycopg

    async with await psycopg.AsyncConnection.connect(pg_url) as conn:
        message = await outboxer.enqueue_async(conn, "t", "hello", key="k")
        await outboxer.enqueue_many_async(
            conn, [{"topic": "t", "payload": "a"}, {"topic": "t", "payload": "b"}]
        )
        await conn.commit()
        await outboxer.enqueue_async(conn, "t", "rolled back")
        await conn.rollback()
    rows = stored(pg_url)
    assert len(rows) == 3 and rows[0]["id"] == message.id
    assert rows[0]["content_type"] == "text/plain; charset=utf-8"


async def test_asyncpg_connection_and_pool(pg_url: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(pg_url)
    async with conn.transaction():
        message = await outboxer.enqueue_async(conn, "t", {"a": 1}, key="k", headers={"h": "v"})
    try:
        async with conn.transaction():
            await outboxer.enqueue_async(conn, "t", {"a": 2})
            raise RuntimeError("business failure")
    except RuntimeError:
        pass
    await conn.close()
    check_one(stored(pg_url), message)
    pool = await asyncpg.create_pool(pg_url, min_size=1, max_size=1)
    async with pool.acquire() as pooled, pooled.transaction():
        await outboxer.enqueue_many_async(pooled, [{"topic": "t", "payload": [1, 2]}] * 2)
    await pool.close()
    assert len(stored(pg_url)) == 3


def test_sqlalchemy_connection_and_session(pg_url: str) -> None:
    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session

    engine = create_engine(pg_url.replace("postgresql://", "postgresql+psycopg://"))
    with engine.begin() as conn:
        first = outboxer.enqueue(conn, "t", {"via": "connection"}, key="k")
    with Session(engine) as session, session.begin():
        outboxer.enqueue(session, "t", {"via": "session"}, key="k")
        outboxer.enqueue_many(
            session, [{"topic": "t", "payload": "m1"}, {"topic": "t", "payload": "m2"}]
        )
    with Session(engine) as session:
        outboxer.enqueue(session, "t", {"via": "rolled back"})
        session.rollback()
    engine.dispose()
    rows = stored(pg_url)
    assert [
        json.loads(bytes(r["payload"])).get("via")
        if r["content_type"] == "application/json"
        else None
        for r in rows
    ] == ["connection", "session", None, None]
    assert rows[0]["id"] == first.id


async def test_sqlalchemy_async_connection_and_session(pg_url: str) -> None:
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    engine = create_async_engine(pg_url.replace("postgresql://", "postgresql+asyncpg://"))
    async with engine.begin() as conn:
        await outboxer.enqueue_async(conn, "t", {"via": "async connection"}, key="k")
    async with AsyncSession(engine) as session, session.begin():
        await outboxer.enqueue_async(session, "t", {"via": "async session"}, key="k")
        await outboxer.enqueue_many_async(session, [{"topic": "t", "payload": "x"}] * 2)
    async with AsyncSession(engine) as session:
        await outboxer.enqueue_async(session, "t", {"via": "rolled back"})
        await session.rollback()
    await engine.dispose()
    assert len(stored(pg_url)) == 4


def test_sqlite3_and_sqlalchemy_sqlite(sqlite_url: str) -> None:
    from sqlalchemy import create_engine

    conn = sqlite3.connect(sqlite_path(sqlite_url))
    with conn:
        message = outboxer.enqueue(conn, "t", {"n": 1}, key="k")
    outboxer.enqueue(conn, "t", {"n": 2})
    conn.rollback()
    engine = create_engine(sqlite_url)
    with engine.begin() as sa_conn:
        outboxer.enqueue(sa_conn, "t", {"n": 3})
    engine.dispose()
    rows = conn.execute("SELECT id, payload FROM outbox ORDER BY seq").fetchall()
    conn.close()
    assert rows[0][0] == str(message.id)
    assert [json.loads(r[1])["n"] for r in rows] == [1, 3]


@pytest.mark.parametrize(
    ("payload", "kwargs"),
    [
        ({"when": object()}, {}),
        ({"nan": float("nan")}, {}),
        (12, {}),
        ({"ok": 1}, {"topic": ""}),
        ({"ok": 1}, {"headers": {"n": 1}}),
        ({"ok": 1}, {"key": 5}),
        ({"ok": 1}, {"message_id": "not-a-uuid"}),
    ],
)
def test_bad_input_raises_payload_error_before_any_sql(
    pg_url: str, payload: object, kwargs: dict[str, Any]
) -> None:
    import psycopg

    arguments: dict[str, Any] = {"topic": "t"} | kwargs
    with psycopg.connect(pg_url) as conn:
        with pytest.raises(PayloadError):
            outboxer.enqueue(conn, arguments.pop("topic"), payload, **arguments)
        # The caller's transaction is untouched: it can go on and commit.
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        outboxer.enqueue(conn, "t", {"fine": True})
    assert len(stored(pg_url)) == 1


#: enqueue arguments each refused with PayloadError, on top of a valid message.
REFUSED: list[dict[str, Any]] = [
    {"topic": "order\x00placed"},
    {"topic": "order.placed\ud800"},
    {"key": "customer\x007"},
    {"headers": {"trace\x00": "1"}},
    {"headers": {"trace": "00-\x00-01"}},
    {"headers": {"trace": "\udcff"}},
    {"payload": "caf\x00e"},
    {"payload": "caf\udce9"},
    {"payload": {"name": "caf\udce9"}},
    {"payload": b"x" * 1025},  # over LIMITED's max_payload_bytes
]
LIMITED = outboxer.Outbox(max_payload_bytes=1024)


def refused_arguments(change: dict[str, Any]) -> dict[str, Any]:
    return {"topic": "t", "payload": {"ok": True}, "key": "k", "headers": {"h": "v"}} | change


def sync_connection(driver: str, url: str) -> Any:
    if driver == "psycopg":
        import psycopg

        return psycopg.connect(url)
    if driver == "pymysql":
        return mysql_connect(url)
    return sqlite3.connect(sqlite_path(url))


def committed_topics(driver: str, url: str) -> list[str]:
    if driver == "psycopg":
        return [row["topic"] for row in stored(url)]
    if driver == "pymysql":
        return [row["topic"] for row in mysql_stored(url)]
    with sqlite3.connect(sqlite_path(url)) as conn:
        return [row[0] for row in conn.execute("SELECT topic FROM outbox ORDER BY seq")]


@pytest.mark.parametrize(
    ("driver", "url_fixture"),
    [("psycopg", "pg_url"), ("pymysql", "mysql_url"), ("sqlite3", "sqlite_url")],
)
def test_refused_enqueues_leave_the_callers_transaction_usable(
    request: pytest.FixtureRequest, driver: str, url_fixture: str
) -> None:
    """Each refusal is a PayloadError before any SQL; the open transaction goes on and commits."""
    url = request.getfixturevalue(url_fixture)
    conn = sync_connection(driver, url)
    try:
        LIMITED.enqueue(conn, "before", {"n": 1})  # the caller's transaction is open
        for change in REFUSED:
            with pytest.raises(PayloadError):
                LIMITED.enqueue(conn, **refused_arguments(change))
            if driver == "psycopg":
                import psycopg

                assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS, (
                    f"{change!r} left the transaction {conn.info.transaction_status.name}"
                )
        LIMITED.enqueue(conn, "after", b"x" * 1024, key="k")  # a later statement succeeds
        conn.commit()
    finally:
        conn.close()
    assert committed_topics(driver, url) == ["before", "after"], "nothing refused was written"


async def test_refused_enqueues_leave_an_asyncpg_transaction_usable(pg_url: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(pg_url)
    try:
        async with conn.transaction():
            await LIMITED.enqueue_async(conn, "before", {"n": 1})
            for change in REFUSED:
                with pytest.raises(PayloadError):
                    await LIMITED.enqueue_async(conn, **refused_arguments(change))
                # asyncpg sends what it is given: a NUL reaching the server would abort the
                # transaction, and this statement would fail with InFailedSQLTransactionError.
                assert await conn.fetchval("SELECT 1") == 1, f"after {change!r}"
            await LIMITED.enqueue_async(conn, "after", b"x" * 1024, key="k")
    finally:
        await conn.close()
    assert [row["topic"] for row in stored(pg_url)] == ["before", "after"]


def test_unsupported_connection_names_the_supported_kinds() -> None:
    with pytest.raises(TypeError, match=r"psycopg.Connection.*asyncpg"):
        outboxer.enqueue(object(), "t", {"a": 1})


async def test_sync_and_async_mixups_are_explained(pg_url: str) -> None:
    import psycopg

    with psycopg.connect(pg_url) as conn, pytest.raises(TypeError, match="enqueue\\("):
        await outboxer.enqueue_async(conn, "t", {"a": 1})
    async with await psycopg.AsyncConnection.connect(pg_url) as aconn:
        with pytest.raises(TypeError, match="enqueue_async"):
            outboxer.enqueue(aconn, "t", {"a": 1})


def test_duplicate_message_id_is_refused(pg_url: str) -> None:
    import psycopg

    message_id = uuid.uuid4()
    with psycopg.connect(pg_url) as conn:
        outboxer.enqueue(conn, "t", {"a": 1}, message_id=message_id)
    with psycopg.connect(pg_url) as conn, pytest.raises(outboxer.DuplicateMessageError):
        outboxer.enqueue(conn, "t", {"a": 1}, message_id=str(message_id))


def test_several_destinations_and_own_names(pg_url: str) -> None:
    import psycopg

    outbox = outboxer.Outbox(destinations=("internal", "partner"))
    with psycopg.connect(pg_url) as conn:
        message = outbox.enqueue(conn, "t", {"a": 1}, key="k")
    rows = stored(pg_url)
    assert [(r["id"], r["destination"]) for r in rows] == [
        (message.id, "internal"),
        (message.id, "partner"),
    ]
    with pytest.raises(outboxer.ConfigError):
        outboxer.Outbox(table="bad name; drop")


# ----- MySQL / MariaDB: PyMySQL, mysqlclient, aiomysql, SQLAlchemy --------------------------


def mysqlclient_connect(url: str) -> Any:
    """A mysqlclient (MySQLdb) connection to the database of a mysql:// URL (not in autocommit)."""
    # The C extension is what makes it mysqlclient: PyMySQL installed as MySQLdb has none.
    assert hasattr(MySQLdb, "_mysql"), f"MySQLdb is not mysqlclient here: {MySQLdb.__file__}"
    args = mysql_connect_args(url)
    if "connect_timeout" in args:
        args["connect_timeout"] = int(args["connect_timeout"])
    conn = MySQLdb.connect(**args)
    assert type(conn).__module__ == "MySQLdb.connections"
    return conn


def connect_sync_mysql(url: str, driver: str) -> Any:
    """A DB-API connection of ``driver`` (pymysql or mysqlclient), not in autocommit."""
    return mysqlclient_connect(url) if driver == "mysqlclient" else mysql_connect(url)


#: SQLAlchemy's dialect driver name for each DB-API driver.
SQLALCHEMY_DRIVER = {"pymysql": "pymysql", "mysqlclient": "mysqldb"}


def mysql_stored(url: str) -> list[dict[str, Any]]:
    import pymysql.cursors

    conn = mysql_connect(url, cursorclass=pymysql.cursors.DictCursor)
    try:
        with conn.cursor() as cursor:
            cursor.execute(
                "SELECT seq, id, topic, `key`, payload, content_type, headers, status, "
                "destination FROM outbox ORDER BY seq"
            )
            return list(cursor.fetchall())
    finally:
        conn.close()


def check_mysql(url: str, first: outboxer.Message, second: outboxer.Message) -> None:
    """What every MySQL driver test leaves: ``first`` (JSON, key k, a header), then ``second``."""
    rows = mysql_stored(url)
    assert [row["id"] for row in rows] == [str(first.id), str(second.id)]
    assert (rows[0]["topic"], rows[0]["key"], rows[0]["status"]) == ("t", "k", "PENDING")
    assert rows[0]["payload"] == first.payload and json.loads(rows[0]["headers"]) == {"h": "v"}
    assert (
        rows[1]["payload"] == b"\x00raw" and rows[1]["content_type"] == "application/octet-stream"
    )


def sqlalchemy_mysql(url: str, driver: str) -> str:
    return url.replace("mysql://", f"mysql+{driver}://", 1)


def mysql_scenario(conn: Any, url: str) -> None:
    """Commit, roll back, enqueue_many and a duplicate id, on any sync MySQL connection."""
    first = outboxer.enqueue(conn, "t", {"n": 1}, key="k", headers={"h": "v"})
    assert mysql_stored(url) == [], "not visible before the caller commits"
    conn.commit()
    outboxer.enqueue_many(conn, [{"topic": "t", "payload": "x", "key": "k"}] * 2)
    conn.rollback()
    [second] = outboxer.enqueue_many(conn, [{"topic": "t", "payload": b"\x00raw"}])
    conn.commit()
    with pytest.raises(outboxer.DuplicateMessageError):
        outboxer.enqueue(conn, "t", {"again": True}, message_id=str(first.id))
    conn.rollback()
    check_mysql(url, first, second)


async def mysql_scenario_async(conn: Any, url: str) -> None:
    """``mysql_scenario`` on an async connection."""
    first = await outboxer.enqueue_async(conn, "t", {"n": 1}, key="k", headers={"h": "v"})
    assert mysql_stored(url) == [], "not visible before the caller commits"
    await conn.commit()
    await outboxer.enqueue_many_async(conn, [{"topic": "t", "payload": "x", "key": "k"}] * 2)
    await conn.rollback()
    [second] = await outboxer.enqueue_many_async(conn, [{"topic": "t", "payload": b"\x00raw"}])
    await conn.commit()
    with pytest.raises(outboxer.DuplicateMessageError):
        await outboxer.enqueue_async(conn, "t", {"again": True}, message_id=first.id)
    await conn.rollback()
    check_mysql(url, first, second)


@pytest.mark.parametrize("handle", ["dbapi", "sqlalchemy connection", "sqlalchemy session"])
@pytest.mark.parametrize("driver", ["pymysql", "mysqlclient"])
def test_mysql_sync_drivers(mysql_url: str, driver: str, handle: str) -> None:
    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session

    if handle == "dbapi":
        conn = connect_sync_mysql(mysql_url, driver)
        mysql_scenario(conn, mysql_url)
        conn.close()
        return
    engine = create_engine(sqlalchemy_mysql(mysql_url, SQLALCHEMY_DRIVER[driver]))
    with engine.connect() if handle == "sqlalchemy connection" else Session(engine) as handle_:
        mysql_scenario(handle_, mysql_url)
        raw = engine.raw_connection()
        try:  # the pool's DB-API connections are the driver under test
            assert type(raw.dbapi_connection).__module__.split(".")[0] == (
                "MySQLdb" if driver == "mysqlclient" else "pymysql"
            )
        finally:
            raw.close()
    engine.dispose()


@pytest.mark.parametrize("kind", ["aiomysql", "sqlalchemy connection", "sqlalchemy session"])
async def test_mysql_async_drivers(mysql_url: str, kind: str) -> None:
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    if kind == "aiomysql":
        conn = await aiomysql_connect(mysql_url)
        await mysql_scenario_async(conn, mysql_url)
        with pytest.raises(TypeError, match="enqueue_async"):
            outboxer.enqueue(conn, "t", {"a": 1})
        conn.close()
        return
    engine = create_async_engine(sqlalchemy_mysql(mysql_url, "aiomysql"))
    async with (
        engine.connect() if kind == "sqlalchemy connection" else AsyncSession(engine) as handle
    ):
        await mysql_scenario_async(handle, mysql_url)
    await engine.dispose()


def test_mysql_autocommit_is_refused_outside_a_transaction(mysql_url: str) -> None:
    conn = mysql_connect(mysql_url, autocommit=True)
    with pytest.raises(TypeError, match="autocommit"):
        outboxer.enqueue(conn, "t", {"a": 1}, key="k")
    conn.begin()  # an explicit transaction is the caller's: fine
    outboxer.enqueue(conn, "t", {"a": 1}, key="k")
    conn.rollback()
    conn.close()
    assert mysql_stored(mysql_url) == []


def test_mysqlclient_autocommit_is_refused(mysql_url: str) -> None:
    """mysqlclient does not say whether a transaction is open, so in autocommit mode even an
    explicit BEGIN is refused (the key lock and the row would otherwise commit apart);
    with autocommit off, the same connection writes."""
    conn = mysqlclient_connect(mysql_url)
    conn.autocommit(True)
    with pytest.raises(TypeError, match="MySQLdb connection is in autocommit"):
        outboxer.enqueue(conn, "t", {"a": 1}, key="k")
    conn.query("BEGIN")
    with pytest.raises(TypeError, match="autocommit"):
        outboxer.enqueue_many(conn, [{"topic": "t", "payload": "x", "key": "k"}])
    conn.rollback()
    conn.autocommit(False)
    message = outboxer.enqueue(conn, "t", {"a": 1}, key="k")
    conn.commit()
    conn.close()
    assert [row["id"] for row in mysql_stored(mysql_url)] == [str(message.id)]


class _Writer:
    """A transaction on PyMySQL, on mysqlclient or on a SQLAlchemy Session (pymysql dialect)."""

    def __init__(self, url: str, kind: str) -> None:
        self.kind = kind
        if kind in ("pymysql", "mysqlclient"):
            self.conn: Any = connect_sync_mysql(url, kind)
        else:
            from sqlalchemy import create_engine
            from sqlalchemy.orm import Session

            self.engine = create_engine(sqlalchemy_mysql(url, "pymysql"))
            self.conn = Session(self.engine)

    def commit_and_close(self) -> None:
        self.conn.commit()
        self.conn.close()
        if self.kind == "sqlalchemy":
            self.engine.dispose()


@pytest.mark.parametrize("kind", ["pymysql", "mysqlclient", "sqlalchemy"])
def test_mysql_key_lock_holds_back_the_same_key_only(mysql_url: str, kind: str) -> None:
    """A second writer of key k waits for the first to commit, then takes the larger seq;
    writers of another key, or of no key, do not wait."""
    import threading
    import time

    from outboxer.enqueue import mysql_key_slots

    assert mysql_key_slots(["k"]) != mysql_key_slots(["other-key"]), "keys of distinct slots"
    holder = _Writer(mysql_url, kind)
    outboxer.enqueue(holder.conn, "t", {"writer": "first"}, key="k")  # holds k's lock
    done: dict[str, float] = {}

    def write(name: str, key: str | None) -> None:
        writer = _Writer(mysql_url, kind)
        outboxer.enqueue(writer.conn, "t", {"writer": name}, key=key)
        writer.commit_and_close()
        done[name] = time.monotonic()

    threads = {
        name: threading.Thread(target=write, args=(name, key))
        for name, key in (("same", "k"), ("other", "other-key"), ("keyless", None))
    }
    for thread in threads.values():
        thread.start()
    threads["other"].join(5)
    threads["keyless"].join(5)
    assert {"other", "keyless"} <= set(done), "writers of other keys do not wait"
    time.sleep(0.2)
    assert "same" not in done, "a writer of the same key waits for the first one's commit"
    committed = time.monotonic()
    holder.commit_and_close()
    threads["same"].join(10)
    assert done["same"] >= committed
    rows = [row for row in mysql_stored(mysql_url) if row["key"] == "k"]
    assert [json.loads(row["payload"])["writer"] for row in rows] == ["first", "same"], (
        "seq order = commit order for one key"
    )


async def test_aiomysql_key_lock_holds_back_the_same_key_only(mysql_url: str) -> None:
    import asyncio

    holder, same, other = [await aiomysql_connect(mysql_url) for _ in range(3)]
    await outboxer.enqueue_async(holder, "t", {"writer": "first"}, key="k")

    async def write(conn: Any, name: str, key: str) -> None:
        await outboxer.enqueue_async(conn, "t", {"writer": name}, key=key)
        await conn.commit()

    waiting = asyncio.create_task(write(same, "same", "k"))
    await asyncio.wait_for(write(other, "other", "other-key"), 5)
    await asyncio.sleep(0.2)
    assert not waiting.done(), "a writer of the same key waits for the first one's commit"
    await holder.commit()
    await asyncio.wait_for(waiting, 10)
    for conn in (holder, same, other):
        conn.close()
    rows = [row for row in mysql_stored(mysql_url) if row["key"] == "k"]
    assert [json.loads(row["payload"])["writer"] for row in rows] == ["first", "same"]


async def test_status_sees_the_open_transaction_of_a_mysql_writer(mysql_url: str) -> None:
    import asyncio

    holder = mysql_connect(mysql_url)
    outboxer.enqueue(holder, "t", {"n": 1}, key="held")  # an open transaction holding its key
    await asyncio.sleep(0.2)
    async with outboxer.create_store(mysql_url) as store:
        assert await store.oldest_transaction() >= 0.2  # type: ignore[attr-defined]
    holder.rollback()
    holder.close()


def test_mysql_writers_queued_on_a_key_whose_first_writer_rolls_back_do_not_deadlock(
    mysql_url: str,
) -> None:
    """The scene that deadlocked with a lock row per key (inserted on first use): the first
    writer of a new key inserts its row, two more queue on it, the first rolls back. The row
    goes, the two queued writers are left holding gap locks, and each needs the other's gap
    to insert the row again: MariaDB kills one of them (error 1213). The slot rows never go,
    so both wait for a record and go on, one after the other."""
    import threading
    import time

    first = mysql_connect(mysql_url)
    outboxer.enqueue(first, "t", {"writer": "first"}, key="new-key")
    errors: list[BaseException] = []

    def write(name: str) -> None:
        conn = mysql_connect(mysql_url)
        try:
            outboxer.enqueue(conn, "t", {"writer": name}, key="new-key")
            conn.commit()
        except Exception as error:  # reported by the assertion below
            errors.append(error)
            conn.rollback()
        finally:
            conn.close()

    writers = [threading.Thread(target=write, args=(name,)) for name in ("second", "third")]
    for writer in writers:
        writer.start()
    deadline = time.monotonic() + 10
    while _waiting_for_key_locks(mysql_url, "mysql") < 2:
        assert time.monotonic() < deadline, f"the writers never queued for the key: {errors}"
        time.sleep(0.02)
    first.rollback()
    first.close()
    for writer in writers:
        writer.join(10)
    assert errors == [], "no writer of the key was chosen as a deadlock victim"
    rows = [row for row in mysql_stored(mysql_url) if row["key"] == "new-key"]
    assert sorted(json.loads(row["payload"])["writer"] for row in rows) == ["second", "third"]


def test_mysql_key_slots_are_sorted_distinct_and_match_crc32_in_sql(mysql_url: str) -> None:
    """Hand-written SQL can lock a key's slot as CRC32(key) & 65535: the same number."""
    from outboxer.enqueue import mysql_key_slots

    keys = ["order-1", "order-2", "Order-1", "ключ", "🔑", "", "order-1", None]
    slots = mysql_key_slots(keys)
    assert slots == sorted(set(slots)) and len(slots) == 6, "one per distinct key, ascending"
    conn = mysql_connect(mysql_url)
    try:
        with conn.cursor() as cursor:
            for key in {k for k in keys if k is not None}:
                cursor.execute("SELECT CRC32(%s) & 65535", (key,))
                (in_sql,) = cursor.fetchone()
                assert mysql_key_slots([key]) == [int(in_sql)], key
            cursor.execute("SELECT COUNT(*), MIN(slot), MAX(slot) FROM outbox_key_slots")
            assert cursor.fetchone() == (65536, 0, 65535), "every slot a key can take exists"
    finally:
        conn.close()


def test_mysql_key_lock_statements_take_few_shapes_whatever_the_key_count() -> None:
    """Formatted statements are cached: one shape per key count would grow without end."""
    from outboxer.enqueue import DEFAULT_OUTBOX, _Driver

    shapes = set()
    for count in range(1, 301):
        messages = [
            copy
            for n in range(count)
            for copy in DEFAULT_OUTBOX.build("t", {"n": n}, key=f"key-{n}")
        ]
        [(lock, [params]), _insert] = _Driver.statements(DEFAULT_OUTBOX, "mysql", messages)
        shapes.add(lock)
        slots = set(params.values())
        assert len(slots) == count, "every key's slot (these 300 keys share none)"
    assert len(shapes) == 10, "1, 2, 4 ... 512 placeholders"


def _waiting_for_key_locks(url: str, dialect: str) -> int:
    """Transactions of the test database waiting for a key lock now."""
    if dialect == "postgres":
        import psycopg

        with psycopg.connect(url, autocommit=True) as conn:
            row = conn.execute(
                "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
                "WHERE l.locktype = 'advisory' AND NOT l.granted AND a.datname = current_database()"
            ).fetchone()
    else:
        conn = mysql_connect(url, autocommit=True)
        try:
            with conn.cursor() as cursor:
                # The processlist, not innodb_trx: MariaDB may serve that from a stale cache.
                # A key_lock statement still running while the holder has k1 is waiting.
                cursor.execute(
                    "SELECT count(*) FROM information_schema.processlist "
                    "WHERE db = DATABASE() AND command = 'Query' "
                    "AND info LIKE 'SELECT slot FROM `outbox_key_slots`%'"
                )
                row = cursor.fetchone()
        finally:
            conn.close()
    assert row is not None
    return int(row[0])


@pytest.mark.parametrize("dialect", ["postgres", "mysql"])
def test_enqueue_many_with_keys_in_opposite_orders_never_deadlocks(
    request: pytest.FixtureRequest, dialect: str
) -> None:
    """Two enqueue_many calls whose callers list the same keys in opposite orders.

    The scene that deadlocks when each call locks its keys in its caller's order: a holder
    has k1; A = [k1, k2] queues for k1 first; B = [k2, k1] would take k2, then queue for k1.
    When the holder commits, A gets k1 and needs k2 from B, which needs k1 from A. Locking
    every call's keys in one global order leaves B nothing to hold while it waits.
    """
    import threading
    import time

    import psycopg

    url = request.getfixturevalue("pg_url" if dialect == "postgres" else "mysql_url")

    def connect() -> Any:
        return psycopg.connect(url) if dialect == "postgres" else mysql_connect(url)

    holder = connect()
    outboxer.enqueue(holder, "t", {"writer": "holder"}, key="k1")
    errors: dict[str, BaseException] = {}

    def write(name: str, keys: list[str]) -> None:
        conn = connect()
        try:
            outboxer.enqueue_many(
                conn, [{"topic": "t", "payload": {"writer": name}, "key": k} for k in keys]
            )
            conn.commit()
        except BaseException as exc:  # the test reports it below
            errors[name] = exc
        finally:
            conn.close()

    def wait_for_waiters(count: int) -> None:
        deadline = time.monotonic() + 10
        while _waiting_for_key_locks(url, dialect) < count:
            assert time.monotonic() < deadline, (
                f"{count} writers never queued for a key lock: {errors}"
            )
            time.sleep(0.02)

    first = threading.Thread(target=write, args=("A", ["k1", "k2"]))
    first.start()
    wait_for_waiters(1)
    second = threading.Thread(target=write, args=("B", ["k2", "k1"]))
    second.start()
    wait_for_waiters(2)
    holder.commit()
    holder.close()
    first.join(15)
    second.join(15)
    assert not first.is_alive() and not second.is_alive()
    assert errors == {}, f"a writer failed: {errors}"
    rows = stored(url) if dialect == "postgres" else mysql_stored(url)
    writers = [json.loads(bytes(row["payload"]))["writer"] for row in rows]
    assert sorted(writers) == ["A", "A", "B", "B", "holder"]
    assert writers[0] == "holder", "a key's rows keep commit order"
