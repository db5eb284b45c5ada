"""Outboxer's MariaDB sessions pin what a server's or a user's defaults would break.

A private ``mariadbd`` (free port, temporary data directory) given ``sql_select_limit = 5``
(SET GLOBAL: mariadbd has no option for it), a DBA's guard against huge result sets, and a
user ``capped`` whose statements the server interrupts after 10 ms (``MAX_STATEMENT_TIME``):
settings the shared server must not get.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pymysql
import pytest

import outboxer
from outboxer.brokers.memory import memory_broker
from tests.integration.test_audit20_myreadonly_failover import (
    INSTALL_DB,
    MARIADBD,
    PASSWORD,
    _start,
    _stop,
    sql,
)
from tests.relaying import enqueue, relay, rows


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    if not (os.path.exists(MARIADBD) and os.path.exists(INSTALL_DB)):
        pytest.skip("mariadbd / mariadb-install-db not installed")
    home = Path(tempfile.mkdtemp(prefix="outboxer-audit21-sessiondefaults-"))
    try:
        server, port = _start(home, "srv", ["--skip-log-bin"])
        try:
            sql(port, "SET GLOBAL sql_select_limit = 5")
            sql(
                port,
                f"CREATE USER 'capped'@'%' IDENTIFIED BY '{PASSWORD}' WITH MAX_STATEMENT_TIME 0.01",
            )
            sql(port, "GRANT ALL ON *.* TO 'capped'@'%'")
            yield port
        finally:
            _stop(server)
    finally:
        shutil.rmtree(home, ignore_errors=True)


def database(port: int, user: str = "admin") -> str:
    name = f"sd_{uuid.uuid4().hex[:8]}"
    sql(port, f"CREATE DATABASE {name}")
    return f"mysql://{user}:{PASSWORD}@127.0.0.1:{port}/{name}"


async def apply(url: str) -> list[str]:
    async with outboxer.create_store(url) as store:
        return await store.apply_schema()


async def test_a_server_row_limit_cuts_no_result_short(port: int) -> None:
    """With sql_select_limit 5 the applied versions read back five of six: a second
    ``schema apply`` ran the sixth again and failed on its own record (duplicate entry),
    the relay refused to start (the schema "lacked" it), the admin's listings were cut."""
    url = database(port)
    conn = pymysql.connect(host="127.0.0.1", port=port, user="admin", password=PASSWORD)
    try:
        cursor = conn.cursor()
        cursor.execute("SELECT @@sql_select_limit")
        assert cursor.fetchone() == (5,)
    finally:
        conn.close()
    assert len(await apply(url)) >= 6
    assert await apply(url) == []
    enqueue(url, *(("t", f"k{n % 3}") for n in range(12)))
    broker = f"limit-{uuid.uuid4().hex[:8]}"
    async with asyncio.timeout(8):
        await relay(
            url, f"memory://{broker}", concurrency=2, batch_size=4, exit_when_idle=True
        ).run()
    listed = await rows(url)
    assert len(listed) == 12 and {row["status"] for row in listed} == {"PUBLISHED"}
    per_key: dict[str | None, list[int]] = {}
    for message in memory_broker(broker).messages:
        per_key.setdefault(message.key, []).append(json.loads(message.payload)["n"])
    assert sorted(n for numbers in per_key.values() for n in numbers) == list(range(12))
    assert all(numbers == sorted(numbers) for numbers in per_key.values())


async def test_a_user_statement_cap_does_not_stop_the_schema_half_way(port: int) -> None:
    """A user's MAX_STATEMENT_TIME (a guard for the application's queries) interrupted a
    migration's DDL, and every ``schema apply`` stopped at the same migration."""
    url = database(port, "capped")
    assert len(await apply(url)) >= 6
    assert await apply(url) == []
