"""``outboxer dead-letters list`` and ``purge`` take ``--statement-timeout`` (and its
variable) as ``consume`` does: their connection to a database that stops answering gives
up after it, where before it was a minute, not settable (only tests could lower it)."""

from __future__ import annotations

import pytest

from outboxer.consumer_db import PsycopgSession, PyMySQLSession
from tests.chaos.proxy import FaultProxy
from tests.integration.test_audit17_bounds_mysql_hung import _through
from tests.integration.test_audit18_consumerbound_cli import (
    BOUND,
    _outboxer,
    _stalled_after_connect,
    mysql_proxy,
)
from tests.integration.test_audit18_consumerbound_stalled_db import _through_pg

__all__ = ["mysql_proxy"]  # the fixture, used by name

#: Room past BOUND for the watchdog's tick and a loaded machine.
SLACK = 2.0


async def test_dead_letters_list_gives_up_after_the_flags_bound(
    pg_url: str,
    pg_proxy: FaultProxy,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _stalled_after_connect(monkeypatch, PsycopgSession, pg_proxy)
    url = _through_pg(pg_url, pg_proxy.port)
    try:
        code, took = await _outboxer(
            "dead-letters", "list", "--db", url, "--group", "g", "--statement-timeout", "500ms"
        )
    finally:
        pg_proxy.resume()
    assert code == 1
    assert BOUND <= took < BOUND + SLACK, took
    err = capsys.readouterr().err
    assert f"dead-letters list: the consumer's database did not answer within {BOUND:g}s" in err


async def test_dead_letters_purge_gives_up_after_the_variables_bound(
    mysql_url: str,
    mysql_proxy: FaultProxy,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("OUTBOXER_CONSUMER_STATEMENT_TIMEOUT", f"{BOUND:g}")
    _stalled_after_connect(monkeypatch, PyMySQLSession, mysql_proxy)
    url = _through(mysql_url, mysql_proxy.port)
    try:
        code, took = await _outboxer("dead-letters", "purge", "--all", "--db", url, "--group", "g")
    finally:
        mysql_proxy.resume()
    assert code == 1
    assert BOUND <= took < BOUND + SLACK, took
    err = capsys.readouterr().err
    assert f"dead-letters purge: the consumer's database did not answer within {BOUND:g}s" in err
