"""DaemonThreadPool, the consumer sessions' threads: daemon threads, at most max_workers of
them whatever the number of calls (no thread per call), and an executor's contract."""

from __future__ import annotations

import threading
import time

import pytest

from outboxer.consumer_db import DaemonThreadPool


def test_calls_run_on_at_most_max_workers_daemon_threads() -> None:
    pool = DaemonThreadPool(2, thread_name_prefix="t")
    seen: set[threading.Thread] = set()
    try:
        for future in [pool.submit(threading.current_thread) for _ in range(200)]:
            seen.add(future.result(timeout=5))
        assert 1 <= len(seen) <= 2
        assert all(thread.daemon for thread in seen)
        assert pool.submit(divmod, 7, 2).result(timeout=5) == (3, 1)
        with pytest.raises(ZeroDivisionError):
            pool.submit(divmod, 1, 0).result(timeout=5)
    finally:
        pool.shutdown(wait=True)
    assert not any(thread.is_alive() for thread in seen)
    with pytest.raises(RuntimeError):
        pool.submit(int)


def test_shutdown_without_waiting_leaves_a_hung_call_and_cancels_queued_ones() -> None:
    pool = DaemonThreadPool(1)
    release = threading.Event()
    hung = pool.submit(release.wait)
    deadline = time.monotonic() + 5
    while not hung.running():  # taken by the thread, not still queued
        assert time.monotonic() < deadline, "the call never started"
        time.sleep(0.001)
    queued = pool.submit(int)
    pool.shutdown(wait=False, cancel_futures=True)
    assert queued.cancelled()
    assert not hung.done()
    release.set()
    assert hung.result(timeout=5) is True
