"""Django admin's requeue action on PostgreSQL: a requeue chosen as a deadlock's victim on
every try is reported with the admin's error message ("Requeue failed: ..."), as outboxer's
other errors are, not as a server error (500) of the whole page.

The store raised asyncpg's DeadlockDetectedError, which the action, catching outboxer's own
errors, let through. The tries are cut to one (DEADLOCK_TRIES, in the Django process) so
that one real deadlock outlasts them: this test's session holds the second of two ABANDONED
rows, the action's requeue locks the first and waits for it, then this session asks for the
first. The requeue waited first, so the server fails it.

Django runs in a subprocess (tests/contrib/django_project): its settings are process-wide.
"""

from __future__ import annotations

import asyncio
import os
import sys
import textwrap

import asyncpg

from tests.contrib.test_django import ROOT, SETTINGS
from tests.integration.test_audit18_deadlock_pg_claim_renew import lock_waiters, wait_until
from tests.integration.test_audit19_pgopdeadlock_requeue_purge import outbox_rows, statuses

LOCK_ROW = "SELECT 1 FROM outboxer.outbox WHERE id = $1 FOR UPDATE"

REQUEUE = """
    import django
    django.setup()
    from django.contrib import admin
    from django.contrib.messages.storage.cookie import CookieStorage
    from django.test import RequestFactory

    from outboxer.contrib.django.models import OutboxMessage
    from outboxer.stores import postgres

    postgres.DEADLOCK_TRIES = 1
    request = RequestFactory().post("/admin/outboxer/outboxmessage/")
    request._messages = CookieStorage(request)
    chosen = OutboxMessage.objects.filter(topic="t")
    admin.site._registry[OutboxMessage].requeue(request, chosen)
    for message in request._messages:
        print(message.level_tag, message.message)
"""


async def test_a_requeue_that_stays_a_deadlocks_victim_is_the_admins_error_message(
    pg_url: str,
) -> None:
    ids = await outbox_rows(pg_url, [("a", "ABANDONED", 2), ("b", "ABANDONED", 1)])
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p] + [str(ROOT)]
    env = dict(
        os.environ,
        OUTBOXER_TEST_DJANGO_DB=pg_url,
        PYTHONPATH=os.pathsep.join(path),
        DJANGO_SETTINGS_MODULE=SETTINGS,
    )
    operator = await asyncpg.connect(pg_url)
    watcher = await asyncpg.connect(pg_url)
    django = None
    try:
        holding = operator.transaction()
        await holding.start()
        await operator.execute(LOCK_ROW, ids["b"])
        django = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            textwrap.dedent(REQUEUE),
            cwd=ROOT,
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )

        async def requeue_waits() -> bool:
            return await lock_waiters(watcher) >= 1

        await wait_until(requeue_waits, "the action's requeue never waited", timeout=8.0)
        await asyncio.wait_for(operator.execute(LOCK_ROW, ids["a"]), 5)
        await holding.rollback()
        out, err = await asyncio.wait_for(django.communicate(), 10)
    finally:
        if django is not None and django.returncode is None:
            django.kill()
            await django.wait()
        await operator.close()
        await watcher.close()
    output = out.decode()
    assert django.returncode == 0, f"exit {django.returncode}\n{output}\n{err.decode()}"
    assert output.startswith(
        "error Requeue failed: PostgreSQL chose a requeue as a deadlock's victim"
    ), output
    assert await statuses(pg_url) == {"a": "ABANDONED", "b": "ABANDONED"}
