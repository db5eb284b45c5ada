"""A program that uses ``Consumer.run()`` as a library (no ``outboxer consume``, whose
``os._exit`` ends a hung handler's thread) must be able to exit after SIGTERM: a sync handler
stuck for ever in its thread is abandoned after ``shutdown_timeout`` and must not keep the
interpreter waiting for that thread at exit; and after a second signal the broker's close
must not wait for ever either.

Real subprocesses: SQLite and the in-process broker; the time from SIGTERM to the exit is
measured, and a process that hangs is killed by its pid."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

SHUTDOWN_TIMEOUT = 0.5
#: shutdown_timeout, CANCELLED_WAIT (1 s), the interpreter's start and end: well below this.
EXIT_BOUND = 8.0

PROGRAM = textwrap.dedent(
    """
    import sys, threading
    from outboxer.brokers.memory import memory_broker
    from outboxer.consumer import Consumer
    from outboxer.errors import ConsumerShutdownError
    from outboxer.receivers.memory import MemoryReceiver
    from outboxer.testing import make_message

    db, mode = sys.argv[1], sys.argv[2]
    memory_broker("librun").messages.append(make_message("t", {"n": 1}, key="k"))

    def handler(message, conn):
        print("handler started", flush=True)
        threading.Event().wait()  # a network call that never returns

    if mode == "close":
        import asyncio

        async def close_for_ever(self):
            print("closing", flush=True)
            await asyncio.Event().wait()  # a broker that never answers the close

        MemoryReceiver.close = close_for_ever
        handler = lambda message, conn: print("handler started", flush=True)

    consumer = Consumer(
        db=db, broker="memory://librun", group="g", handler=handler,
        shutdown_timeout=float(sys.argv[3]),
    )
    try:
        consumer.run()
    except ConsumerShutdownError as exc:
        print("run raised", type(exc).__name__, "hung" if exc.hung else "", flush=True)
    else:
        print("run returned", flush=True)
    """
)


@pytest.fixture
def program(tmp_path: Path) -> Path:
    path = tmp_path / "librun.py"
    path.write_text(PROGRAM)
    return path


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for process in started:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
            process.wait()


def start(
    processes: list[subprocess.Popen[str]], program: Path, db: str, mode: str
) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [sys.executable, str(program), db, mode, str(SHUTDOWN_TIMEOUT)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    processes.append(process)
    return process


def wait_for_line(process: subprocess.Popen[str], wanted: str, timeout: float = 20.0) -> list[str]:
    """Lines read up to the first containing ``wanted`` (the read is bounded by a kill)."""
    assert process.stdout is not None
    timer = time_bomb(process, timeout)
    lines: list[str] = []
    try:
        for line in process.stdout:
            lines.append(line)
            if wanted in line:
                return lines
    finally:
        timer.cancel()
    pytest.fail(f"{wanted!r} never came: {''.join(lines)}")


def time_bomb(process: subprocess.Popen[str], timeout: float) -> threading.Timer:
    timer = threading.Timer(timeout, lambda: process.poll() is None and process.kill())
    timer.daemon = True
    timer.start()
    return timer


def exit_after(process: subprocess.Popen[str], since: float) -> tuple[float | None, str]:
    """Seconds from ``since`` to the process's exit, None if it is still running after
    EXIT_BOUND (then killed), and what it printed."""
    try:
        out, _ = process.communicate(timeout=EXIT_BOUND)
    except subprocess.TimeoutExpired:
        process.kill()
        out, _ = process.communicate()
        return None, out
    return time.monotonic() - since, out


def test_run_returns_and_the_process_exits_with_a_handler_hung_for_ever(
    processes: list[subprocess.Popen[str]], program: Path, sqlite_url: str
) -> None:
    process = start(processes, program, sqlite_url, "handler")
    wait_for_line(process, "handler started")
    signalled = time.monotonic()
    process.send_signal(signal.SIGTERM)
    took, out = exit_after(process, signalled)
    assert "run raised ConsumerShutdownError hung" in out, out
    assert took is not None, f"still running {EXIT_BOUND}s after SIGTERM: {out}"
    # shutdown_timeout + CANCELLED_WAIT, and the interpreter's end
    assert took < SHUTDOWN_TIMEOUT + 1.0 + 3.0, (took, out)
    assert process.returncode == 0, out


def test_a_second_signal_bounds_a_broker_close_that_never_ends(
    processes: list[subprocess.Popen[str]], program: Path, sqlite_url: str
) -> None:
    process = start(processes, program, sqlite_url, "close")
    wait_for_line(process, "handler started")
    process.send_signal(signal.SIGTERM)
    wait_for_line(process, "closing")
    forced = time.monotonic()
    process.send_signal(signal.SIGTERM)
    took, out = exit_after(process, forced)
    assert took is not None, f"still running {EXIT_BOUND}s after the second SIGTERM: {out}"
    assert took < 1.0 + 3.0, (took, out)
    assert "run returned" in out, out
    assert process.returncode == 0, out
