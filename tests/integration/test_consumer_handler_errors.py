"""outboxer.Consumer when the handler or the consumer's own bookkeeping goes wrong, on the
real databases (SQLite, PostgreSQL with psycopg, asyncpg and psycopg's async connection,
MariaDB), fed by the in-process broker:

* a handler that returns a coroutine while looking synchronous is a failure, never applied;
  a callable object whose ``__call__`` is ``async def`` is an async handler;
* an OSError the handler raises (a missing file, a refused connection, a timeout of its
  own) is a failed attempt, backed off and dead-lettered, not a lost database connection;
  a connection that really is lost still costs no attempt;
* a dead letter or held record that the database refuses for what the message holds (a
  NUL in a header or key on PostgreSQL, an over-long key, a creation time that overflows
  on MySQL) is stored sanitised, and a bookkeeping statement that keeps failing is charged
  to the message: the worker goes on with the next message.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import json
import sqlite3
import uuid
import warnings
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from outboxer.brokers.memory import memory_broker
from outboxer.consumer import Consumer, ConsumerStats, Delivery
from outboxer.errors import ConfigError
from outboxer.message import Message
from outboxer.receivers.webhook import WebhookReceiver
from outboxer.retry import Backoff
from outboxer.testing import make_message
from tests.conftest import mysql_connect
from tests.consumer_handlers import APPLIED_DDL, record, record_async, record_psycopg_async

FAST = Backoff(base=0.01, multiplier=2, cap=0.05, jitter=0)
#: Seconds a consumer run may take; the bugs these tests pin made runs that never ended.
RUN_TIMEOUT = 20.0

# ----- databases --------------------------------------------------------------------------

SQLITE_APPLIED = (
    "CREATE TABLE applied (position INTEGER PRIMARY KEY, message_id TEXT NOT NULL, key TEXT,"
    " n INTEGER NOT NULL, attempt INTEGER NOT NULL)"
)
MYSQL_APPLIED = (
    "CREATE TABLE applied (position INT AUTO_INCREMENT PRIMARY KEY, message_id CHAR(36) NOT NULL,"
    " `key` VARCHAR(400), n INT NOT NULL, attempt INT NOT NULL)"
)


def query(db: str, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    if db.startswith("sqlite"):
        with sqlite3.connect(db.removeprefix("sqlite:///")) as lite:
            return lite.execute(sql, params).fetchall()
    if db.startswith("postgres"):
        with psycopg.connect(db) as conn:
            return conn.execute(sql, params).fetchall()
    conn = mysql_connect(db, autocommit=True)
    try:
        with conn.cursor() as cursor:
            cursor.execute(sql, params)
            return list(cursor.fetchall())
    finally:
        conn.close()


def table(db: str, name: str) -> str:
    return f"outboxer.{name}" if db.startswith("postgres") else name


def key_column(db: str) -> str:
    return "`key`" if db.startswith("mysql") else "key"


@pytest.fixture
def sqlite_db(sqlite_url: str) -> str:
    query(sqlite_url, SQLITE_APPLIED)
    return sqlite_url


@pytest.fixture
def pg_db(pg_url: str) -> str:
    with psycopg.connect(pg_url) as conn:
        conn.execute(APPLIED_DDL)
    return pg_url


@pytest.fixture
def mysql_db(mysql_url: str) -> str:
    query(mysql_url, MYSQL_APPLIED)
    return mysql_url


def record_anywhere(message: Delivery, conn: Any) -> None:
    """The sync handler that writes one ``applied`` row, on whichever connection it gets."""
    if isinstance(conn, sqlite3.Connection):
        conn.execute(
            "INSERT INTO applied (message_id, key, n, attempt) VALUES (?, ?, ?, ?)",
            (str(message.id), message.key, message.payload["n"], message.attempt),
        )
    elif isinstance(conn, psycopg.Connection):
        record(message, conn)
    else:
        with conn.cursor() as cursor:
            cursor.execute(
                "INSERT INTO applied (message_id, `key`, n, attempt) VALUES (%s, %s, %s, %s)",
                (str(message.id), message.key, message.payload["n"], message.attempt),
            )


#: kind -> (database fixture, async_driver, the recording handler)
KINDS: dict[str, tuple[str, str | None, Callable[..., Any]]] = {
    "sqlite": ("sqlite_db", None, record_anywhere),
    "postgres-psycopg": ("pg_db", None, record_anywhere),
    "postgres-asyncpg": ("pg_db", "asyncpg", record_async),
    "postgres-psycopg-async": ("pg_db", "psycopg", record_psycopg_async),
    "mysql": ("mysql_db", None, record_anywhere),
}


def is_async(kind: str) -> bool:
    return KINDS[kind][1] is not None


def database(request: pytest.FixtureRequest, kind: str) -> str:
    url: str = request.getfixturevalue(KINDS[kind][0])
    return url


def consume(
    db: str, handler: Any, *messages: Message, **options: Any
) -> tuple[Consumer, ConsumerStats]:
    """Run a consumer over ``messages`` until it is idle (a TimeoutError if it never is)."""
    broker = f"errors-{uuid.uuid4().hex[:8]}"
    memory_broker(broker).messages.extend(messages)
    options.setdefault("backoff", FAST)
    consumer = Consumer(
        db=db,
        broker=f"memory://{broker}",
        group="g",
        handler=handler,
        exit_when_idle=True,
        **options,
    )

    async def run() -> ConsumerStats:
        return await asyncio.wait_for(consumer.run_async(), RUN_TIMEOUT)

    return consumer, asyncio.run(run())


def applied(db: str) -> list[tuple[Any, ...]]:
    return query(db, f"SELECT n, {key_column(db)}, attempt FROM applied ORDER BY position")


def dead_letters(db: str) -> list[tuple[Any, ...]]:
    return query(
        db,
        f"SELECT {key_column(db)}, error, attempts, held FROM {table(db, 'dead_letters')} "
        "ORDER BY seq",
    )


def inbox_ids(db: str) -> set[str]:
    return {str(row[0]) for row in query(db, f"SELECT message_id FROM {table(db, 'inbox')}")}


# ----- 2. a handler that returns a coroutine while looking synchronous ----------------------


class AsyncCallable:
    """A handler object whose __call__ is a coroutine function."""

    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self, message: Delivery, conn: Any) -> None:
        self.calls += 1
        await record_async(message, conn)


def looks_sync(handler: Callable[..., Any]) -> Callable[..., Any]:
    """A plain decorator (tracing, metrics …) around a coroutine function: calling it
    returns the coroutine, and inspect.iscoroutinefunction says False."""

    @functools.wraps(handler)
    def wrapper(message: Delivery, conn: Any) -> Any:
        return handler(message, conn)

    return wrapper


def test_a_callable_object_with_an_async_call_is_awaited_on_an_async_connection(
    pg_db: str,
) -> None:
    handler = AsyncCallable()
    first, second = make_message("t", {"n": 1}, key="a"), make_message("t", {"n": 2}, key="a")
    consumer, stats = consume(pg_db, handler, first, second)
    assert consumer.is_async
    assert handler.calls == 2 and stats.applied == 2 and stats.failed == 0
    assert [row[0] for row in applied(pg_db)] == [1, 2]
    assert inbox_ids(pg_db) == {str(first.id), str(second.id)}

    # A functools.partial of one is async too.
    partial = Consumer(db=pg_db, broker=None, group="g", handler=functools.partial(AsyncCallable()))
    assert partial.is_async


def test_an_async_callable_object_is_refused_where_handlers_must_be_sync(
    sqlite_db: str,
) -> None:
    with pytest.raises(ConfigError, match="async handlers run on PostgreSQL"):
        Consumer(db=sqlite_db, broker=None, group="g", handler=AsyncCallable())


@pytest.mark.parametrize("kind", ["sqlite", "postgres-psycopg", "mysql"])
def test_a_sync_looking_handler_that_returns_a_coroutine_fails_and_is_not_applied(
    request: pytest.FixtureRequest, kind: str
) -> None:
    db = database(request, kind)
    ran: list[int] = []

    async def apply(message: Delivery, conn: Any) -> None:
        ran.append(message.payload["n"])  # never: nothing awaits it
        record_anywhere(message, conn)

    handler = looks_sync(apply)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        consumer, stats = consume(db, handler, make_message("t", {"n": 0}, key="k"), max_attempts=2)
        gc.collect()
    assert not consumer.is_async
    assert ran == [] and applied(db) == []
    assert inbox_ids(db) == set(), "the inbox recorded a message that was never applied"
    [(key, error, attempts, held)] = dead_letters(db)
    assert (key, attempts, bool(held)) == ("k", 2, False)
    assert error.startswith("HandlerReturnedAwaitable: handler ")
    assert "apply returned coroutine" in error
    assert (stats.applied, stats.failed, stats.dead_lettered) == (0, 2, 1)
    never_awaited = [w for w in caught if "never awaited" in str(w.message)]
    assert never_awaited == [], "the coroutine was left for the garbage collector"


# ----- 3. an OSError of the handler is its failure, not a lost connection --------------------


@pytest.mark.parametrize(
    "error",
    [
        FileNotFoundError(2, "No such file or directory", "/etc/app/rates.json"),
        ConnectionRefusedError(111, "Connection refused"),  # an HTTP service that is down
        TimeoutError("timed out"),  # socket.timeout
    ],
    ids=["FileNotFoundError", "ConnectionRefusedError", "TimeoutError"],
)
@pytest.mark.parametrize("kind", list(KINDS))
def test_an_oserror_the_handler_raises_is_a_failed_attempt_then_a_dead_letter(
    request: pytest.FixtureRequest, kind: str, error: OSError
) -> None:
    db = database(request, kind)
    _, driver, record_it = KINDS[kind]
    calls: list[int] = []

    def raise_or_record(message: Delivery, conn: Any) -> Any:
        if message.payload["n"] == 0:
            calls.append(message.attempt)
            raise error
        return record_it(message, conn)

    async def raise_or_record_async(message: Delivery, conn: Any) -> None:
        await raise_or_record(message, conn)

    handler = raise_or_record_async if is_async(kind) else raise_or_record
    poison, after = make_message("t", {"n": 0}, key="k"), make_message("t", {"n": 1}, key="k")
    _, stats = consume(db, handler, poison, after, max_attempts=3, async_driver=driver)
    assert calls == [1, 2, 3]
    [(key, recorded, attempts, _)] = dead_letters(db)
    assert (key, attempts) == ("k", 3)
    assert recorded.startswith(f"{type(error).__name__}: ")
    assert [row[0] for row in applied(db)] == [1], "the key's next message was applied"
    assert (stats.failed, stats.dead_lettered, stats.applied) == (3, 1, 1)
    assert stats.database_errors == 0, "counted as a lost database connection"


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "sqlite"])
def test_a_connection_lost_in_the_handler_still_costs_no_attempt(
    request: pytest.FixtureRequest, kind: str
) -> None:
    """The first delivery of each message ends its own database session mid-handler: the
    consumer reconnects and applies it again, with no attempt counted (max_attempts=1
    would make it a dead letter otherwise)."""
    db = database(request, kind)
    _, driver, record_it = KINDS[kind]
    killed: set[uuid.UUID] = set()
    kill = (
        "SELECT pg_terminate_backend(pg_backend_pid())"
        if db.startswith("postgres")
        else "KILL CONNECTION_ID()"
    )

    def kill_once(message: Delivery, conn: Any) -> Any:
        if message.id not in killed:
            killed.add(message.id)
            if isinstance(conn, psycopg.Connection):
                conn.execute(kill)
            else:
                with conn.cursor() as cursor:
                    cursor.execute(kill)
        return record_it(message, conn)

    async def kill_once_async(message: Delivery, conn: Any) -> None:
        if message.id not in killed:
            killed.add(message.id)
            await conn.execute(kill)
        await record_it(message, conn)

    handler = kill_once_async if is_async(kind) else kill_once
    messages = [make_message("t", {"n": n}, key=f"k{n}") for n in range(3)]
    _, stats = consume(db, handler, *messages, max_attempts=1, async_driver=driver, batch=1)
    assert sorted(row[0] for row in applied(db)) == [0, 1, 2]
    assert (stats.failed, stats.dead_lettered, stats.applied) == (0, 0, 3)
    assert stats.database_errors >= 3
    assert dead_letters(db) == []


async def test_the_webhook_receiver_counts_a_handler_oserror_as_an_attempt(pg_db: str) -> None:
    """503 with the attempt and its backoff (the relay sends it again), then 200 and a dead
    letter after max_attempts; never the 503 of a database error, which counts nothing."""

    def missing_file(message: Delivery, conn: Any) -> None:
        raise FileNotFoundError(2, "No such file or directory", "/etc/app/rates.json")

    receiver = WebhookReceiver(
        db=pg_db, group="hooks", handler=missing_file, secret=None, max_attempts=3, backoff=FAST
    )
    headers = {
        "outboxer-id": str(uuid.uuid4()),
        "outboxer-topic": "hook.t",
        "outboxer-key": "k",
        "content-type": "application/json",
    }
    answers = []
    try:
        for _ in range(3):
            status, body, _ = await receiver.handle(headers, b'{"n": 0}')
            answers.append((status, body.get("attempt"), body.get("result")))
    finally:
        await receiver.close()
    assert answers == [(503, 1, None), (503, 2, None), (200, None, "dead-lettered")]
    assert receiver.stats.database_errors == 0
    [(key, error, attempts, _)] = dead_letters(pg_db)
    assert (key, attempts) == ("k", 3) and error.startswith("FileNotFoundError: ")


# ----- 4. bookkeeping the database refuses must not stop the worker --------------------------


def poison_or_record(record_it: Callable[..., Any]) -> Callable[..., Any]:
    """Fails the messages whose payload says ``poison``; records the others."""

    def handler(message: Delivery, conn: Any) -> Any:
        if message.payload.get("poison"):
            raise ValueError(f"poison {message.key}")  # the error text holds the key too
        return record_it(message, conn)

    return handler


def poison_or_record_async(record_it: Callable[..., Any]) -> Callable[..., Any]:
    async def handler(message: Delivery, conn: Any) -> None:
        if message.payload.get("poison"):
            raise ValueError(f"poison {message.key}")
        await record_it(message, conn)

    return handler


def handler_for(kind: str) -> Callable[..., Any]:
    record_it = KINDS[kind][2]
    return poison_or_record_async(record_it) if is_async(kind) else poison_or_record(record_it)


@pytest.mark.parametrize("kind", ["postgres-psycopg", "postgres-asyncpg", "postgres-psycopg-async"])
def test_a_nul_in_a_header_of_a_dead_letter_is_stored_replaced(
    request: pytest.FixtureRequest, kind: str
) -> None:
    db = database(request, kind)
    poison = make_message("t", {"n": 0, "poison": True}, key="k", headers={"trace": "a\x00b"})
    unreadable = Message(
        id=uuid.uuid4(), topic="t", payload=b"{not json", key="u", headers={"x\x00": "\x00"}
    )
    after = make_message("t", {"n": 1}, key="k")
    _, stats = consume(
        db,
        handler_for(kind),
        poison,
        unreadable,
        after,
        max_attempts=1,
        async_driver=KINDS[kind][1],
    )
    letters = query(
        db, "SELECT message_id, headers::text, error FROM outboxer.dead_letters ORDER BY seq"
    )
    headers = {str(row[0]): json.loads(row[1]) for row in letters}
    assert headers == {
        str(poison.id): {"trace": "a\ufffdb"},
        str(unreadable.id): {"x\ufffd": "\ufffd"},
    }
    assert [row[0] for row in applied(db)] == [1], "the worker went on with the next message"
    assert (stats.dead_lettered, stats.malformed, stats.applied) == (2, 1, 1)


@pytest.mark.parametrize("kind", ["postgres-psycopg", "postgres-asyncpg"])
def test_a_nul_in_the_key_with_abandoned_blocks_key_dead_letters_and_holds(
    request: pytest.FixtureRequest, kind: str
) -> None:
    db = database(request, kind)
    key = "order\x0042"
    poison = make_message("t", {"n": 0, "poison": True}, key=key)
    held = make_message("t", {"n": 1}, key=key)
    other = make_message("t", {"n": 2}, key="other")
    _, stats = consume(
        db,
        handler_for(kind),
        poison,
        held,
        other,
        max_attempts=2,
        abandoned_blocks_key=True,
        async_driver=KINDS[kind][1],
    )
    letters = dead_letters(db)
    assert [(k, attempts, bool(h)) for k, _, attempts, h in letters] == [
        ("order\ufffd42", 2, False),
        ("order\ufffd42", 0, True),
    ]
    assert letters[0][1] == "ValueError: poison order\ufffd42"
    assert [row[0] for row in applied(db)] == [2]
    assert (stats.dead_lettered, stats.held, stats.applied) == (2, 1, 1)


def test_a_key_longer_than_the_column_and_an_overflowing_created_at_on_mysql(
    mysql_db: str,
) -> None:
    long_key = "k" * 300
    poison = make_message("t", {"n": 0, "poison": True}, key=long_key)
    held = make_message("t", {"n": 1}, key=long_key)
    edge = make_message(
        "t",
        {"n": 2, "poison": True},
        key="edge",
        headers={"outboxer-created-at": "0001-01-01T00:00:00+14:00"},
    )
    after = make_message("t", {"n": 3}, key="next")
    _, stats = consume(
        mysql_db,
        poison_or_record(record_anywhere),
        poison,
        held,
        edge,
        after,
        max_attempts=1,
        abandoned_blocks_key=True,
    )
    letters = query(
        mysql_db, "SELECT `key`, held, created_at, attempts FROM dead_letters ORDER BY seq"
    )
    assert sorted(letters) == sorted(
        [("k" * 255, 0, None, 1), ("k" * 255, 1, None, 0), ("edge", 0, None, 1)]
    )
    assert [row[0] for row in applied(mysql_db)] == [3]
    assert (stats.dead_lettered, stats.held, stats.applied) == (3, 1, 1)


def test_a_bookkeeping_statement_that_keeps_failing_is_charged_to_its_message(
    pg_db: str,
) -> None:
    """The inbox claim of one message fails every time (a trigger stands for what the
    database refuses in it): it is counted against that message, which becomes a dead
    letter after max_attempts, instead of being retried at once for ever."""
    refused = make_message("t", {"n": 0}, key="k")
    with psycopg.connect(pg_db) as conn:
        conn.execute(
            "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            f"IF NEW.message_id = '{refused.id}' THEN RAISE EXCEPTION 'claim refused'; END IF; "
            "RETURN NEW; END $$"
        )
        conn.execute(
            "CREATE TRIGGER refuse BEFORE INSERT ON outboxer.inbox "
            "FOR EACH ROW EXECUTE FUNCTION refuse()"
        )
    others = [make_message("t", {"n": n}, key="k" if n % 2 else "j") for n in range(1, 5)]
    _, stats = consume(pg_db, record_anywhere, refused, *others, max_attempts=3)
    [(key, error, attempts, held)] = dead_letters(pg_db)
    assert (key, attempts, held) == ("k", 3, False)
    assert error.startswith("RaiseException: claim refused")
    assert sorted(row[0] for row in applied(pg_db)) == [1, 2, 3, 4]
    assert (stats.failed, stats.dead_lettered, stats.applied) == (3, 1, 4)


def test_a_dead_letter_the_table_refuses_is_recorded_without_key_headers_and_created_at(
    pg_db: str,
) -> None:
    """Whatever the sanitising misses (a constraint stands for it here): the dead letter is
    written bare, the refusal in its error, and the worker goes on."""
    with psycopg.connect(pg_db) as conn:
        conn.execute(
            "ALTER TABLE outboxer.dead_letters ADD CONSTRAINT no_secret "
            "CHECK (NOT headers ? 'secret')"
        )
    poison = make_message("t", {"n": 0, "poison": True}, key="k", headers={"secret": "x"})
    after = make_message("t", {"n": 1}, key="k")
    _, stats = consume(pg_db, poison_or_record(record_anywhere), poison, after, max_attempts=1)
    [(message_id, key, headers, error)] = query(
        pg_db, "SELECT message_id, key, headers::text, error FROM outboxer.dead_letters"
    )
    assert (message_id, key, json.loads(headers)) == (poison.id, None, {})
    assert error.startswith("[recorded without key, headers and created_at: CheckViolation: ")
    assert error.endswith("] ValueError: poison k")
    assert [row[0] for row in applied(pg_db)] == [1]
    assert (stats.dead_lettered, stats.applied) == (1, 1)


@pytest.mark.parametrize("kind", ["postgres-asyncpg", "postgres-psycopg-async"])
def test_a_cancelled_error_the_handler_raises_is_its_failure_not_the_worker_s_end(
    request: pytest.FixtureRequest, kind: str
) -> None:
    """An async handler that awaits something cancelled raises CancelledError while its
    worker is not being cancelled. Escaping as it was, it ended the worker and left its
    lanes held until shutdown (the consumer never went idle); now it is a failed attempt,
    then a dead letter, and the key's next message is applied."""
    db = database(request, kind)
    record_it = KINDS[kind][2]

    async def handler(message: Delivery, conn: Any) -> None:
        if message.payload["n"] == 0:
            gone = asyncio.get_running_loop().create_future()
            gone.cancel()
            await gone
        await record_it(message, conn)

    poison, after = make_message("t", {"n": 0}, key="k"), make_message("t", {"n": 1}, key="k")
    _, stats = consume(db, handler, poison, after, async_driver=KINDS[kind][1], max_attempts=2)
    assert [row[0] for row in applied(db)] == [1]
    [letter] = dead_letters(db)
    assert "HandlerCancelled" in letter[1] and letter[2] == 2
    assert (stats.applied, stats.dead_lettered) == (1, 1)


@pytest.mark.parametrize("kind", ["sqlite", "postgres-psycopg", "mysql"])
def test_a_password_in_the_handler_s_error_is_masked_in_the_dead_letter(
    request: pytest.FixtureRequest, kind: str
) -> None:
    """`dead-letters list` and the Django admin show the stored error: a handler's error that
    quotes a URL with its password is stored masked, as the log line is."""
    db = database(request, kind)

    def leaky(message: Delivery, conn: Any) -> None:
        raise RuntimeError("cannot reach amqp://app:leaked-pw-5519@mq.internal:5672/")

    consume(db, leaky, make_message("t", {"n": 0}, key="k"), max_attempts=1)
    [(_, recorded, _, _)] = dead_letters(db)
    assert "amqp://app:***@mq.internal:5672/" in recorded
    assert "leaked-pw-5519" not in recorded
