"""SQLAlchemy domain events across savepoints, on the real PostgreSQL, MariaDB and SQLite:
rolling back a savepoint drops the events recorded inside it, never those recorded before it
(that the outer transaction commits), whether or not the savepoint had written them."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import async_sessionmaker
from sqlalchemy.orm import Session, sessionmaker

from outboxer.contrib.sqlalchemy import listen
from tests.contrib.helpers import claim_all, claim_all_async
from tests.contrib.test_sqlalchemy import Order, async_engine, database, sessions

__all__ = ["database", "sessions"]


class Boom(Exception):
    pass


def payloads(database: str) -> list[object]:
    return [json.loads(m.payload) for m in claim_all(database)]


def saved_order(sessions: sessionmaker[Session], customer: str = "c-1") -> int:
    with sessions.begin() as session:
        order = Order(customer=customer, total=1.0)
        session.add(order)
        session.flush()
        return order.id


def test_an_event_recorded_before_a_rolled_back_savepoint_is_kept(
    database: str, sessions: sessionmaker[Session]
) -> None:
    order_id = saved_order(sessions)
    with sessions.begin() as session:
        order = session.get(Order, order_id)
        assert order is not None
        # No row changes: nothing to flush when the savepoint begins.
        order.record_event("order.viewed", {"n": 1})
        with pytest.raises(Boom), session.begin_nested():
            session.add(Order(customer="c-2", total=2.0))
            order.record_event("order.tried", {"n": 2})
            raise Boom
        assert [e.topic for e in order.pending_events] == ["order.viewed"]
    assert payloads(database) == [{"n": 1}], "the outer transaction committed its event"


def test_an_earlier_event_written_inside_a_rolled_back_savepoint_is_written_again(
    database: str, sessions: sessionmaker[Session]
) -> None:
    order_id = saved_order(sessions)
    with sessions.begin() as session:
        order = session.get(Order, order_id)
        assert order is not None
        order.record_event("order.viewed", {"n": 1})
        with pytest.raises(Boom), session.begin_nested():
            order.total = 5.0
            order.record_event("order.repriced", {"n": 2})
            session.flush()  # writes both events inside the savepoint ...
            raise Boom  # ... whose rollback takes their rows away
        assert [e.topic for e in order.pending_events] == ["order.viewed"]
    assert payloads(database) == [{"n": 1}]


def test_a_failed_flush_inside_a_savepoint_keeps_the_earlier_events(
    database: str, sessions: sessionmaker[Session]
) -> None:
    saved_order(sessions, "taken")
    order_id = saved_order(sessions, "c-1")
    with sessions.begin() as session:
        order = session.get(Order, order_id)
        assert order is not None
        order.record_event("order.viewed", {"n": 1})
        with pytest.raises(IntegrityError), session.begin_nested():
            clash = Order(customer="taken", total=2.0)
            session.add(clash)
            clash.record_event("order.placed", {"n": 2})
            session.flush()
        order.record_event("order.kept", {"n": 3})
    assert payloads(database) == [{"n": 1}, {"n": 3}]


def test_nested_savepoints_return_events_to_the_level_that_recorded_them(
    database: str, sessions: sessionmaker[Session]
) -> None:
    order_id = saved_order(sessions)
    with sessions.begin() as session:
        order = session.get(Order, order_id)
        assert order is not None
        order.record_event("order.outer", {"n": 1})
        with pytest.raises(Boom), session.begin_nested():
            order.record_event("order.middle", {"n": 2})
            with session.begin_nested():  # released: its writes belong to the middle level
                order.total = 3.0
                order.record_event("order.inner", {"n": 3})
                session.flush()
            raise Boom
        order.record_event("order.after", {"n": 4})
    assert payloads(database) == [{"n": 1}, {"n": 4}]


def test_a_released_savepoint_commits_its_events_once(
    database: str, sessions: sessionmaker[Session]
) -> None:
    order_id = saved_order(sessions)
    with sessions.begin() as session:
        order = session.get(Order, order_id)
        assert order is not None
        order.record_event("order.viewed", {"n": 1})
        with session.begin_nested():
            order.total = 4.0
            order.record_event("order.repriced", {"n": 2})
        session.flush()
    assert payloads(database) == [{"n": 1}, {"n": 2}]
    assert order.pending_events == ()


def test_a_full_rollback_after_a_savepoint_forgets_everything(
    database: str, sessions: sessionmaker[Session]
) -> None:
    order_id = saved_order(sessions)
    with sessions() as session:
        order = session.get(Order, order_id)
        assert order is not None
        order.record_event("order.viewed", {"n": 1})
        with pytest.raises(Boom), session.begin_nested():
            order.total = 5.0
            session.flush()
            raise Boom
        session.rollback()
        assert order.pending_events == ()
    with sessions.begin() as session:
        session.add(Order(customer="c-9", total=1.0))  # a later transaction carries nothing
    assert payloads(database) == []


@pytest.fixture(params=["pg_url", "mysql_url"])
def async_database(request: pytest.FixtureRequest) -> str:
    url: str = request.getfixturevalue(request.param)  # sync: these fixtures run asyncio.run
    return url


async def test_an_async_session_keeps_the_events_recorded_before_a_rolled_back_savepoint(
    async_database: str,
) -> None:
    url = async_database
    async with async_engine(url) as engine:
        sessions = async_sessionmaker(engine, expire_on_commit=False)
        listen(sessions)
        async with sessions.begin() as session:
            session.add(Order(customer="c-1", total=1.0))
        async with sessions.begin() as session:
            order = (await session.scalars(select(Order))).one()
            order.record_event("order.viewed", {"n": 1})
            with pytest.raises(Boom):
                async with session.begin_nested():
                    order.total = 2.0
                    order.record_event("order.repriced", {"n": 2})
                    await session.flush()
                    raise Boom
    assert [json.loads(m.payload) for m in await claim_all_async(url)] == [{"n": 1}]
