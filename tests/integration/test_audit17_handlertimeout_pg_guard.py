"""``Session.end_abandoned`` on PostgreSQL ends only the abandoned session's own backend.

It terminated ``pg_terminate_backend(pid)`` on the pid its connection had: once that backend
was gone (the server ended it, a restart of the server), another one may have the same pid,
and it was terminated instead, some other client's transaction with it. Now the backend is
terminated only if it also began when the abandoned session opened (``backend_start``, read
then): a backend with that pid but another start is left alone. The async sessions
(asyncpg, psycopg's AsyncConnection), which an async handler that ignores its cancellation
now abandons, end it the same way. MariaDB's ``KILL CONNECTION`` goes on working.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from outboxer.consumer_db import (
    AsyncpgSession,
    DaemonThreadPool,
    PsycopgAsyncSession,
    PsycopgSession,
    PyMySQLSession,
    Session,
)
from tests.waiting import wait_for

KINDS = ["psycopg", "asyncpg", "psycopg-async"]


@pytest.fixture
def threads() -> Iterator[DaemonThreadPool]:
    pool = DaemonThreadPool(2, thread_name_prefix="audit17-guard")
    yield pool
    pool.shutdown(wait=False)


def make(kind: str, url: str, threads: DaemonThreadPool) -> Session:
    if kind == "psycopg":
        return PsycopgSession(url, "outboxer", threads)
    if kind == "asyncpg":
        return AsyncpgSession(url, "outboxer")
    return PsycopgAsyncSession(url, "outboxer")


def backend_pid(session: Session) -> int:
    conn: Any = session.conn
    return int(
        conn.get_server_pid() if isinstance(session, AsyncpgSession) else conn.info.backend_pid
    )


def backends(url: str) -> dict[int, Any]:
    """pid -> backend_start of the database's backends."""
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pid, backend_start FROM pg_stat_activity WHERE datname = current_database()"
        ).fetchall()
    return {int(pid): started for pid, started in rows}


async def answers(session: Session) -> bool:
    """Whether the session's connection still runs a statement."""
    conn: Any = session.conn
    try:
        if isinstance(session, AsyncpgSession):
            await conn.fetchval("SELECT 1")
        elif isinstance(session, PsycopgAsyncSession):
            await conn.execute("SELECT 1")
            await conn.rollback()
        else:
            assert isinstance(session, PsycopgSession | PyMySQLSession)

            def select() -> None:
                cursor = conn.cursor()
                cursor.execute("SELECT 1")
                cursor.close()
                conn.rollback()

            await session._call(select)
    except Exception:  # terminated: the driver's error of a lost connection
        return False
    return True


@pytest.mark.parametrize("kind", KINDS)
def test_a_backend_that_began_at_another_time_is_not_terminated(
    pg_url: str, threads: DaemonThreadPool, kind: str
) -> None:
    async def scenario() -> tuple[bool, bool, dict[int, Any], int]:
        victim, killer = make(kind, pg_url, threads), make(kind, pg_url, threads)
        await victim.open()
        await killer.open()
        try:
            pid = backend_pid(victim)
            started = backends(pg_url)[pid]
            # As if the abandoned session's backend had ended and its pid gone to a backend
            # that began later: what the abandoned session knows of its backend, against
            # another backend with that pid.
            victim._backend = (pid, started - timedelta(seconds=1))  # type: ignore[attr-defined]
            await killer.end_abandoned(victim)
            alive = await answers(victim)  # a round trip after the terminate
            listed = backends(pg_url)
            # Its own backend, named as it began, is terminated.
            victim._backend = (pid, started)  # type: ignore[attr-defined]
            ended = await killer.end_abandoned(victim)
            return alive, ended, listed, pid
        finally:
            await killer.close()
            victim.discard()

    alive, ended, listed, pid = asyncio.run(scenario())
    # Before: terminated by its pid alone (the sync session; the async ones ended nothing).
    assert alive and pid in listed
    assert ended
    wait_for(lambda: pid not in backends(pg_url), 5, "the abandoned backend terminated")


def test_the_backend_is_read_when_the_session_opens(pg_url: str, threads: DaemonThreadPool) -> None:
    async def scenario() -> tuple[list[tuple[int, Any]], dict[int, Any]]:
        sessions = [make(kind, pg_url, threads) for kind in KINDS]
        for session in sessions:
            await session.open()
        try:
            known = [
                (backend_pid(session), session._backend)  # type: ignore[attr-defined]
                for session in sessions
            ]
            return known, backends(pg_url)
        finally:
            for session in sessions:
                await session.close()

    known, listed = asyncio.run(scenario())
    assert [backend for _, backend in known] == [(pid, listed[pid]) for pid, _ in known]


def test_mariadb_kill_connection_ends_the_abandoned_session(
    mysql_url: str, threads: DaemonThreadPool
) -> None:
    async def scenario() -> tuple[bool, bool]:
        victim = PyMySQLSession(mysql_url, "outboxer", threads)
        killer = PyMySQLSession(mysql_url, "outboxer", threads)
        await victim.open()
        await killer.open()
        try:
            ended = await killer.end_abandoned(victim)
            return ended, await answers(victim)
        finally:
            await killer.close()
            victim.discard()

    ended, alive = asyncio.run(scenario())
    assert ended and not alive
