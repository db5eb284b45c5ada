"""``manage.py outboxer_consume`` bounds a claim-checked payload's fetch with the
``claim_check_read_timeout`` of ``settings.OUTBOXER`` (a shared setting, beside
``claim_check_store``; ``--claim-check-read-timeout`` for one run), as ``outboxer consume``
does: a hung store is given up after that time, not the 30 s default, and the message is a
failed attempt (here, with max_attempts=1, a dead letter).

Django runs in a subprocess (tests/contrib/django_project): its settings are process-wide.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from tests.contrib.test_audit5_contrib_django import run_django

HUNG = """
    import threading
    import time

    import django
    from django.conf import settings
    import tests.contrib.django_project.settings as project

    values = {{name: getattr(project, name) for name in dir(project) if name.isupper()}}
    values["DATABASES"] = {{
        "default": {{"ENGINE": "django.db.backends.sqlite3", "NAME": "{inbox}"}},
    }}
    values["OUTBOXER"] = {{
        "broker": "memory://audit12-cctimeout",
        "claim_check_store": "{store}",
        "claim_check_read_timeout": {setting},
        "max_attempts": 1,
        "consumer": {{"group": "g", "handler": "tests.contrib.django_project.shop.handlers:ship"}},
    }}
    settings.configure(**values)
    django.setup()
    from django.core.management import call_command

    from outboxer.brokers.memory import memory_broker
    from outboxer.claimcheck import ClaimCheck, FileObjectStore
    from outboxer.testing import make_message

    store = FileObjectStore("{directory}")
    message = ClaimCheck(store, threshold=10).offload(make_message("t", {{"x": "y" * 50}}))
    memory_broker("audit12-cctimeout").messages.append(message)
    hung = threading.Event()
    FileObjectStore.get_at_most = lambda self, name, size: hung.wait(60) and b""  # a dead mount

    began = time.monotonic()
    call_command("outboxer_consume", "--exit-when-idle", *{flags})
    print("took", time.monotonic() - began)
"""


@pytest.mark.parametrize(
    ("setting", "flags"),
    [("'400ms'", []), ("None", ["--claim-check-read-timeout", "400ms"])],
    ids=["OUTBOXER", "flag"],
)
def test_a_hung_store_is_given_up_after_the_configured_read_timeout(
    sqlite_url: str, tmp_path: Path, setting: str, flags: list[str]
) -> None:
    inbox = sqlite_url.removeprefix("sqlite:///")
    directory = tmp_path / "claims"
    script = HUNG.format(
        inbox=inbox,
        store=directory.as_uri(),
        directory=directory,
        setting=setting,
        flags=flags,
    )
    output = run_django(script, sqlite_url)
    took = float(output.strip().splitlines()[-1].split()[1])
    assert took < 10, output  # not the 30 s default
    assert "dead letters 1" in output, output
    with sqlite3.connect(inbox) as conn:
        [(error,)] = conn.execute("SELECT error FROM dead_letters").fetchall()
    assert "ObjectReadTimeoutError" in error and "within 0.4 s" in error, error
