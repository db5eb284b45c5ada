"""SQLAlchemy domain events and rollbacks, on the real PostgreSQL, MariaDB and SQLite: an event
is in the outbox if and only if its entity's write committed, once, whatever rolled back."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from sqlalchemy import create_engine, event, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import async_sessionmaker
from sqlalchemy.orm import Session, sessionmaker

from outboxer.contrib.sqlalchemy import listen
from tests.contrib.helpers import claim_all, claim_all_async, sqlalchemy_url
from tests.contrib.test_sqlalchemy import Base, Customer, Order, async_engine, database, sessions

__all__ = ["database", "sessions"]


def payloads(database: str) -> list[object]:
    return [json.loads(m.payload) for m in claim_all(database)]


def orders(session: Session) -> int:
    return int(session.scalar(select(func.count()).select_from(Order)) or 0)


def test_a_new_object_added_again_after_a_failed_commit_writes_its_event_once(
    database: str, sessions: sessionmaker[Session]
) -> None:
    with sessions.begin() as session:
        session.add(Order(customer="taken", total=1.0))
    order = Order(customer="taken", total=2.0)
    order.record_event("order.placed", {"n": 1})  # recorded once, before the retry loop
    with sessions() as session:
        session.add(order)
        with pytest.raises(IntegrityError):
            session.commit()  # the INSERT fails: rollback, the order is transient again
        session.rollback()
        order.customer = "free"  # the application's retry: fix it, add it again
        session.add(order)
        session.commit()
        assert orders(session) == 2
    assert payloads(database) == [{"n": 1}]


def test_a_new_object_added_again_after_a_rollback_writes_what_the_rollback_took_back(
    database: str, sessions: sessionmaker[Session]
) -> None:
    order = Order(customer="c-1", total=1.0)
    with sessions() as session:
        session.add(order)
        order.record_event("order.placed", {"n": 1})
        session.flush()  # written, then rolled back with the INSERT
        order.record_event("order.noted", {"n": 2})  # never flushed
        session.rollback()
        with session.begin():  # an unrelated commit carries none of them
            session.add(Customer(name="Ada"))  # (the transient order keeps the id it had)
        assert payloads(database) == []
        with session.begin():  # the same order, added again
            session.add(order)
        with session.begin():
            session.add(Order(customer="c-3", total=3.0))
    assert payloads(database) == [{"n": 1}, {"n": 2}], "each once, in recording order"
    assert order.pending_events == ()


def test_a_new_object_of_a_rolled_back_savepoint_keeps_its_events(
    database: str, sessions: sessionmaker[Session]
) -> None:
    with sessions.begin() as session:
        order = Order(customer="c-1", total=1.0)
        with session.begin_nested() as nested:
            session.add(order)
            order.record_event("order.placed", {"n": 1})
            session.flush()
            order.record_event("order.noted", {"n": 2})
            nested.rollback()
        assert order not in session
        session.add(Customer(name="Ada"))  # (the transient order keeps the id it had)
        session.flush()
        session.add(order)  # added again in the outer transaction: its events with it
    assert payloads(database) == [{"n": 1}, {"n": 2}]


def test_a_rollback_keeps_the_events_of_an_entity_another_session_now_holds(
    database: str, sessions: sessionmaker[Session]
) -> None:
    with sessions() as first, sessions() as second:
        order = Order(customer="c-1", total=1.0)
        first.add(order)
        order.record_event("order.placed", {"n": 1})
        first.expunge(order)
        second.add(order)
        first.rollback()  # nothing of the order's was in it any more
        second.commit()
        assert orders(second) == 1
    assert payloads(database) == [{"n": 1}]


def test_events_an_after_flush_listener_records_at_commit_commit_with_the_rows(
    database: str, sessions: sessionmaker[Session]
) -> None:
    with sessions() as session:

        @event.listens_for(session, "after_flush")
        def derive(session: Session, flush_context: object) -> None:
            for entity in session.new:
                entity.record_event("order.derived", {"customer": entity.customer})

        session.add(Order(customer="c-1", total=1.0))
        session.commit()  # its final flush runs the listener after outboxer's after_flush
        assert payloads(database) == [{"customer": "c-1"}], "in the commit of its row"
        event.remove(session, "after_flush", derive)
        with session.begin():  # and not in a later, unrelated transaction
            session.add(Order(customer="c-2", total=2.0))
    assert payloads(database) == []


def test_an_event_a_before_commit_listener_records_on_an_unchanged_entity_commits(
    database: str, sessions: sessionmaker[Session]
) -> None:
    with sessions.begin() as session:
        order = Order(customer="c-1", total=1.0)
        session.add(order)
    with sessions() as session:
        session.add(order)  # persistent, no row change

        @event.listens_for(session, "before_commit")  # runs after outboxer's before_commit
        def audit(session: Session) -> None:
            order.record_event("order.audited", {"n": 1})

        session.commit()
        assert payloads(database) == [{"n": 1}], "in the commit that recorded it"
        assert order.pending_events == ()
        event.remove(session, "before_commit", audit)
        with session.begin():  # not in a later, unrelated transaction
            session.add(Order(customer="c-2", total=2.0))
    assert payloads(database) == []


@pytest.fixture(params=["pg_url", "mysql_url"])
def async_database(request: pytest.FixtureRequest) -> str:
    url: str = request.getfixturevalue(request.param)
    return url


async def test_an_async_session_writes_a_retried_new_object_s_event_once(
    async_database: str,
) -> None:
    url = async_database
    async with async_engine(url) as engine:
        sessions = async_sessionmaker(engine, expire_on_commit=False)
        listen(sessions)
        async with sessions.begin() as session:
            session.add(Order(customer="taken", total=1.0))
        order = Order(customer="taken", total=2.0)
        order.record_event("order.placed", {"n": 1})
        async with sessions() as session:
            session.add(order)
            with pytest.raises(IntegrityError):
                await session.commit()
            await session.rollback()
            order.customer = "free"
            session.add(order)
            await session.commit()
    assert [json.loads(m.payload) for m in await claim_all_async(url)] == [{"n": 1}]


@pytest.mark.parametrize("vendor", ["pg_url", "mysql_url"])
def test_two_sessions_in_two_threads_commit_their_own_events_only(
    request: pytest.FixtureRequest, vendor: str
) -> None:
    database: str = request.getfixturevalue(vendor)
    engine = create_engine(sqlalchemy_url(database))
    Base.metadata.create_all(engine)
    factory = sessionmaker(engine, expire_on_commit=False)
    listen(factory)
    barrier = threading.Barrier(2)

    def work(name: str) -> None:
        with factory() as session:
            for n in range(20):
                order = Order(customer=f"{name}-{n}", total=float(n))
                session.add(order)
                order.record_event("order.placed", {"c": order.customer}, key=name)
                session.flush()
                if n == 0:
                    barrier.wait(timeout=10)  # both threads inside a transaction at once
                if n % 2:
                    session.rollback()
                else:
                    session.commit()

    try:
        with ThreadPoolExecutor(2) as pool:
            for result in [pool.submit(work, name) for name in ("a", "b")]:
                result.result(timeout=60)
    finally:
        engine.dispose()
    published = [json.loads(m.payload)["c"] for m in claim_all(database)]
    for name in ("a", "b"):
        mine = [c for c in published if c.startswith(f"{name}-")]
        assert mine == [f"{name}-{n}" for n in range(0, 20, 2)], "committed ones, once, in order"
