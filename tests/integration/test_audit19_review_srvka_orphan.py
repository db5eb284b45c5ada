"""A psycopg consumer connection keeps its server keepalives when ending the orphan fails.

cd9d7f5 set the backend's ``tcp_keepalives_*`` in the backend-id read and committed at the
end of the connect, after the orphan's end (the backend of the connection the bound cut off
before). That end may fail without failing the open (``Session._orphan_left``: logged, the
consumer goes on), but the failed statement aborted the transaction, and PostgreSQL answers
the COMMIT of an aborted transaction with a ROLLBACK, silently: the keepalives were undone,
the server back at its defaults (a first probe after two hours), on the very reconnect that
follows a network fault. Now the connect runs in autocommit (no BEGIN, no COMMIT).

The failure here is the server's own: the consumer's role is no superuser, and the orphan
it is told to end is a superuser's session ("must be a superuser to terminate superuser
process"; pg_read_all_stats lets the role see that session's start, so the statement is
tried).
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Iterator
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest

from outboxer.consumer_db import DaemonThreadPool, session_factory

#: 6 s idle, 2 s apart, 3 probes on the server's end.
BOUND = 13.0
KINDS = {"psycopg": False, "psycopg-async": True}
SETTINGS = (
    "SELECT current_setting('tcp_keepalives_idle'), current_setting('tcp_keepalives_interval'),"
    " current_setting('tcp_keepalives_count')"
)


@pytest.fixture
def plain_role_url(pg_url: str) -> Iterator[str]:
    """``pg_url`` as a new LOGIN role that is no superuser but reads every session's
    activity (pg_read_all_stats)."""
    role = f"srvka_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(pg_url, autocommit=True) as admin:
        admin.execute(f"CREATE ROLE {role} LOGIN NOSUPERUSER IN ROLE pg_read_all_stats")
    parts = urlsplit(pg_url)
    netloc = f"{role}@{parts.hostname}:{parts.port or 5432}"
    try:
        yield urlunsplit(parts._replace(netloc=netloc))
    finally:
        with psycopg.connect(pg_url, autocommit=True) as admin:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s",
                (role,),
            )
            admin.execute(f"DROP ROLE IF EXISTS {role}")


@pytest.mark.parametrize("kind", list(KINDS))
async def test_keepalives_survive_an_orphan_end_that_failed(
    kind: str, pg_url: str, plain_role_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    is_async = KINDS[kind]
    pool = DaemonThreadPool(1, thread_name_prefix="audit19-review-srvka")
    session = session_factory(
        plain_role_url, "outboxer", is_async=is_async, async_driver="psycopg"
    )(pool)
    session.statement_timeout = BOUND
    with psycopg.connect(pg_url, autocommit=True) as superuser:
        row = superuser.execute(
            "SELECT pid, backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid()"
        ).fetchone()
        assert row is not None
        session._orphan = (row[0], row[1])
        try:
            with caplog.at_level(logging.WARNING, logger="outboxer"):
                await session.open()
            # The open went on (as designed), the orphan's end reported as failed.
            assert "ending the server's side of a consumer connection" in caplog.text
            conn = session.conn
            if is_async:
                found = await (await conn.execute(SETTINGS)).fetchone()
                await conn.rollback()
            else:
                found = conn.execute(SETTINGS).fetchone()
                conn.rollback()
            assert tuple(found) == ("6", "2", "3")  # old code: ('7200', '75', '9')
            # The runner's transactions still begin as before (not in autocommit).
            assert not conn.autocommit
        finally:
            with contextlib.suppress(Exception):
                await session.close()
            pool.shutdown(wait=False)
