"""A program that runs ``Consumer.run()`` on Django's connection (``sessions=django_sessions``)
as a library, not through ``manage.py outboxer_consume`` (whose ``os._exit`` ends a hung
handler's thread): a handler stuck for ever must not keep the process from exiting after
SIGTERM, once the consumer abandoned its batch (``shutdown_timeout``). Each DjangoSession
has a thread of its own, which the interpreter joined at exit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from tests.contrib.test_django import ROOT, SETTINGS
from tests.integration.test_audit12_librun_exit import (
    EXIT_BOUND,
    exit_after,
    processes,
    wait_for_line,
)

__all__ = ["processes"]

PROGRAM = textwrap.dedent(
    """
    import sys, threading
    import django
    django.setup()
    from outboxer.brokers.memory import memory_broker
    from outboxer.consumer import Consumer
    from outboxer.contrib.django.consumer import django_sessions
    from outboxer.errors import ConsumerShutdownError
    from outboxer.testing import make_message

    memory_broker("librun-django").messages.append(make_message("t", {"n": 1}, key="k"))

    def handler(message, conn):
        print("handler started", flush=True)
        threading.Event().wait()  # a network call that never returns

    consumer = Consumer(
        db=sys.argv[1], broker="memory://librun-django", group="g", handler=handler,
        shutdown_timeout=0.5, sessions=django_sessions("default", "outboxer"),
    )
    try:
        consumer.run()
    except ConsumerShutdownError as exc:
        print("run raised", type(exc).__name__, "hung" if exc.hung else "", flush=True)
    """
)


def test_a_django_session_handler_hung_for_ever_does_not_keep_the_process(
    processes: list[subprocess.Popen[str]], tmp_path: Path, sqlite_url: str
) -> None:
    program = tmp_path / "librun_django.py"
    program.write_text(PROGRAM)
    env = dict(
        os.environ,
        OUTBOXER_TEST_DJANGO_DB=sqlite_url,
        # After a PYTHONPATH of the caller's (the old code, to show the test fails there).
        PYTHONPATH=os.pathsep.join(filter(None, (os.environ.get("PYTHONPATH"), str(ROOT)))),
        DJANGO_SETTINGS_MODULE=SETTINGS,
        PYTHONUNBUFFERED="1",
    )
    process = subprocess.Popen(
        [sys.executable, str(program), sqlite_url],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    processes.append(process)
    wait_for_line(process, "handler started")
    signalled = time.monotonic()
    process.send_signal(signal.SIGTERM)
    took, out = exit_after(process, signalled)
    assert "run raised ConsumerShutdownError hung" in out, out
    assert took is not None, f"still running {EXIT_BOUND}s after SIGTERM: {out}"
    assert took < 0.5 + 1.0 + 3.0, (took, out)
    assert process.returncode == 0, out
