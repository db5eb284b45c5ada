"""A Django database on a psycopg pool (``OPTIONS["pool"]``): its pool is one for every
thread of the process (``DatabaseWrapper._connection_pools``), made with the connect
arguments of whichever thread needs it first. The consumer's connect bound must not end up
in it: the application's request threads' connections would get the consumer's
``connect_timeout`` (and with a pool made before, the option bounds nothing anyway: the
pool connects, and ``getconn`` waits at most the pool's ``timeout``).

In a subprocess: Django's settings are configured once a process; psycopg_pool is
replaced by a stand-in that records the arguments the pool is made with.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

_SCRIPT = textwrap.dedent(
    """
    import json, sys, threading, types

    import django
    from django.conf import settings

    settings.configure(DATABASES={"default": {
        "ENGINE": "django.db.backends.postgresql", "NAME": "app", "OPTIONS": {"pool": True},
    }})
    django.setup()

    class ConnectionPool:
        check_connection = None

        def __init__(self, kwargs, **options):
            self.kwargs = kwargs

    fake = types.ModuleType("psycopg_pool")
    fake.ConnectionPool = ConnectionPool
    sys.modules["psycopg_pool"] = fake

    from django.db import connections
    from outboxer.contrib.django.consumer import _bound_connects

    added = {}

    def consumer_thread():
        connection = connections["default"]  # the session thread's own wrapper
        added.update(_bound_connects(connection, 0.5))
        connection.pool  # its connect makes the pool first

    thread = threading.Thread(target=consumer_thread)
    thread.start()
    thread.join()
    app = connections["default"]  # a request thread's wrapper: the same pool
    print(json.dumps({
        "added": added,
        "app_pool_kwargs": sorted(app.pool.kwargs),
        "app_options": sorted(app.settings_dict["OPTIONS"]),
    }))
    """
)


def test_the_consumer_connect_bound_stays_out_of_a_shared_psycopg_pool() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert "connect_timeout" not in out["app_pool_kwargs"], out
    assert out["app_options"] == ["pool"]
    assert out["added"] == {}
