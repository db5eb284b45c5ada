"""The consumer on Django's connection (``DjangoSession``) gives it the same TCP keepalives
as the consumer's own connections (test_audit19_keepalive_sockets): libpq's options in this
thread's copy of the database's OPTIONS for psycopg 3 and psycopg2 (the OPTIONS' own win),
set on the connected socket for PyMySQL and mysqlclient, which have no such option.

Before, Django's connection had the drivers' defaults (libpq's and PyMySQL's SO_KEEPALIVE
with the kernel's times: a first probe after two hours), so a handler's statement whose
server's host vanished waited for ever. A vanished host cannot be made in user space (a
proxy's kernel keeps acknowledging): the proof is the options read back with getsockopt
from the live connection's socket, found by its peer, the server.

Django runs in a subprocess (its settings are process-wide, and the driver under its
backend is chosen there), as in tests/contrib/test_audit18_djbound_stalled_db.py.
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
from tests.integration.test_audit19_keepalive_sockets import BOUND, BOUNDED

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="TCP_KEEPIDLE and /proc are Linux's"
)

SCRIPT = textwrap.dedent(
    """
    import asyncio, json, os, sys
    from urllib.parse import urlsplit

    DRIVER, OWN, BOUND = sys.argv[1], sys.argv[2] == "own", float(sys.argv[3])
    parts = urlsplit(os.environ["OUTBOXER_TEST_DJANGO_DB"])

    from django.conf import settings
    settings.DATABASES  # the project's settings install PyMySQL as MySQLdb
    if DRIVER == "mysqlclient":
        import importlib
        del sys.modules["MySQLdb"]
        sys.modules["MySQLdb"] = importlib.import_module("MySQLdb")
    if OWN:
        settings.DATABASES["default"]["OPTIONS"] = {"keepalives_idle": 17}
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
    from tests.integration.test_audit19_keepalive_sockets import client_socket, keepalives

    session = DjangoSession("default", "outboxer", conf.dialect("default"))
    session.statement_timeout = BOUND

    async def main():
        await session.open()
        try:
            # The session's connection is this process's only one to the server.
            with client_socket(peer=(parts.hostname, parts.port)) as sock:
                found = keepalives(sock)
        finally:
            await session.close()
        return {"driver": connections["default"].Database.__name__, "keepalives": found}

    print("RESULT " + json.dumps(asyncio.run(main())))
    """
)

#: The module Django's backend runs on, by driver.
MODULES = {
    "psycopg": "psycopg",
    "psycopg2": "psycopg2",
    "pymysql": "pymysql",
    "mysqlclient": "MySQLdb",
}


def _run(driver: str, url: str, mode: str = "plain") -> dict[str, Any]:
    path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p)
    env = dict(
        os.environ, PYTHONPATH=path, DJANGO_SETTINGS_MODULE=SETTINGS, OUTBOXER_TEST_DJANGO_DB=url
    )
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, driver, mode, str(BOUND)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert result.returncode == 0 and lines, f"{result.stdout}\n{result.stderr}"
    out: dict[str, Any] = json.loads(lines[-1].removeprefix("RESULT "))
    assert out["driver"] == MODULES[driver], out
    return out


@pytest.mark.parametrize("driver", ["psycopg", "psycopg2"])
def test_django_postgresql_connection_gets_libpq_keepalives_from_the_bound(
    pg_url: str, driver: str
) -> None:
    assert tuple(_run(driver, pg_url)["keepalives"]) == BOUNDED


def test_django_postgresql_options_own_keepalive_setting_wins(pg_url: str) -> None:
    _, interval, probes = BOUNDED[1:]
    assert tuple(_run("psycopg", pg_url, "own")["keepalives"]) == (1, 17, interval, probes)


@pytest.mark.parametrize("driver", ["pymysql", "mysqlclient"])
def test_django_mysql_connection_gets_keepalives_on_its_socket(mysql_url: str, driver: str) -> None:
    assert tuple(_run(driver, mysql_url)["keepalives"]) == BOUNDED
