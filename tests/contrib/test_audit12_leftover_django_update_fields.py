"""Django model events and ``save(update_fields=[])``: Django skips such a save (no write, no
signals), but ``RecordsEvents.save`` still wrote the recorded events, announcing a change
no row holds. The events now follow the write: they stay recorded, and go out with the next
save that writes the row.

Django runs in a subprocess (its settings are process-wide).
"""

from __future__ import annotations

import json

import pytest

from tests.contrib.test_audit12_orm_django_using import run_django

SCRIPT = """
    import json
    import warnings
    import django
    django.setup()
    from django.core.management import call_command
    from django.db import connection
    from outboxer.contrib.django import conf
    from tests.contrib.django_project.shop.models import Order

    call_command("migrate", verbosity=0)

    def outbox():
        with connection.cursor() as cursor:
            cursor.execute(f"SELECT payload FROM {conf.outbox_table(connection.alias)} ORDER BY seq")
            return [json.loads(bytes(payload)) for (payload,) in cursor.fetchall()]

    seen = {}
    order = Order(customer="c-1")
    order.save()
    order.customer = "c-2"
    order.record_event("order.changed", {"n": 1})
    order.save(update_fields=[])
    seen["keyword"] = [outbox(), len(order.pending_events)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Django 5.x deprecates positional save() arguments
        order.save(False, False, None, ())
    seen["positional"] = [outbox(), len(order.pending_events)]
    order.save(update_fields=["customer"])
    seen["written"] = [outbox(), len(order.pending_events)]
    seen["row"] = Order.objects.get(pk=order.pk).customer
    print(json.dumps(seen))
"""


@pytest.mark.parametrize("dialect", ["sqlite_url", "pg_url"])
def test_a_skipped_save_writes_no_event(dialect: str, request: pytest.FixtureRequest) -> None:
    url = request.getfixturevalue(dialect)
    seen = json.loads(run_django(SCRIPT, url))
    assert seen == {
        "keyword": [[], 1],
        "positional": [[], 1],
        "written": [[{"n": 1}], 0],
        "row": "c-2",
    }, seen
