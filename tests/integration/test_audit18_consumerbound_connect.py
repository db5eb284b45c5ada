"""A consumer session's connect to a database that accepts and never answers (a stalled
proxy, a host whose listener hangs) gives up within the session's ``statement_timeout``
(psycopg: libpq's connect_timeout, whole seconds, 2 at least): NoAnswerError, an outage the
runner backs off from. Before, psycopg's and PyMySQL's handshakes waited for ever (PyMySQL's
connect_timeout covers the TCP connect only), asyncpg's for its default minute."""

from __future__ import annotations

import asyncio
import time

import pytest

from outboxer.consumer_db import DaemonThreadPool, session_factory
from outboxer.stores.mysql import NoAnswerError  # the relay's, the consumer's too
from tests.s3 import silent_listener

BOUND = 0.5
#: The most a connect may take: libpq's connect_timeout is whole seconds, 2 at least.
LONGEST = 2.0 + 1.0
#: How long the old code was watched waiting before the test gave up on it.
GIVE_UP = 5.0

KINDS = {
    "psycopg": ("postgresql://postgres@{}/db", False, None),
    "pymysql": ("mysql://root@{}/db", False, None),
    "asyncpg": ("postgresql://postgres@{}/db", True, "asyncpg"),
    "psycopg-async": ("postgresql://postgres@{}/db", True, "psycopg"),
}


@pytest.mark.parametrize("kind", list(KINDS))
async def test_a_connect_to_a_database_that_never_answers_gives_up_within_the_bound(
    kind: str,
) -> None:
    template, is_async, driver = KINDS[kind]
    pool = DaemonThreadPool(1, thread_name_prefix="audit18-connect")
    with silent_listener() as address:
        make = session_factory(
            template.format(address), "outboxer", is_async=is_async, async_driver=driver
        )
        session = make(pool)
        session.statement_timeout = BOUND
        began = time.monotonic()
        try:
            async with asyncio.timeout(GIVE_UP):  # the old code waited here
                with pytest.raises(NoAnswerError, match=r"no answer within 0\.5s"):
                    await session.open()
        finally:
            pool.shutdown(wait=False)
        took = time.monotonic() - began
    assert took < LONGEST, took
    assert session.conn is None
