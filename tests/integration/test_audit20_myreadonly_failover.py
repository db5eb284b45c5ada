"""A MariaDB failover that leaves the old primary up and read-only (``SET GLOBAL read_only``,
as orchestrator, MHA or ProxySQL fence it) while a replica is promoted and a proxy leads new
connections to it: the relay must drop the connections that reach the old server and go on
on the new primary, losing nothing, leaving no row PROCESSING.

Before, the relay kept its pooled connection to the old server, which answered every
claim and settle with 1290 ("running with the --read-only option"), rolled back and was
given back to the pool: the settle of the batch in flight at the failover, and every claim
after, failed on it for ever.

Two private MariaDB servers (``mariadbd`` on free ports, temporary data directories): the
old primary, with a binary log, and its replica, read-only until promoted. The relay and
the consumer log in as a user without the privileges that bypass ``read_only`` (root has
READ ONLY ADMIN), through a TCP proxy (tests/chaos/proxy.py) that stands for the DNS name
or the proxy a failover repoints. The shared server on 3306 is not touched.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import outboxer
from outboxer.message import Message
from tests.chaos.proxy import FaultProxy
from tests.relaying import enqueue, relay, rows, until
from tests.services import free_port, port_open, require

MARIADBD = "/usr/sbin/mariadbd"
INSTALL_DB = shutil.which("mariadb-install-db") or "/usr/bin/mariadb-install-db"
PASSWORD = "pw"
#: The users of both servers, made before the binary log starts (not replicated): ``app``
#: (the relay and the consumer) may read and write the tables and nothing more, so
#: ``read_only`` stops it; ``admin`` bypasses it (the test's writes on the old primary).
_USERS = f"""
SET sql_log_bin = 0;
CREATE DATABASE test;
CREATE USER 'admin'@'%' IDENTIFIED BY '{PASSWORD}';
GRANT ALL ON *.* TO 'admin'@'%' WITH GRANT OPTION;
CREATE USER 'app'@'%' IDENTIFIED BY '{PASSWORD}';
GRANT SELECT, INSERT, UPDATE, DELETE ON test.* TO 'app'@'%';
CREATE USER 'repl'@'%' IDENTIFIED BY '{PASSWORD}';
GRANT REPLICATION SLAVE ON *.* TO 'repl'@'%';
"""


def sql(port: int, statement: str, *args: Any) -> list[tuple[Any, ...]]:
    """``statement`` as ``admin`` on the server at ``port``, in autocommit; its rows."""
    import pymysql

    conn = pymysql.connect(
        host="127.0.0.1",
        port=port,
        user="admin",
        password=PASSWORD,
        database="test",
        autocommit=True,
        connect_timeout=5,
    )
    try:
        with conn.cursor() as cursor:
            cursor.execute(statement, args or None)
            return list(cursor.fetchall())
    finally:
        conn.close()


def sessions(port: int) -> set[int]:
    """The connection ids of ``app`` on the server at ``port``."""
    found = sql(port, "SELECT id FROM information_schema.processlist WHERE user = 'app'")
    return {int(row[0]) for row in found}


@dataclass
class Pair:
    """An old primary and its replica; ``proxy`` leads to the primary of the moment."""

    old: int
    new: int
    proxy: FaultProxy

    def url(self, user: str = "app") -> str:
        """The database as the application sees it: through the proxy."""
        return f"mysql://{user}:{PASSWORD}@127.0.0.1:{self.proxy.port}/test"

    def admin_url(self, port: int) -> str:
        return f"mysql://admin:{PASSWORD}@127.0.0.1:{port}/test"

    def caught_up(self) -> None:
        """Wait until the replica has applied everything the old primary logged."""
        [(position,)] = sql(self.old, "SELECT @@gtid_binlog_pos")
        [(waited,)] = sql(self.new, "SELECT MASTER_GTID_WAIT(%s, 10)", position)
        assert waited == 0, f"the replica did not catch up with {position}"

    def failover(self) -> None:
        """What orchestrator does: fence the old primary read-only (it stays up, its
        sessions open), let the replica catch up, promote it, repoint the proxy."""
        sql(self.old, "SET GLOBAL read_only = ON")
        self.caught_up()
        sql(self.new, "STOP SLAVE")
        sql(self.new, "RESET SLAVE ALL")
        sql(self.new, "SET GLOBAL read_only = OFF")
        self.proxy.target_port = self.new  # new connections only, as a DNS change


def _start(home: Path, name: str, options: list[str]) -> tuple[subprocess.Popen[bytes], int]:
    data = home / name
    user = ["--user=root"] if os.geteuid() == 0 else []
    # A temporary directory of each server's own: the servers name their temporary tables
    # by process id and thread, and two bootstraps of parallel test workers sharing /tmp
    # dropped each other's ("Could not remove temporary table ... Unknown table").
    tmp = home / f"{name}-tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp)}
    installed = subprocess.run(
        [INSTALL_DB, "--no-defaults", *user, f"--datadir={data}", "--skip-test-db"],
        check=False,
        capture_output=True,
        timeout=60,
        env=env,
    )
    if installed.returncode != 0:
        pytest.fail(
            f"mariadb-install-db failed ({installed.returncode}): "
            f"{installed.stdout.decode(errors='replace')}{installed.stderr.decode(errors='replace')}"
        )
    (home / f"{name}.sql").write_text(_USERS)
    port = free_port()
    log = home / f"{name}.err"
    with open(log, "wb") as stderr:
        server = subprocess.Popen(
            [
                MARIADBD,
                "--no-defaults",
                *user,
                f"--datadir={data}",
                f"--port={port}",
                "--bind-address=127.0.0.1",
                f"--socket={home / name}.sock",
                f"--pid-file={home / name}.pid",
                "--skip-name-resolve",
                "--innodb-buffer-pool-size=16M",
                f"--init-file={home / name}.sql",
                f"--tmpdir={tmp}",
                *options,
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
    deadline = time.monotonic() + 30
    while not port_open(port):
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            pytest.fail(f"private MariaDB {name} did not start: {log.read_text()}")
        time.sleep(0.05)
    return server, port


def _stop(server: subprocess.Popen[bytes]) -> None:
    server.send_signal(signal.SIGTERM)
    try:
        server.wait(30)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


@contextlib.contextmanager
def primary_and_replica() -> Iterator[Pair]:
    """Two private MariaDB servers, the second replicating the first (GTID), the outbox
    schema applied on the first; both ended, their files removed, when the block ends."""
    if not (os.path.exists(MARIADBD) and os.path.exists(INSTALL_DB)):
        pytest.skip("mariadbd / mariadb-install-db not installed")
    home = Path(tempfile.mkdtemp(prefix="outboxer-audit20-myreadonly-"))
    servers: list[subprocess.Popen[bytes]] = []
    proxy: FaultProxy | None = None
    try:
        server, old = _start(home, "old", ["--server-id=1", f"--log-bin={home / 'old-bin'}"])
        servers.append(server)
        server, new = _start(home, "new", ["--server-id=2", "--skip-log-bin", "--read-only=ON"])
        servers.append(server)
        sql(
            new,
            "CHANGE MASTER TO MASTER_HOST = '127.0.0.1', MASTER_PORT = %s, "
            "MASTER_USER = 'repl', MASTER_PASSWORD = %s, MASTER_USE_GTID = slave_pos",
            old,
            PASSWORD,
        )
        sql(new, "START SLAVE")
        proxy = FaultProxy(old).start()
        pair = Pair(old, new, proxy)

        async def schema() -> None:
            async with outboxer.create_store(pair.admin_url(old)) as store:
                await store.apply_schema()

        asyncio.run(schema())
        pair.caught_up()
        yield pair
    finally:
        if proxy is not None:
            proxy.stop()
        for server in servers:
            _stop(server)
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture
def pair() -> Iterator[Pair]:
    with primary_and_replica() as made:
        yield made


async def test_the_relay_settles_and_claims_on_the_new_primary_after_a_read_only_failover(
    pair: Pair, caplog: pytest.LogCaptureFixture
) -> None:
    """The failover strikes while a batch is at the broker: its settle meets the read-only
    old primary, then goes to the new one (where the batch's rows replicated PROCESSING
    under the relay's lease); the messages written on the new primary are relayed too."""
    from tests.rabbit import RabbitConsumer

    require("rabbitmq")
    caplog.set_level(logging.WARNING, logger="outboxer")
    rabbit = await RabbitConsumer().start()
    the_relay = relay(pair.url(), rabbit.broker_url)
    publisher = the_relay.publishers["default"]
    publish = publisher.publish_batch
    at_broker, failed_over = asyncio.Event(), asyncio.Event()

    async def held_at_the_failover(messages: Any, known: Any = None) -> Any:
        if not at_broker.is_set():
            at_broker.set()
            await failed_over.wait()
        return await publish(messages, known)

    publisher.publish_batch = held_at_the_failover  # type: ignore[method-assign]
    running = asyncio.create_task(the_relay.run())
    try:
        before: list[Message] = enqueue(pair.admin_url(pair.old), ("t", "a"), ("t", "b"))
        await asyncio.wait_for(at_broker.wait(), 10)
        relay_sessions_on_old = sessions(pair.old)
        assert relay_sessions_on_old, "the relay holds no connection to the old primary"
        await asyncio.to_thread(pair.failover)
        failed_over.set()
        after: list[Message] = enqueue(pair.admin_url(pair.new), ("t", "c"), ("t", "a"))

        found: list[dict[str, object]] = []

        async def relayed() -> bool:
            found[:] = await rows(pair.admin_url(pair.new))
            return len(found) == 4 and {row["status"] for row in found} == {"PUBLISHED"}

        try:
            await until(relayed, "", 10)
        except AssertionError:
            states = [(row["seq"], row["status"]) for row in found]
            raise AssertionError(f"the relay did not go on on the new primary: {states}") from None
        await rabbit.wait_for(4, 10, distinct=True)
        assert {d.message_id for d in rabbit.received} == {str(m.id) for m in before + after}
        # The old primary's connections were dropped, not kept (they answered read-only).
        assert not sessions(pair.old) & relay_sessions_on_old
        assert sessions(pair.new)
        assert any("read-only" in r.getMessage() for r in caplog.records), "no outage logged"
        await until(lambda: not the_relay.health_problems(), "/health still reports it", 5)
    finally:
        the_relay.stop()
        await asyncio.wait_for(running, 20)
        await rabbit.stop()


async def test_the_relay_reconnects_while_the_server_stays_read_only_and_resumes_after(
    pair: Pair,
) -> None:
    """No new primary yet: each try meets a read-only server (an outage on /health,
    nothing claimed), on a new connection each time; writable again, everything goes out."""
    from tests.rabbit import RabbitConsumer

    require("rabbitmq")
    rabbit = await RabbitConsumer().start()
    the_relay = relay(pair.url(), rabbit.broker_url)
    running = asyncio.create_task(the_relay.run())
    admin = pair.admin_url(pair.old)
    try:
        enqueue(admin, ("t", "a"))
        await until(lambda: len(rabbit.received) == 1, "the first message was not relayed", 10)

        async def settled() -> bool:
            # The consumer can have it before the relay's settle: read-only from here, the
            # row would stay PROCESSING (a failed settle) until the server is writable.
            return {row["status"] for row in await rows(admin)} == {"PUBLISHED"}

        await until(settled, "the first message was not settled", 10)
        first = sessions(pair.old)
        sql(pair.old, "SET GLOBAL read_only = ON")
        enqueue(admin, ("t", "b"), ("t", "c"))  # admin bypasses read_only
        await until(
            lambda: any("read-only" in p for p in the_relay.health_problems()),
            "/health does not report the read-only database",
            10,
        )
        # The connections made anew are short-lived (each answers read-only at once and
        # goes): counted where they pass, at the proxy.
        made = pair.proxy.connections

        def replaced() -> bool:
            return pair.proxy.connections >= made + 2 and not sessions(pair.old) & first

        await until(replaced, f"the relay kept its connections {first}", 10)
        assert {row["status"] for row in await rows(admin)} == {"PUBLISHED", "PENDING"}
        sql(pair.old, "SET GLOBAL read_only = OFF")
        await until(lambda: len(rabbit.received) == 3, "not relayed once writable", 15)
        # Received before the relay's settle, as above: a loaded box's CI read PROCESSING.
        await until(settled, "not settled once writable", 10)
    finally:
        the_relay.stop()
        await asyncio.wait_for(running, 20)
        await rabbit.stop()
