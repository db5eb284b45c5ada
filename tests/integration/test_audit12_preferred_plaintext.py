"""``ssl_mode=preferred`` against a server without TLS (the shared MariaDB has TLS off, as
many development servers): every outboxer connection carries on in plaintext, as the MySQL
client and Django do, instead of failing (``preferred`` was no known mode, and Django's
``PREFERRED`` became ``required``, refused with InsecureConnectionError)."""

from __future__ import annotations

import asyncio
from urllib.parse import urlencode

from outboxer.consumer import Consumer
from outboxer.stores import create_store
from tests.integration.test_audit12_mytls_private_server import _store_tls_version


async def test_the_relay_store_connects_in_plaintext(mysql_url: str) -> None:
    assert await _store_tls_version(f"{mysql_url}?ssl_mode=preferred") == ""


def test_pymysql_paths_connect_in_plaintext(mysql_url: str) -> None:
    from outboxer.payload_admin import connect

    conn = connect(f"{mysql_url}?ssl_mode=PREFERRED")
    try:
        with conn.cursor() as cursor:
            cursor.execute("SHOW SESSION STATUS LIKE 'Ssl_version'")
            assert cursor.fetchone()[1] == ""
    finally:
        conn.close()


def test_the_consumer_runs(mysql_url: str) -> None:
    consumer = Consumer(
        db=f"{mysql_url}?ssl_mode=preferred",
        broker="memory://audit12-preferred",
        group="g",
        handler=lambda message, conn: None,
        exit_when_idle=True,
    )
    asyncio.run(asyncio.wait_for(consumer.run_async(), 30))


async def test_a_django_project_with_preferred_starts_its_relay_store(mysql_url: str) -> None:
    from outboxer.contrib.django.conf import mysql_query

    query = urlencode(mysql_query("default", {"ssl_mode": "PREFERRED"}))
    async with create_store(f"{mysql_url}?{query}") as store:
        await store.ping()
