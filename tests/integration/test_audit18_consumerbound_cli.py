"""``outboxer dead-letters list`` and ``purge`` on a consumer database that stops answering:
each gives up after the session's ``statement_timeout`` (a minute by default, lowered here)
and exits 1 saying what did not answer. Before, both waited for ever.

The fault: a proxy in front of the database, stalled (it accepts and forwards nothing) just
after the command's connection opened; or a listener that accepts and never answers."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest

from outboxer.cli import main
from outboxer.consumer_db import (
    DaemonThreadPool,
    PsycopgSession,
    PyMySQLSession,
    Session,
    SyncSession,
)
from outboxer.receivers.base import Delivery
from tests.chaos.proxy import FaultProxy
from tests.integration.test_audit17_bounds_mysql_hung import _through
from tests.integration.test_audit18_consumerbound_stalled_db import _through_pg
from tests.s3 import silent_listener

BOUND = 0.5
#: How long the old code was watched waiting for ever before the test gave up on it.
GIVE_UP = 5.0


@pytest.fixture
def bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI's sessions bounded by BOUND (a minute by default)."""
    monkeypatch.setattr(Session, "statement_timeout", BOUND, raising=False)


def _stalled_after_connect(
    monkeypatch: pytest.MonkeyPatch, kind: type[SyncSession], proxy: FaultProxy
) -> None:
    """The database stops answering as soon as the command's connection is open."""
    connect = kind._connect

    def then_stall(self: SyncSession) -> Any:
        conn = connect(self)
        proxy.stall()
        return conn

    monkeypatch.setattr(kind, "_connect", then_stall)


async def _outboxer(*args: str) -> tuple[int, float]:
    """``outboxer ARGS``' exit status and seconds, in a thread (its own asyncio.run)."""
    began = time.monotonic()
    code = await asyncio.wait_for(asyncio.to_thread(main, list(args)), GIVE_UP)
    return code, time.monotonic() - began


@pytest.fixture
def mysql_proxy(mysql_url: str) -> Iterator[FaultProxy]:
    proxy = FaultProxy(urlsplit(mysql_url).port or 3306).start()
    yield proxy
    proxy.resume()
    proxy.stop()


async def _dead_letter(url: str) -> uuid.UUID:
    """One dead letter of group g, written directly (not through the proxy)."""
    pool = DaemonThreadPool(1)
    session = PyMySQLSession(url, "outboxer", pool)
    await session.open()
    message_id = uuid.uuid4()
    delivery = Delivery(message_id, "t", "k", {}, {"n": 1}, b'{"n": 1}', "application/json")
    try:
        await session.record_dead_letter("g", delivery, "boom", 3)
    finally:
        await session.close()
        pool.shutdown(wait=False)
    return message_id


@pytest.mark.usefixtures("bounded")
async def test_dead_letters_list_on_a_stalled_postgres_exits_1_saying_so(
    pg_url: str,
    pg_proxy: FaultProxy,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _stalled_after_connect(monkeypatch, PsycopgSession, pg_proxy)
    url = _through_pg(pg_url, pg_proxy.port)
    try:
        code, took = await _outboxer("dead-letters", "list", "--db", url, "--group", "g")
    finally:
        pg_proxy.resume()  # the old code's statement is answered then
    assert code == 1
    assert took < BOUND + 2.0, took
    err = capsys.readouterr().err
    assert "dead-letters list: the consumer's database did not answer within 0.5s" in err


@pytest.mark.usefixtures("bounded")
async def test_dead_letters_purge_on_a_stalled_mysql_exits_1_and_purges_nothing(
    mysql_url: str,
    mysql_proxy: FaultProxy,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    kept = await _dead_letter(mysql_url)
    _stalled_after_connect(monkeypatch, PyMySQLSession, mysql_proxy)
    url = _through(mysql_url, mysql_proxy.port)
    try:
        code, took = await _outboxer("dead-letters", "purge", "--all", "--db", url, "--group", "g")
    finally:
        mysql_proxy.resume()
    assert code == 1
    assert took < BOUND + 2.0, took
    err = capsys.readouterr().err
    assert "dead-letters purge: the consumer's database did not answer within 0.5s" in err
    assert "0 dead letter(s) purged before it" in err
    # Its DELETE never committed: the dead letter is still there.
    code, _ = await _outboxer("dead-letters", "list", "--json", "--db", mysql_url, "--group", "g")
    assert code == 0
    assert str(kept) in capsys.readouterr().out


@pytest.mark.usefixtures("bounded")
@pytest.mark.parametrize("command", ["list", "purge"])
async def test_dead_letters_on_a_database_that_never_answers_the_connect_exit_1(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with silent_listener() as address:
        extra = ["--all"] if command == "purge" else []
        code, took = await _outboxer(
            "dead-letters", command, *extra, "--db", f"mysql://root@{address}/db", "--group", "g"
        )
    assert code == 1
    assert took < BOUND + 2.0, took
    err = capsys.readouterr().err
    assert f"dead-letters {command}: cannot connect to the consumer's database: no answer" in err
