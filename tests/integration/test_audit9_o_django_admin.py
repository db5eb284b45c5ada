"""The Django admin of the outbox on the real PostgreSQL and MariaDB: the requeue action says
what it deferred (a later message of the key in flight), and the change list stays cheap
on a big table (no SELECT DISTINCT of the filters, no COUNT(*) of every row).

Django runs in subprocesses (tests/contrib/django_project): its settings are process-wide.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.contrib.test_django import ROOT, SETTINGS


def run_django(script: str, url: str) -> str:
    """``script`` with Django set up on the test project over ``url`` (the outbox schema is
    there, no migrate); its stdout. PYTHONPATH kept: a run on an old copy of the code."""
    path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p)
    env = dict(
        os.environ, OUTBOXER_TEST_DJANGO_DB=url, PYTHONPATH=path, DJANGO_SETTINGS_MODULE=SETTINGS
    )
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result.stdout


REQUEUE_DEFERRED = """
    import django
    django.setup()
    from django.contrib import admin
    from django.contrib.messages.storage.cookie import CookieStorage
    from django.db import connection, transaction
    from django.test import RequestFactory

    import outboxer
    from outboxer.contrib.django import conf
    from outboxer.contrib.django.models import OutboxMessage

    with transaction.atomic():
        given_up = outboxer.enqueue(connection, "order.placed", {"n": 1}, key="k")
        in_flight = outboxer.enqueue(connection, "order.paid", {"n": 2}, key="k")
        lone = outboxer.enqueue(connection, "order.placed", {"n": 3}, key="other")
        pending = outboxer.enqueue(connection, "order.noted", {"n": 4})
    table = conf.outbox_table(connection.alias)
    with connection.cursor() as cursor:
        for message, status in ((given_up, "ABANDONED"), (lone, "FAILED"),
                                (in_flight, "PROCESSING")):
            cursor.execute(f"UPDATE {table} SET status = %s WHERE id = %s",
                           [status, str(message.id)])
    request = RequestFactory().post("/admin/outboxer/outboxmessage/")
    request._messages = CookieStorage(request)
    chosen = OutboxMessage.objects.exclude(message_id=in_flight.id)
    admin.site._registry[OutboxMessage].requeue(request, chosen)
    for message in request._messages:
        print(message.level_tag, message.message)
    statuses = {str(i): s for i, s in OutboxMessage.objects.values_list("message_id", "status")}
    print(statuses[str(given_up.id)], statuses[str(lone.id)])
"""


@pytest.mark.parametrize("dialect", ["postgres", "mysql"])
def test_the_requeue_action_reports_what_it_deferred(
    request: pytest.FixtureRequest, dialect: str
) -> None:
    """The ABANDONED row behind a PROCESSING one of its key stays (a requeue would let it
    overtake); the admin said "not ABANDONED or FAILED, left alone" of it, so the operator
    never learnt to requeue it later."""
    url = request.getfixturevalue({"postgres": "pg_url", "mysql": "mysql_url"}[dialect])
    output = run_django(REQUEUE_DEFERRED, url).splitlines()
    assert output == [
        "warning Requeued 1 message(s); 1 deferred: a later message of their key is in flight "
        "(requeue them once it is published); 1 not ABANDONED or FAILED, left alone.",
        "ABANDONED PENDING",
    ], output


CHANGE_LIST = """
    import json
    import sys

    import django
    django.setup()
    from django.contrib import admin
    from django.db import connection
    from django.test import RequestFactory
    from django.test.utils import CaptureQueriesContext

    from outboxer.contrib.django import conf
    from outboxer.contrib.django.models import OutboxMessage

    rows = int(sys.argv[1])
    table = conf.outbox_table(connection.alias)
    with connection.cursor() as cursor:  # as years of published messages leave the outbox
        if connection.vendor == "postgresql":
            cursor.execute(
                f"INSERT INTO {table} (id, destination, topic, payload, content_type, status, "
                "published_at) SELECT gen_random_uuid(), 'default', 'order.placed', '\\\\x00', "
                f"'application/json', 'PUBLISHED', now() FROM generate_series(1, {rows})")
            cursor.execute(f"ANALYZE {table}")
        else:
            cursor.execute(
                f"INSERT INTO {table} (id, destination, topic, payload, content_type, status, "
                "published_at) SELECT UUID(), 'default', 'order.placed', 'x', "
                f"'application/json', 'PUBLISHED', NOW(6) FROM seq_1_to_{rows}")
            cursor.execute(f"ANALYZE TABLE {table}")
            cursor.fetchall()

    class Staff:  # the admin's user: every permission
        is_active = is_staff = is_superuser = True
        pk = 1

        def has_perm(self, perm, obj=None):
            return True

    model_admin = admin.site._registry[OutboxMessage]
    for query in ({}, {"status__exact": "PUBLISHED"}, {"destination__exact": "default"}):
        request = RequestFactory().get("/admin/outboxer/outboxmessage/", query)
        request.user = Staff()
        with CaptureQueriesContext(connection) as captured:
            listing = model_admin.get_changelist_instance(request)
            choices = [[c["display"] for c in spec.choices(listing)][1:]
                       for spec in listing.filter_specs]
            shown = len(list(listing.result_list))
        print(json.dumps({"count": listing.result_count, "shown": shown, "choices": choices,
                          "sql": [q["sql"] for q in captured.captured_queries]}))
"""


@pytest.mark.parametrize(("dialect", "rows"), [("postgres", 200_000), ("mysql", 30_000)])
def test_the_change_list_neither_counts_nor_lists_every_row(
    request: pytest.FixtureRequest, dialect: str, rows: int
) -> None:
    """Each page load of the outbox ran SELECT DISTINCT status and SELECT DISTINCT destination
    (the list filters) and a COUNT(*) of every row its filter matched (the paginator): on
    millions of PUBLISHED rows, each a scan of the table."""
    url = request.getfixturevalue({"postgres": "pg_url", "mysql": "mysql_url"}[dialect])
    script = f"import sys; sys.argv[1:] = ['{rows}']\n" + textwrap.dedent(CHANGE_LIST)
    for line in run_django(script, url).splitlines():
        page = json.loads(line)
        for sql in page["sql"]:
            assert "DISTINCT" not in sql.upper(), sql
            if "COUNT(" in sql.upper():
                assert "LIMIT 10001" in sql.upper(), f"a count of every row: {sql}"
        assert page["shown"] == 50
        # Fixed choices: the statuses, the configured destinations.
        assert page["choices"] == [
            ["PENDING", "PROCESSING", "PUBLISHED", "FAILED", "ABANDONED"],
            ["default"],
        ]
        # Past the cap, the planner's estimate (MariaDB's, without a histogram, halves the
        # rows of an equality filter): the page links reach further than the cap.
        assert 10_001 < page["count"] < rows * 2, page["count"]
