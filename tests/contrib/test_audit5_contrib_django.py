"""outboxer's Django app, audit round 5, on the real PostgreSQL, MariaDB and SQLite: the
schema migration on Django's in-memory SQLite test database, ``delete()`` with a deferred
payload, the URL outboxer derives from ``DATABASES`` (an IPv6 host, a libpq service), the
requeue action when outboxer's store is unreachable, concurrent consumer batches on SQLite,
and the errors of a bad ``settings.OUTBOXER``.

Django runs in subprocesses (tests/contrib/django_project): its settings are process-wide.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import subprocess
import sys
import textwrap
from urllib.parse import urlsplit

import pytest

from tests.chaos.proxy import FaultProxy
from tests.contrib.test_django import ROOT, SETTINGS, django


def run_django(script: str, url: str) -> str:
    """Run ``script`` (Django set up on the test project over ``url``); its stdout. An
    outer PYTHONPATH stays first (a test run against an older ``src`` tests that code)."""
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p] + [str(ROOT)]
    env = dict(
        os.environ,
        OUTBOXER_TEST_DJANGO_DB=url,
        PYTHONPATH=os.pathsep.join(path),
        DJANGO_SETTINGS_MODULE=SETTINGS,
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


IN_MEMORY = """
    import json
    import django
    from django.conf import settings
    import tests.contrib.django_project.settings as project

    values = {name: getattr(project, name) for name in dir(project) if name.isupper()}
    # Django's test runner gives an SQLite database without a TEST NAME an in-memory one.
    values["DATABASES"] = {
        "default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}
    }
    settings.configure(**values)
    django.setup()
    from django.core.management import call_command
    from django.db import connection, transaction
    from tests.contrib.django_project.shop.models import Order

    call_command("migrate", verbosity=0)
    with transaction.atomic():
        order = Order(customer="c-1")
        order.place()
        order.save()
    with connection.cursor() as cursor:
        cursor.execute("SELECT topic, payload FROM outbox")
        print(json.dumps([[topic, json.loads(payload)] for topic, payload in cursor.fetchall()]))
"""


def test_migrate_and_model_events_work_on_an_in_memory_sqlite_database(sqlite_url: str) -> None:
    """The schema migration needs the outbox's names only: an in-memory SQLite database
    (which no relay could use, so it has no URL) is migrated and written to."""
    output = run_django(IN_MEMORY, sqlite_url)  # sqlite_url: only for the settings module
    assert json.loads(output) == [["order.placed", {"id": 1}]]


DELETE = """
    import json
    import django
    django.setup()
    from django.core.management import call_command
    from django.db import connection
    from tests.contrib.django_project.shop.models import Order

    from django.db.models.signals import post_delete

    def deleted(sender, instance, **kwargs):  # events recorded while delete() runs
        instance.record_event("order.deleted", {"customer": instance.customer})

    post_delete.connect(deleted, sender=Order)
    call_command("migrate", verbosity=0)
    order = Order.objects.create(customer="c-1")
    print(json.dumps({"pk": order.pk}))
    order.record_event("order.cancelled", lambda: {"id": order.pk}, key=lambda: str(order.pk))
    order.delete()
    with connection.cursor() as cursor:
        cursor.execute("SELECT topic, key, payload FROM outbox ORDER BY seq")
        rows = cursor.fetchall()
    print(json.dumps([[topic, key, json.loads(payload)] for topic, key, payload in rows]))
"""


def test_delete_gives_deferred_payloads_and_keys_the_deleted_rows_primary_key(
    sqlite_url: str,
) -> None:
    """Django sets the pk to None once the row is deleted: an ``order.cancelled`` event whose
    payload or key reads it must still get the id of the order it announces. An event a
    ``post_delete`` receiver records is written too, and nothing twice."""
    first, second = run_django(DELETE, sqlite_url).splitlines()
    pk = json.loads(first)["pk"]
    assert json.loads(second) == [
        ["order.cancelled", str(pk), {"id": pk}],
        ["order.deleted", None, {"customer": "c-1"}],
    ]


class IPv6Proxy(FaultProxy):
    """The fault proxy, listening on ``[::1]`` (a Django HOST that is an IPv6 address)."""

    async def _start(self) -> None:
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server = await asyncio.start_server(self._accept, "::1", 0)
        self.port = self._server.sockets[0].getsockname()[1]


@pytest.mark.parametrize(("fixture", "port"), [("pg_url", 5432), ("mysql_url", 3306)])
def test_a_database_host_that_is_an_ipv6_address_gives_the_relay_a_working_url(
    request: pytest.FixtureRequest, fixture: str, port: int
) -> None:
    """``HOST: "::1"`` in DATABASES: the URL derived for outboxer's own connections brackets
    it (``[::1]:5432``) instead of failing to parse it back ("invalid literal for int()")."""
    url: str = request.getfixturevalue(fixture)
    proxy = IPv6Proxy(port).start()
    try:
        parts = urlsplit(url)
        over_ipv6 = parts._replace(netloc=f"{parts.username}@[::1]:{proxy.port}").geturl()
        result = django(over_ipv6, "outboxer_status", "--json")
    finally:
        proxy.stop()
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    assert json.loads(result.stdout)["destinations"] == []  # an empty outbox, read
    assert proxy.connections > 0, "outboxer's connections went through [::1]"


REQUEUE_UNREACHABLE = """
    import django
    django.setup()
    from django.contrib import admin
    from django.contrib.messages.storage.cookie import CookieStorage
    from django.db import connection, transaction
    from django.test import RequestFactory, override_settings

    import outboxer
    from outboxer.contrib.django import conf
    from outboxer.contrib.django.models import OutboxMessage

    # No migrate: the database at sqlite_url has outboxer's schema.
    with transaction.atomic():
        outboxer.enqueue(connection, "order.placed", {"n": 1})
    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE {conf.outbox_table(connection.alias)} SET status = 'ABANDONED'")
    request = RequestFactory().post("/admin/outboxer/outboxmessage/")
    request._messages = CookieStorage(request)
    # outboxer's own connection goes elsewhere than Django's, and is refused there.
    refused = {"db": "postgresql://someone:s3cret-pw@127.0.0.1:1/outbox"}
    with override_settings(OUTBOXER=refused):
        admin.site._registry[OutboxMessage].requeue(request, OutboxMessage.objects.all())
    for message in request._messages:
        print(message.level_tag, message.message)
"""


def test_the_requeue_action_reports_a_store_it_cannot_reach_instead_of_a_server_error(
    sqlite_url: str,
) -> None:
    """As the replay action does: the admin's message with the (redacted) error, where the
    exception made a server error (500) of the whole page."""
    output = run_django(REQUEUE_UNREACHABLE, sqlite_url)
    assert output.startswith("error Requeue failed: cannot connect to PostgreSQL"), output
    assert "s3cret-pw" not in output


CONCURRENT_BATCHES = """
    import asyncio
    import concurrent.futures
    import threading
    import uuid

    import django
    django.setup()
    from outboxer.contrib.django import conf
    from outboxer.contrib.django.consumer import DjangoSession
    from outboxer.receivers.base import Delivery

    # No migrate: the database at sqlite_url has outboxer's schema, the inbox included.
    holding, release = threading.Event(), threading.Event()

    def slow(message, connection):  # holds its transaction (and SQLite's write lock) open
        holding.set()
        release.wait(30)

    def apply(handler, key):
        async def batch():
            session = DjangoSession("default", "outboxer", conf.dialect("default"))
            await session.open()
            try:
                # hold_keys: the dead-letter check (a read) comes before the inbox claim.
                return await session.apply("g", [delivery(key)], handler, hold_keys=True)
            finally:
                await session.close()

        return [result.value for result in asyncio.run(batch())]

    def delivery(key):
        return Delivery(
            id=uuid.uuid4(), topic="t", key=key, headers={}, payload={}, body=b"{}",
            content_type="application/json",
        )

    with concurrent.futures.ThreadPoolExecutor(2) as workers:
        first = workers.submit(apply, slow, "k-1")
        assert holding.wait(30)
        second = workers.submit(apply, lambda message, connection: None, "k-2")
        # Not failed while the first holds the lock (it failed in milliseconds with
        # "database is locked"): it waits busy_timeout for the lock.
        concurrent.futures.wait([second], timeout=0.5)
        early = repr(second.exception()) if second.done() else None
        release.set()
        print(early, first.result(), second.result())
"""


def test_concurrent_django_consumer_batches_on_sqlite_wait_for_the_write_lock(
    sqlite_url: str,
) -> None:
    """Django begins SQLite's transactions deferred: a batch whose first statement reads
    (the dead-letter check of abandoned_blocks_key) failed at once with "database is
    locked" while another worker's batch held the write lock, a failed attempt charged to
    its messages (dead letters in the end). It takes the lock first now, and waits for it."""
    output = run_django(CONCURRENT_BATCHES, sqlite_url)
    assert output.split() == ["None", "['applied']", "['applied']"], output


BAD_SETTINGS = """
    import django
    django.setup()
    from django.test import override_settings
    from outboxer.contrib.django import conf
    from outboxer.errors import ConfigError

    for outboxer in (
        {"bacth_size": 5},
        {"batch_size": "many"},
        {"database": ["default"]},
        {"consumer": {"gruop": "shipping"}},
        {"consumer": {"group": "shipping", "concurrency": "4x"}},
    ):
        with override_settings(OUTBOXER=outboxer):
            try:
                conf.outboxer_settings()
                conf.consumer_settings()
            except ConfigError as exc:
                print(str(exc).split("; known:")[0])
            else:
                print("accepted", outboxer)
"""


def test_a_bad_outboxer_setting_is_named_as_the_project_wrote_it(sqlite_url: str) -> None:
    """A typo or a wrong type in ``settings.OUTBOXER`` says so, naming the key there, not an
    ``outboxer`` command-line flag the project never gave (``--batch-size``); a value of the
    wrong type for ``database`` is a ConfigError, not ``TypeError: unhashable type``."""
    assert run_django(BAD_SETTINGS, sqlite_url).splitlines() == [
        "settings.OUTBOXER: unknown settings ['bacth_size']",
        """settings.OUTBOXER["batch_size"] must be a whole number; got 'many'""",
        """settings.OUTBOXER["database"] names no database: ['default']""",
        """settings.OUTBOXER["consumer"]: unknown settings ['gruop']""",
        """settings.OUTBOXER["consumer"]["concurrency"] must be a whole number; got '4x'""",
    ]


THROUGH_A_SERVICE = """
    import django
    from django.conf import settings
    import tests.contrib.django_project.settings as project

    values = {name: getattr(project, name) for name in dir(project) if name.isupper()}
    # As Django's documentation suggests: the connection's parameters in a service file.
    values["DATABASES"] = {
        "default": {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": "",
            "OPTIONS": {"service": "outboxer_audit"},
        }
    }
    settings.configure(**values)
    django.setup()
    from django.core.management import call_command

    call_command("outboxer_status", "--json")
"""


def test_a_postgresql_service_in_options_reaches_outboxer_s_own_connections(
    pg_url: str, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``OPTIONS: {"service": ...}`` (or ``passfile``, ``sslrootcert`` …): Django connects
    through it, and so must the relay and ``outboxer_status``, whose URL dropped every
    option but ``sslmode`` (``postgresql:///``: another database, or none)."""
    parts = urlsplit(pg_url)
    services = tmp_path / "pg_service.conf"
    services.write_text(
        f"[outboxer_audit]\nhost={parts.hostname}\nport={parts.port}\n"
        f"dbname={parts.path.lstrip('/')}\nuser={parts.username}\n"
    )
    monkeypatch.setenv("PGSERVICEFILE", str(services))  # the subprocess's environment
    output = run_django(THROUGH_A_SERVICE, "sqlite:///unused.db")
    assert json.loads(output)["destinations"] == []  # the outbox of that database, read
