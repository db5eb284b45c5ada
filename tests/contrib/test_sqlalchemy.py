"""SQLAlchemy domain events against the real PostgreSQL, MariaDB and SQLite: the events of a
flush commit and roll back with its rows, keep their recording order, and are written once."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Iterator

import pytest
from sqlalchemy import String, create_engine, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

import outboxer
from outboxer.contrib.sqlalchemy import RecordsEvents, listen, record_event
from tests.contrib.helpers import claim_all, claim_all_async, sqlalchemy_url


class Base(DeclarativeBase):
    pass


class Order(RecordsEvents, Base):
    __tablename__ = "orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    customer: Mapped[str] = mapped_column(String(64), unique=True)
    total: Mapped[float]


class Customer(Base):  # no mixin: records through the module function
    __tablename__ = "customers"
    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(64))


VENDORS = ["pg_url", "mysql_url", "sqlite_url"]


@pytest.fixture(params=VENDORS)
def database(request: pytest.FixtureRequest) -> str:
    url: str = request.getfixturevalue(request.param)
    return url


@pytest.fixture
def sessions(database: str) -> Iterator[sessionmaker[Session]]:
    engine = create_engine(sqlalchemy_url(database))
    Base.metadata.create_all(engine)
    factory = sessionmaker(engine, expire_on_commit=False)
    listen(factory)
    yield factory
    engine.dispose()


def add_order(session: Session | AsyncSession, customer: str = "c-1", total: float = 1.0) -> Order:
    order = Order(customer=customer, total=total)
    session.add(order)
    return order


def payloads(database: str) -> list[object]:
    """The JSON payloads a relay would publish now, in publish order."""
    return [json.loads(m.payload) for m in claim_all(database)]


def placed(order: Order) -> dict[str, object]:
    return {"id": order.id, "total": order.total}


def test_events_commit_with_their_rows_in_recording_order(
    database: str, sessions: sessionmaker[Session]
) -> None:
    with sessions.begin() as session:
        first, second = Order(customer="c-1", total=10.0), Order(customer="c-2", total=20.0)
        session.add_all([first, second])
        a = first.record_event("order.placed", lambda: placed(first), key="c-1")
        b = second.record_event("order.placed", lambda: placed(second), key="c-2")
        c = first.record_event("order.noted", "first again", key="c-1", headers={"t": "1"})
        customer = Customer(name="Ada")
        session.add(customer)
        d = record_event(customer, "customer.joined", {"name": "Ada"})
        assert claim_all(database) == [], "nothing is visible before the commit"
    messages = claim_all(database)
    assert [m.id for m in messages] == [a.message_id, b.message_id, c.message_id, d.message_id]
    assert [(m.topic, m.key) for m in messages] == [
        ("order.placed", "c-1"),
        ("order.placed", "c-2"),
        ("order.noted", "c-1"),
        ("customer.joined", None),
    ]
    # The deferred payloads ran after the INSERTs: they carry the generated ids.
    assert json.loads(messages[0].payload) == {"id": first.id, "total": 10.0}
    assert json.loads(messages[1].payload) == {"id": second.id, "total": 20.0}
    assert first.id is not None and second.id is not None and first.id != second.id
    assert messages[2].payload == b"first again" and dict(messages[2].headers) == {"t": "1"}
    assert first.pending_events == ()


def test_a_rolled_back_flush_leaves_no_event(
    database: str, sessions: sessionmaker[Session]
) -> None:
    with sessions() as session:
        order = add_order(session)
        order.record_event("order.placed", {"n": 1})
        session.flush()  # written in the transaction ...
        order.record_event("order.noted", {"n": 2})  # ... and one never flushed
        session.rollback()
    # A new object the rollback returned to transient keeps its attributes, and its events
    # (written or not): they go out if and when it is added again, not with anything else.
    assert [e.topic for e in order.pending_events] == ["order.placed", "order.noted"]
    with sessions.begin() as session:  # a later transaction must not carry them
        kept = add_order(session, "c-2", 2.0)
        kept.record_event("order.placed", {"n": 3})
    assert payloads(database) == [{"n": 3}]


def test_a_failed_flush_leaves_no_event(database: str, sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        session.add(Order(customer="taken", total=1.0))
    claim_all(database)  # nothing due from here on
    with sessions() as session:
        clash = add_order(session, "taken", 2.0)
        clash.record_event("order.placed", {"n": 1})
        with pytest.raises(IntegrityError):
            session.commit()
        assert [e.topic for e in clash.pending_events] == ["order.placed"], "to add it again"
        session.rollback()
        later = add_order(session, "later", 3.0)
        later.record_event("order.placed", {"n": 2})
        session.commit()
    assert payloads(database) == [{"n": 2}]


def test_an_event_that_cannot_be_written_fails_the_flush_and_its_rows(
    database: str, sessions: sessionmaker[Session]
) -> None:
    with sessions.begin() as session:
        order = add_order(session)
        first = order.record_event("order.placed", {"n": 1})
    with sessions() as session:
        other = add_order(session, "c-2", 2.0)
        other.record_event("order.placed", {"n": 2}, message_id=first.message_id)
        with pytest.raises(outboxer.DuplicateMessageError):
            session.commit()
        session.rollback()
        assert session.scalar(select(func.count()).select_from(Order)) == 1, "c-2 rolled back"
    assert [m.id for m in claim_all(database)] == [first.message_id]


def test_flushing_several_times_writes_each_event_once(
    database: str, sessions: sessionmaker[Session]
) -> None:
    with sessions.begin() as session:
        order = add_order(session)
        order.record_event("order.placed", {"n": 1})
        session.flush()
        session.flush()
        order.total = 5.0
        order.record_event("order.changed", {"n": 2})
        session.flush()
        order.record_event("order.noted", {"n": 3})  # no row changes: written at commit
    assert payloads(database) == [{"n": 1}, {"n": 2}, {"n": 3}]


def test_a_rolled_back_savepoint_drops_its_events_only(
    database: str, sessions: sessionmaker[Session]
) -> None:
    with sessions.begin() as session:
        order = add_order(session)
        order.record_event("order.placed", {"n": 1})
        nested = session.begin_nested()  # flushes the order and its event first
        order.total = 2.0
        order.record_event("order.changed", {"n": 2})
        session.flush()
        order.record_event("order.noted", {"n": 3})
        nested.rollback()
        order.record_event("order.kept", {"n": 4})
    assert payloads(database) == [{"n": 1}, {"n": 4}]


def test_events_recorded_before_the_entity_joins_a_session(
    database: str, sessions: sessionmaker[Session]
) -> None:
    order = Order(customer="c-1", total=1.0)
    order.record_event("order.placed", {"n": 1})
    with sessions.begin() as session:
        session.add(order)
    assert payloads(database) == [{"n": 1}]


def test_bad_events_fail_where_they_are_recorded() -> None:
    order = Order(customer="c-1", total=1.0)
    with pytest.raises(outboxer.PayloadError):
        order.record_event("order.placed", {1.5j})
    with pytest.raises(outboxer.PayloadError):
        order.record_event("", {"n": 1})
    with pytest.raises(outboxer.ConfigError):
        order.record_event("order.placed", {}, destinations=[])
    with pytest.raises(outboxer.ConfigError):
        order.record_event("order.placed", {}, destinations="partner")  # a name, not a list
    with pytest.raises(outboxer.PayloadError):
        order.record_event("order.placed", lambda: {}, content_type="not\nprintable")
    assert order.pending_events == ()


def test_listen_rejects_what_is_not_a_session() -> None:
    with pytest.raises(TypeError, match="sessionmaker"):
        listen(object())


# ----- AsyncSession -------------------------------------------------------------------------


@pytest.fixture(params=["pg_url", "mysql_url"])
def async_database(request: pytest.FixtureRequest) -> str:
    url: str = request.getfixturevalue(request.param)  # sync: these fixtures run asyncio.run
    return url


@contextlib.asynccontextmanager
async def async_engine(url: str) -> AsyncIterator[AsyncEngine]:
    engine = create_async_engine(sqlalchemy_url(url, asynchronous=True))
    async with engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
    try:
        yield engine
    finally:
        await engine.dispose()


async def test_async_session_commits_rolls_back_and_writes_once(async_database: str) -> None:
    async with async_engine(async_database) as engine:
        sessions = async_sessionmaker(engine, expire_on_commit=False)
        listen(sessions)
        await place_and_roll_back(sessions)
    messages = await claim_all_async(async_database)
    assert [(m.topic, m.key) for m in messages] == [
        ("order.placed", "c-1"),
        ("order.placed", "c-2"),
        ("order.noted", "c-1"),
    ]
    assert json.loads(messages[0].payload)["id"] > 0
    assert messages[1].payload == b"\x00binary"


async def place_and_roll_back(sessions: async_sessionmaker[AsyncSession]) -> None:
    async with sessions.begin() as session:
        first, second = Order(customer="c-1", total=1.0), Order(customer="c-2", total=2.0)
        session.add_all([first, second])
        first.record_event("order.placed", lambda: {"id": first.id}, key="c-1")
        second.record_event("order.placed", b"\x00binary", key="c-2")
        await session.flush()
        await session.flush()
        first.record_event("order.noted", {"n": 3}, key="c-1")
    async with sessions() as session:
        third = add_order(session, "c-3", 3.0)
        third.record_event("order.placed", {"n": 4})
        await session.flush()
        await session.rollback()


async def test_listening_on_an_async_session_reaches_that_session_only(pg_url: str) -> None:
    async with (
        async_engine(pg_url) as engine,
        AsyncSession(engine) as listened,
        AsyncSession(engine) as plain,
    ):
        listen(listened)
        for session, customer in ((listened, "c-1"), (plain, "c-2")):
            order = Order(customer=customer, total=1.0)
            session.add(order)
            order.record_event("order.placed", {"customer": customer})
            await session.commit()
    assert [json.loads(m.payload) for m in await claim_all_async(pg_url)] == [{"customer": "c-1"}]
