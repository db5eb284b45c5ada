"""Django model events and ``using``: the events of ``save()`` go to the database the row
goes to, ``using`` given by keyword or (deprecated, still honoured) positionally.

Django runs in a subprocess (its settings are process-wide), on two SQLite files.
"""

from __future__ import annotations

import json
import pathlib

from tests.contrib.test_audit5_contrib_django import run_django

TWO_DATABASES = """
    import json
    import warnings
    import django
    from django.conf import settings
    import tests.contrib.django_project.settings as project

    values = {name: getattr(project, name) for name in dir(project) if name.isupper()}
    values["DATABASES"] = {
        "default": {"ENGINE": "django.db.backends.sqlite3", "NAME": %(default)r},
        "other": {"ENGINE": "django.db.backends.sqlite3", "NAME": %(other)r},
    }
    settings.configure(**values)
    django.setup()
    from django.core.management import call_command
    from django.db import connections
    from tests.contrib.django_project.shop.models import Order

    for alias in ("default", "other"):
        call_command("migrate", database=alias, verbosity=0)

    def outbox(alias):
        with connections[alias].cursor() as cursor:
            cursor.execute("SELECT payload FROM outbox ORDER BY seq")
            return [json.loads(payload) for (payload,) in cursor.fetchall()]

    def orders(alias):
        return list(Order.objects.using(alias).values_list("customer", flat=True))

    keyword = Order(customer="c-1")
    keyword.record_event("order.placed", {"n": 1})
    keyword.save(using="other")
    positional = Order(customer="c-2")
    positional.record_event("order.placed", {"n": 2})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Django 5.x deprecates positional save() arguments
        positional.save(False, False, "other")
    print(json.dumps({alias: [orders(alias), outbox(alias)] for alias in ("default", "other")}))
"""


def test_save_writes_the_events_to_the_database_the_row_goes_to(
    sqlite_url: str, tmp_path: pathlib.Path
) -> None:
    script = TWO_DATABASES % {"default": str(tmp_path / "a.db"), "other": str(tmp_path / "b.db")}
    result = json.loads(run_django(script, sqlite_url))
    assert result == {
        "default": [[], []],
        "other": [["c-1", "c-2"], [{"n": 1}, {"n": 2}]],
    }, "the positional using's event went where its row went"
