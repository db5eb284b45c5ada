"""A consumer's psycopg connect with ``PGCONNECT_TIMEOUT`` in the environment (and none in
the URL) gives up within it on every psycopg the ``psycopg`` extra allows (``>=3.1``).

psycopg drives libpq without blocking, where libpq enforces no connect timeout
(``PQconnectPoll`` ignores it): psycopg does, from the timeout it reads. psycopg 3.1.0 reads
the conninfo's ``connect_timeout`` only, not the environment variable, and the consumer left
``connect_timeout`` out when the variable was set ("the user's own"): its connect to a
database that accepts and never answers waited for ever, where without the variable it gave
up after the bound. Measured in a venv with psycopg 3.1.0, a listener that never answers,
``PGCONNECT_TIMEOUT=2``: still connecting after 8 s; with ``connect_timeout=2`` given, 2.0 s.
The variable's value is now passed as ``connect_timeout`` (the URL's still wins).

psycopg 3.1.0's choice of timeout is reproduced here on the installed psycopg (its
``Connection._get_connection_params``: the conninfo's ``connect_timeout``, else none)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import psycopg.connection
import psycopg.connection_async
import pytest

from outboxer.consumer_db import DaemonThreadPool, session_factory
from outboxer.stores.mysql import NoAnswerError
from tests.s3 import silent_listener

#: The consumer's bound (lowered), and the environment's connect timeout (whole seconds).
BOUND = 0.5
ENVIRONMENT = 2
#: How long the old code was watched waiting for ever before the test gave up on it.
GIVE_UP = 5.0


def _psycopg_3_1_0_timeout(params: dict[str, Any]) -> int | None:
    """psycopg 3.1.0's connect timeout: the conninfo's connect_timeout, or none at all."""
    return int(params["connect_timeout"]) if "connect_timeout" in params else None


@pytest.mark.parametrize("kind", ["psycopg", "psycopg-async"])
async def test_a_connect_with_pgconnect_timeout_set_gives_up_on_psycopg_3_1(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PGCONNECT_TIMEOUT", str(ENVIRONMENT))
    for module in (psycopg.connection, psycopg.connection_async):
        monkeypatch.setattr(module, "timeout_from_conninfo", _psycopg_3_1_0_timeout)
    pool = DaemonThreadPool(1, thread_name_prefix="audit18-pgconnect")
    with silent_listener() as address:
        make = session_factory(
            f"postgresql://postgres@{address}/db",
            "outboxer",
            is_async=kind != "psycopg",
            async_driver="psycopg",
        )
        session = make(pool)
        session.statement_timeout = BOUND
        began = time.monotonic()
        try:
            async with asyncio.timeout(GIVE_UP):  # the old code waited here for ever
                with pytest.raises(NoAnswerError, match="PGCONNECT_TIMEOUT"):
                    await session.open()
        finally:
            pool.shutdown(wait=False)
        took = time.monotonic() - began
    assert ENVIRONMENT - 0.2 <= took < ENVIRONMENT + 1.0, took  # the environment's, not the bound
    assert session.conn is None
