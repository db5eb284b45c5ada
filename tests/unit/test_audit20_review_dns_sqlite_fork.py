"""A SQLite store used before a fork (a prefork server's worker, multiprocessing's fork start
method) answers in the child.

Its statements run on a thread of the store's own (``outboxer-sqlite``), made on first use.
A forked child has none of the parent's threads, but the store's ThreadPoolExecutor still
counted that one (idle, or busy) and made no other: the child's first statement waited for
ever. (With asyncio's default executor, before, each event loop had executors of its own.)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")

CHILD = """
import asyncio, os, sys
from outboxer.stores import create_store

store = create_store(sys.argv[1])


async def parent() -> None:
    await store.apply_schema()
    assert await store.applied_migrations()


asyncio.run(parent())
pid = os.fork()
if pid == 0:
    async def child() -> set[int]:
        return await asyncio.wait_for(store.applied_migrations(), 3)

    try:
        applied = asyncio.run(child())
        asyncio.run(store.close())
    except BaseException as exc:
        print("child:", type(exc).__name__, exc, flush=True)
        os._exit(1)
    print("child: applied", sorted(applied), flush=True)
    os._exit(0)
_, status = os.waitpid(pid, 0)
asyncio.run(store.close())
sys.exit(os.waitstatus_to_exitcode(status))
"""


def test_a_store_used_before_a_fork_answers_in_the_child(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'outbox.db'}"
    done = subprocess.run(
        [sys.executable, "-c", CHILD, url], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-2000:]
    assert "child: applied [1" in done.stdout, done.stdout
