"""``manage.py outboxer_consume`` takes ``statement_timeout`` as ``outboxer consume`` does:
``--statement-timeout`` for one run, else ``OUTBOXER["consumer"]["statement_timeout"]``,
else ``OUTBOXER_CONSUMER_STATEMENT_TIMEOUT``, else the Consumer's default (a minute); a bad
value is refused naming where it was written. The command's real parser and settings are
used; only the run itself is replaced, by one that records the Consumer it was given.

Django runs in a subprocess (tests/contrib/django_project): its settings are process-wide.
"""

from __future__ import annotations

import json

from tests.contrib.test_audit5_contrib_django import run_django

SCRIPT = """
    import json
    import os

    import django
    from django.conf import settings
    import tests.contrib.django_project.settings as project

    values = {name: getattr(project, name) for name in dir(project) if name.isupper()}
    values["DATABASES"] = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": "INBOX"}}
    settings.configure(**values)
    django.setup()
    from django.core.management import call_command
    from django.core.management.base import CommandError

    from outboxer.consumer import ConsumerStats
    from outboxer.contrib.django.management.commands import outboxer_consume

    bounds = []

    async def recorded(consumer, settings):
        bounds.append(consumer.statement_timeout)
        return ConsumerStats()

    outboxer_consume.run_consumer = recorded
    os.environ.pop("OUTBOXER_CONSUMER_STATEMENT_TIMEOUT", None)
    handler = "tests.contrib.django_project.shop.handlers:ship"

    def consume(own, *flags):
        settings.OUTBOXER = {"broker": "memory://audit19", "consumer": {"group": "g", **own}}
        try:
            call_command("outboxer_consume", handler, *flags, verbosity=0)
        except CommandError as exc:
            bounds.append(str(exc))

    consume({})
    os.environ["OUTBOXER_CONSUMER_STATEMENT_TIMEOUT"] = "1500ms"
    consume({})
    consume({"statement_timeout": "2s"})
    consume({"statement_timeout": 3})
    consume({"statement_timeout": "2s"}, "--statement-timeout", "250ms")
    consume({"statement_timeout": 0})
    consume({}, "--statement-timeout", "nan")
    print(json.dumps(bounds))
"""


def test_outboxer_consume_takes_statement_timeout_from_its_flag_settings_and_variable(
    sqlite_url: str,
) -> None:
    inbox = sqlite_url.removeprefix("sqlite:///")
    output = run_django(SCRIPT.replace("INBOX", inbox), sqlite_url)
    default, variable, setting, number, flag, zero, nan = json.loads(output.splitlines()[-1])
    assert (default, variable, setting, number, flag) == (60.0, 1.5, 2.0, 3.0, 0.25)
    assert 'settings.OUTBOXER["consumer"]' in zero and "statement_timeout" in zero, zero
    assert "must be greater than zero" in zero, zero
    assert "--statement-timeout" in nan, nan
