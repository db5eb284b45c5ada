"""The consumer on Django's PostgreSQL connection (``DjangoSession``, psycopg 3 and psycopg2)
gives the server's end of it the same TCP keepalives as the consumer's own sessions
(test_audit19_serverkeepalive_consumer): the session's ``tcp_keepalives_*``, set by the
backend-id read it sends anyway, where nothing configures them (the OPTIONS' own
``options`` win). Before, the server's defaults: a consumer host that vanished mid-batch kept
its inbox claims locked for over two hours.

Read back with SHOW from the session's own connection (the dropped-packet proof, with the
same SQL, is the consumer test's). Django runs in a subprocess, as in
test_audit19_keepalive_django.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from tests.contrib.test_django import ROOT, SETTINGS

SCRIPT = textwrap.dedent(
    """
    import asyncio, json, sys

    DRIVER, OWN = sys.argv[1], sys.argv[2] == "own"

    from django.conf import settings
    settings.DATABASES
    if OWN:
        settings.DATABASES["default"]["OPTIONS"] = {"options": "-c tcp_keepalives_idle=17"}
    import django
    if DRIVER == "psycopg2":
        hidden = sys.modules.get("psycopg")
        sys.modules["psycopg"] = None  # Django's backend falls back on psycopg2
        django.setup()
        import django.db.backends.postgresql.base
        if hidden is not None:
            sys.modules["psycopg"] = hidden
        else:
            del sys.modules["psycopg"]
    else:
        django.setup()

    from django.db import connections

    from outboxer.contrib.django import conf
    from outboxer.contrib.django.consumer import DjangoSession

    session = DjangoSession("default", "outboxer", conf.dialect("default"))
    session.statement_timeout = 13.0

    def read():
        with connections["default"].cursor() as cursor:
            cursor.execute(
                "SELECT current_setting('tcp_keepalives_idle'), "
                "current_setting('tcp_keepalives_interval'), "
                "current_setting('tcp_keepalives_count')"
            )
            return list(cursor.fetchone())

    async def main():
        await session.open()
        try:
            found = await session._call(read)
        finally:
            await session.close()
        return {"driver": connections["default"].Database.__name__, "settings": found}

    print("RESULT " + json.dumps(asyncio.run(main())))
    """
)


def _run(driver: str, url: str, mode: str = "plain") -> dict[str, Any]:
    path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p)
    env = dict(
        os.environ, PYTHONPATH=path, DJANGO_SETTINGS_MODULE=SETTINGS, OUTBOXER_TEST_DJANGO_DB=url
    )
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, driver, mode],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert result.returncode == 0 and lines, f"{result.stdout}\n{result.stderr}"
    out: dict[str, Any] = json.loads(lines[-1].removeprefix("RESULT "))
    assert out["driver"] == driver, out
    return out


@pytest.mark.parametrize("driver", ["psycopg", "psycopg2"])
def test_django_postgresql_session_gets_server_keepalives_from_the_bound(
    pg_url: str, driver: str
) -> None:
    # 13 s: 6 s idle, 3 probes 2 s apart (the client's, test_audit19_keepalive_django).
    assert _run(driver, pg_url)["settings"] == ["6", "2", "3"]


def test_django_options_own_server_keepalive_setting_wins(pg_url: str) -> None:
    assert _run("psycopg", pg_url, "own")["settings"] == ["17", "2", "3"]
