"""PostgreSQL: an operator's purge, requeue or replay chosen as a deadlock's victim on every
try is reported as outboxer's own error (StoreError), as on MySQL, not as asyncpg's
DeadlockDetectedError.

Raised as the driver's error, the CLI took it for an unexpected failure (`outboxer:
DeadlockDetectedError: deadlock detected (run with --log-level DEBUG for the traceback)`)
and Django admin's requeue action, which reports outboxer's errors as a message, let it
through as a server error (500). The tries are cut to one (DEADLOCK_TRIES) so that one real
deadlock outlasts them: an operator's session holds the second of two rows, the command
locks the first and waits for it, then the operator asks for the first. The command waited
first, so the server fails it.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest

from outboxer import admin
from outboxer.admin import MessageFilter
from outboxer.cli import main
from outboxer.errors import StoreError
from outboxer.stores import postgres
from tests.integration.test_audit18_deadlock_pg_retry import _deadlock
from tests.integration.test_audit19_pgopdeadlock_requeue_purge import outbox_rows, statuses

LOCK_ROW = "SELECT 1 FROM outboxer.outbox WHERE id = $1 FOR UPDATE"


@pytest.fixture(params=["pg_url", "pg_partitioned_url"])
def url(request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue(request.param))


@pytest.fixture(autouse=True)
def one_try(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(postgres, "DEADLOCK_TRIES", 1)


async def _two_rows(url: str) -> tuple[uuid.UUID, uuid.UUID]:
    """Two ABANDONED rows, the first before the second in the heap and by id."""
    ids = await outbox_rows(url, [("a", "ABANDONED", 2), ("b", "ABANDONED", 1)])
    return ids["a"], ids["b"]


async def test_a_purge_that_stays_a_deadlocks_victim_is_a_store_error(url: str) -> None:
    first, second = await _two_rows(url)
    with pytest.raises(StoreError, match="chose a purge as a deadlock's victim") as caught:
        await _deadlock(
            url,
            (LOCK_ROW, (second,)),
            (LOCK_ROW, (first,)),
            lambda store: admin.purge(store, MessageFilter(ids=(first, second))),
        )
    assert "deadlock detected" in str(caught.value)
    assert "run it again" in str(caught.value)
    assert await statuses(url) == {"a": "ABANDONED", "b": "ABANDONED"}  # rolled back


async def test_a_requeue_that_stays_a_deadlocks_victim_is_a_store_error(pg_url: str) -> None:
    first, second = await _two_rows(pg_url)
    with pytest.raises(StoreError, match="chose a requeue as a deadlock's victim"):
        await _deadlock(
            pg_url,
            (LOCK_ROW, (second,)),
            (LOCK_ROW, (first,)),
            lambda store: store.requeue_matching_counted(
                MessageFilter(ids=(first, second), statuses=("ABANDONED",))
            ),
        )
    assert await statuses(pg_url) == {"a": "ABANDONED", "b": "ABANDONED"}


async def test_the_cli_says_so_as_outboxers_error_not_as_an_unexpected_one(
    pg_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    first, second = await _two_rows(pg_url)
    argv = ["purge", "--db", pg_url, "--id", str(first), "--id", str(second)]

    async def purge(_: Any) -> int:
        return await asyncio.to_thread(main, argv)

    code = await _deadlock(pg_url, (LOCK_ROW, (second,)), (LOCK_ROW, (first,)), purge)
    err = capsys.readouterr().err
    assert code == 1, err
    assert "outboxer: PostgreSQL chose a purge as a deadlock's victim" in err, err
    assert "DeadlockDetectedError" not in err and "traceback" not in err, err
