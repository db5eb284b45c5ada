"""``running_relay`` and ``running_stream_relay`` close their source's database connection
even when the relay they run raises (here: options it refuses with ConfigError).

They closed it only after the relay stopped cleanly: a relay that raised left one open
connection per use, open for as long as the error's traceback lived. Log mode against the shared PostgreSQL.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import psycopg
import pytest

from outboxer.enqueue import Outbox
from outboxer.errors import ConfigError
from outboxer.stores.pglog import PgLog
from outboxer.streamtesting import StreamHarness, running_relay, running_stream_relay
from tests.pgmodes.test_log_mode import LogHarness


def _others(url: str) -> int:
    """Sessions on the test's own database other than this one."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        ).fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.parametrize(
    "helper",
    [
        lambda harness: running_relay(harness, "default", batch_size=0),
        lambda harness: running_stream_relay(harness, "default", max_attempts=0),
    ],
    ids=["running_relay", "running_stream_relay"],
)
async def test_a_relay_that_raises_leaves_no_connection_open(
    pg_url: str, helper: Callable[[StreamHarness], AbstractAsyncContextManager[Any]]
) -> None:
    async with PgLog(pg_url) as log:
        await log.apply_schema()
    harness = LogHarness(pg_url, Outbox(mode="log"))
    before = _others(pg_url)
    with pytest.raises(ConfigError, match="must be >= 1") as raised:
        async with helper(harness):
            pass
    # Counted while the error is still held, as pytest holds a failed test's: a connection
    # left to the garbage collector stays open for as long as its traceback lives.
    assert _others(pg_url) == before, raised.value
