"""``manage.py outboxer_relay`` and ``outboxer_consume`` stop cleanly (exit 0, no traceback)
on SIGTERM at any moment, even before their event loop took the signal over, as the CLI's
daemons do: an orchestrator may stop a process the moment it starts.

Django runs in a subprocess (tests/contrib/django_project): its settings are process-wide.
The subprocess sends itself SIGTERM while the command is still building its relays or its
consumer, the window in which no event loop handles the signal yet.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tests.contrib.test_django import ROOT, SETTINGS

STOPPED_WHILE_STARTING = textwrap.dedent(
    """
    import os, signal, sys
    import django
    django.setup()
    from django.core.management import call_command
    import {module} as target

    def starting(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # stopped while it starts
        raise AssertionError("SIGTERM did not stop the command")

    *path, attribute = {name!r}.split(".")
    for part in path:
        target = getattr(target, part)
    setattr(target, attribute, staticmethod(starting) if path else starting)
    call_command(*sys.argv[1:])
    print("returned cleanly")
    """
)

COMMANDS = {
    # The relay builds its RelayGroup inside its event loop, before the loop's handlers.
    "outboxer_relay": ("outboxer.cli", "RelayGroup.from_settings", ["outboxer_relay"]),
    # The consumer is built before its event loop even starts.
    "outboxer_consume": (
        "outboxer.contrib.django.management.commands.outboxer_consume",
        "django_consumer",
        ["outboxer_consume", "--group", "g", "--topic", "t",
         "tests.contrib.django_project.shop.handlers:ship"],
    ),
}  # fmt: skip


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_sigterm_while_the_command_starts_stops_it_cleanly(command: str, sqlite_url: str) -> None:
    module, name, argv = COMMANDS[command]
    env = dict(
        os.environ,
        OUTBOXER_TEST_DJANGO_DB=sqlite_url,
        PYTHONPATH=str(ROOT),
        DJANGO_SETTINGS_MODULE=SETTINGS,
    )
    script = STOPPED_WHILE_STARTING.format(module=module, name=name)
    result = subprocess.run(
        [sys.executable, "-c", script, *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != -signal.SIGTERM, "killed by SIGTERM's default action"
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    assert "returned cleanly" in result.stdout
    assert "Traceback" not in result.stderr, result.stderr
