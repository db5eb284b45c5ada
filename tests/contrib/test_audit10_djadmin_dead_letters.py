"""The Django admin of the consumer's dead letters (and the outbox's actions) on big tables,
on the real PostgreSQL, MariaDB and SQLite: a page load lists no ``SELECT DISTINCT
consumer`` of the whole table, and an action on "select all N across pages" refuses more
than ``MAX_ACTION_ROWS`` rows (nothing changed, the CLI named) instead of loading every
row into memory and sending them as one statement.

Django runs in subprocesses (tests/contrib/django_project): its settings are process-wide.
"""

from __future__ import annotations

import json

import pytest

from tests.integration.test_audit9_o_django_admin import run_django

DIALECTS = {"postgres": "pg_url", "mysql": "mysql_url", "sqlite": "sqlite_url"}

SETUP = """
    import json
    import sys
    import uuid

    import django
    django.setup()
    from django.conf import settings
    from django.contrib import admin
    from django.contrib.messages.storage.cookie import CookieStorage
    from django.db import connection
    from django.test import RequestFactory, override_settings
    from django.test.utils import CaptureQueriesContext

    from outboxer.contrib.django import conf
    from outboxer.contrib.django.models import DeadLetter, OutboxMessage

    dead_letters = conf.schema_table(connection.alias, "dead_letters")
    outbox = conf.outbox_table(connection.alias)

    def add_dead_letters(consumer, count):
        with connection.cursor() as cursor:
            cursor.executemany(
                f"INSERT INTO {dead_letters} (consumer, message_id, topic, content_type, "
                "payload, error, attempts) VALUES (%s, %s, 'order.placed', "
                "'application/json', %s, 'boom', 3)",
                [(consumer, str(uuid.uuid4()), b"{}") for _ in range(count)],
            )

    def add_abandoned(count):
        with connection.cursor() as cursor:
            cursor.executemany(
                f"INSERT INTO {outbox} (id, destination, topic, payload, content_type, "
                "status) VALUES (%s, 'default', 'order.placed', %s, 'application/json', "
                "'ABANDONED')",
                [(str(uuid.uuid4()), b"{}") for _ in range(count)],
            )

    class Staff:  # the admin's user: every permission
        is_active = is_staff = is_superuser = True
        pk = 1

        def has_perm(self, perm, obj=None):
            return True

    # The group the admin replays with; the handler is never reached by these tests.
    consumer = {"group": "shipping", "handler": "tests.contrib.django_project.shop.handlers:nope"}
    override_settings(OUTBOXER={**settings.OUTBOXER, "consumer": consumer}).enable()
"""

CHANGE_LIST = """
    add_dead_letters("shipping", 30)
    add_dead_letters("billing", 20)
    pages = (
        (DeadLetter, {}),
        (DeadLetter, {"consumer": "billing"}),
        (DeadLetter, {"consumer": "shipping", "held__exact": "0"}),
        (DeadLetter, {"_facets": ""}),  # Django's "Show counts"
        (OutboxMessage, {"_facets": ""}),
    )
    for model, query in pages:
        model_admin = admin.site._registry[model]
        request = RequestFactory().get(f"/admin/outboxer/{model._meta.model_name}/", query)
        request.user = Staff()
        with CaptureQueriesContext(connection) as captured:
            listing = model_admin.get_changelist_instance(request)
            choices = [[(str(c["display"]), c["selected"]) for c in spec.choices(listing)][1:]
                       for spec in listing.filter_specs]
            consumers = sorted({getattr(row, "consumer", "") for row in listing.result_list})
        print(json.dumps({"consumers": consumers, "choices": choices,
                          "sql": [q["sql"] for q in captured.captured_queries]}))
"""


@pytest.mark.parametrize("dialect", list(DIALECTS))
def test_the_dead_letters_change_list_lists_no_distinct_consumers(
    request: pytest.FixtureRequest, dialect: str
) -> None:
    """The consumer filter was Django's field filter: a SELECT DISTINCT consumer over the
    whole dead-letter table on every page load. Its choices are now the configured group and
    the one the URL asks for (a link to another group's rows keeps working), under the URL
    parameter Django's filter used (``?consumer=``). Django 5's "Show counts" (``?_facets``)
    counted every row of each filter choice, on the outbox too: it is off."""
    url = request.getfixturevalue(DIALECTS[dialect])
    pages = [json.loads(line) for line in run_django(SETUP + CHANGE_LIST, url).splitlines()]
    for page in pages:
        for sql in page["sql"]:
            assert "DISTINCT" not in sql.upper(), sql
            if "COUNT(" in sql.upper():
                assert "LIMIT 10001" in sql.upper(), f"a count of every row: {sql}"
    everything, billing, shipping, *_ = pages
    assert everything["consumers"] == ["billing", "shipping"]
    assert everything["choices"][0] == [["shipping", False]]
    assert billing["consumers"] == ["billing"]
    assert billing["choices"][0] == [["shipping", False], ["billing", True]]
    assert shipping["consumers"] == ["shipping"]
    assert shipping["choices"][0] == [["shipping", True]]
    assert shipping["choices"][1] == [["Yes", False], ["No", True]]  # held: unchanged


ACTIONS = """
    import outboxer.contrib.django.admin as dj_admin

    def select_all_and_run(model, action):
        # What the change list's "Select all N" + an action POSTs.
        model_admin = admin.site._registry[model]
        url = f"/admin/outboxer/{model._meta.model_name}/"
        data = {"action": action, "select_across": "1", "index": "0", "_selected_action": "1"}
        request = RequestFactory().post(url, data)
        request.user = Staff()
        request._messages = CookieStorage(request)
        listing = model_admin.get_changelist_instance(request)
        with CaptureQueriesContext(connection) as captured:
            model_admin.response_action(request, listing.get_queryset(request))
        said = [f"{m.level_tag} {m.message}" for m in request._messages]
        return said, [q["sql"] for q in captured.captured_queries]

    def report(name, said, sql, **counts):
        print(json.dumps({"name": name, "said": said, "sql": sql, **counts}))

    cap = dj_admin.MAX_ACTION_ROWS if hasattr(dj_admin, "MAX_ACTION_ROWS") else 10_000
    add_dead_letters("shipping", cap + 1)
    add_abandoned(cap + 1)
    for action in ("purge", "replay"):
        said, sql = select_all_and_run(DeadLetter, action)
        report(action, said, sql, left=DeadLetter.objects.count())
    said, sql = select_all_and_run(OutboxMessage, "requeue")
    report("requeue", said, sql,
           left=OutboxMessage.objects.filter(status="ABANDONED").count())

    # At the cap: the purge goes through, every selected row in one transaction.
    DeadLetter.objects.filter(seq=DeadLetter.objects.order_by("seq")[0].seq).delete()
    said, sql = select_all_and_run(DeadLetter, "purge")
    report("purge at the cap", said, sql, left=DeadLetter.objects.count())
"""


@pytest.mark.parametrize("dialect", list(DIALECTS))
def test_actions_on_a_selection_of_every_row_refuse_more_than_the_cap(
    request: pytest.FixtureRequest, dialect: str
) -> None:
    """ "Select all N across pages" + Purge was one unbounded DELETE of the whole table (Django's
    collector loading the rows first where it cannot fast-delete); + Replay or Requeue loaded
    every selected row into a list and sent them as one IN list in one transaction. Past
    MAX_ACTION_ROWS the action now changes nothing and names the CLI; the selection is
    counted with a LIMIT cap + 1, never a COUNT(*) of every row."""
    url = request.getfixturevalue(DIALECTS[dialect])
    runs = {
        run["name"]: run for run in map(json.loads, run_django(SETUP + ACTIONS, url).splitlines())
    }
    cli = {
        "purge": "outboxer dead-letters purge",
        "replay": "outboxer dead-letters replay",
        "requeue": "outboxer requeue",
    }
    for name, command in cli.items():
        run = runs[name]
        assert run["left"] == 10_001, run["said"]  # nothing changed
        [said] = run["said"]
        assert said.startswith("error "), said
        assert "more than 10,000 rows" in said and command in said, said
        for sql in run["sql"]:
            upper = sql.upper()
            assert "DELETE" not in upper and "UPDATE" not in upper, sql
            assert "COUNT(" not in upper, f"a count of every row: {sql}"
            assert "LIMIT 10001" in upper, f"an unbounded read of the selection: {sql}"
    at_cap = runs["purge at the cap"]
    assert at_cap["said"] == ["success Purged 10000 dead letter(s)."]
    assert at_cap["left"] == 0
    for sql in at_cap["sql"]:
        if sql.upper().startswith("SELECT"):
            assert "LIMIT 10001" in sql.upper(), f"an unbounded read of the selection: {sql}"
