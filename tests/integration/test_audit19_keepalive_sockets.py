"""The consumer's asyncpg and PyMySQL connections carry TCP keepalives set to about the
session's ``statement_timeout``, as libpq's options set them on its psycopg connections.

Without them a handler's statement whose request reached the server's kernel before the
server's host vanished (powered off, a black-holed network) waited for its answer for ever:
nothing was left unacknowledged, so no retransmission timeout gave up either, and the
handler's statements are not the watchdog's (only ``handler_timeout``, off by default,
bounds them). asyncpg set no keepalives at all, PyMySQL SO_KEEPALIVE with the kernel's
defaults (a first probe after two hours, then nine more 75 s apart).

A vanished host cannot be made in user space: a proxy (tests/chaos/proxy.py) that stops
forwarding still has its kernel acknowledge the data and answer the probes, which is a
stalled peer the keepalives cannot tell (the watchdog's case), not a dead one. So the proof
is what the kernel was told: the options read back with getsockopt from the live
connection's socket, found from outside its driver by the client port the server reports,
against the shared PostgreSQL and MariaDB, for sessions opened by the real session classes.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from pathlib import Path
from typing import Any

import pytest

from outboxer.consumer_db import AsyncpgSession, DaemonThreadPool, PsycopgSession, PyMySQLSession

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="TCP_KEEPIDLE and /proc are Linux's"
)

#: (SO_KEEPALIVE, TCP_KEEPIDLE, TCP_KEEPINTVL, TCP_KEEPCNT) of a connection bounded by the
#: default bound (a minute) and by 13 s: half the bound idle, a sixth between probes,
#: 3 probes, in whole seconds (libpq's keepalives_* as consumer_db sets them on psycopg).
DEFAULT_BOUND = (1, 30, 10, 3)
BOUND = 13.0
BOUNDED = (1, 6, 2, 3)
#: The kernel's defaults: what a connection has where no one set its keepalive times.
KERNEL = tuple(
    int(Path(f"/proc/sys/net/ipv4/tcp_keepalive_{name}").read_text())
    for name in ("time", "intvl", "probes")
)
PG_SOCKETS = "/var/run/postgresql"
MYSQL_SOCKET = "/run/mysqld/mysqld.sock"


def client_socket(port: int | None = None, *, peer: tuple[str, int] | None = None) -> socket.socket:
    """A duplicate of this process's one TCP socket whose local port is ``port`` (or whose
    peer is ``peer``): the same socket (the options are the socket's, not the
    descriptor's), found without asking the driver which one it is."""
    found: dict[int, socket.socket] = {}  # by inode: one socket, however many descriptors
    for name in os.listdir("/proc/self/fd"):
        try:
            fd = os.dup(int(name))
        except OSError:  # the listing's own descriptor, closed by now
            continue
        try:
            sock = socket.socket(fileno=fd)
        except OSError:  # not a socket
            os.close(fd)
            continue
        try:
            inode = os.fstat(fd).st_ino
            if (
                inode not in found
                and sock.family in (socket.AF_INET, socket.AF_INET6)
                and (
                    sock.getsockname()[1] == port
                    if peer is None
                    else sock.getpeername()[:2] == peer
                )
            ):
                found[inode] = sock
                continue
        except OSError:  # not connected
            pass
        sock.close()
    if len(found) != 1:
        for sock in found.values():
            sock.close()
        raise AssertionError(f"{len(found)} sockets of this process on {port or peer}")
    return next(iter(found.values()))


def keepalives(sock: socket.socket) -> tuple[int, int, int, int]:
    return (
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
        sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
        sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
        sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
    )


def _mysql_client_port(conn: Any) -> int:
    with conn.cursor() as cursor:
        cursor.execute("SELECT host FROM information_schema.processlist WHERE id = CONNECTION_ID()")
        (host,) = cursor.fetchone()
    return int(host.rsplit(":", 1)[1])


async def _asyncpg(url: str, bound: float | None, *, default: bool = False) -> tuple[int, ...]:
    session = AsyncpgSession(url, "outboxer")
    if not default:
        session.statement_timeout = bound
    await session.open()
    try:
        port = await session.conn.fetchval("SELECT inet_client_port()")
        with client_socket(port) as sock:
            return keepalives(sock)
    finally:
        await session.close()


async def _psycopg(url: str, bound: float) -> tuple[int, ...]:
    pool = DaemonThreadPool(1, thread_name_prefix="audit19-keepalive")
    session = PsycopgSession(url, "outboxer", pool)
    session.statement_timeout = bound
    await session.open()
    try:
        (port,) = session.conn.execute("SELECT inet_client_port()").fetchone()
        with client_socket(port) as sock:
            return keepalives(sock)
    finally:
        await session.close()
        pool.shutdown(wait=False)


async def _pymysql(url: str, bound: float | None, *, default: bool = False) -> tuple[int, ...]:
    pool = DaemonThreadPool(1, thread_name_prefix="audit19-keepalive")
    session = PyMySQLSession(url, "outboxer", pool)
    if not default:
        session.statement_timeout = bound
    await session.open()
    try:
        with client_socket(_mysql_client_port(session.conn)) as sock:
            return keepalives(sock)
    finally:
        await session.close()
        pool.shutdown(wait=False)


async def test_asyncpg_session_connections_carry_keepalives_derived_from_the_bound(
    pg_url: str,
) -> None:
    assert await _asyncpg(pg_url, None, default=True) == DEFAULT_BOUND
    bounded = await _asyncpg(pg_url, BOUND)
    assert bounded == BOUNDED
    # The same numbers libpq was given for a psycopg session of the same bound.
    assert bounded == await _psycopg(pg_url, BOUND)
    # No bound, no keepalives added (as on psycopg): asyncpg's own, none.
    assert await _asyncpg(pg_url, None) == (0, *KERNEL)


async def test_pymysql_session_connections_carry_keepalives_derived_from_the_bound(
    mysql_url: str,
) -> None:
    assert await _pymysql(mysql_url, None, default=True) == DEFAULT_BOUND
    assert await _pymysql(mysql_url, BOUND) == BOUNDED
    # No bound, no keepalive times added: PyMySQL's own SO_KEEPALIVE, the kernel's times.
    assert await _pymysql(mysql_url, None) == (1, *KERNEL)


@pytest.mark.skipif(
    not (os.path.exists(PG_SOCKETS) and os.path.exists(MYSQL_SOCKET)),
    reason="the services' Unix-domain sockets are not here",
)
async def test_unix_domain_connections_are_left_as_the_drivers_made_them(
    pg_url: str, mysql_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """No peer host to vanish: nothing set, nothing refused (TCP options on a Unix-domain
    socket fail), nothing logged; and a bounded TCP connection of each kind alongside
    does get them."""
    caplog.set_level(logging.DEBUG, logger="outboxer")
    database = pg_url.rsplit("/", 1)[1]
    session = AsyncpgSession(f"postgresql://postgres@/{database}?host={PG_SOCKETS}", "outboxer")
    session.statement_timeout = BOUND
    await session.open()
    try:
        assert await session.conn.fetchval("SELECT inet_client_port()") is None  # Unix
        sock = session.conn._transport.get_extra_info("socket")
        assert sock.family == socket.AF_UNIX
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 0
    finally:
        await session.close()

    pool = DaemonThreadPool(1, thread_name_prefix="audit19-keepalive")
    mysql = PyMySQLSession(f"{mysql_url}?unix_socket={MYSQL_SOCKET}", "outboxer", pool)
    mysql.statement_timeout = BOUND
    await mysql.open()
    try:
        assert mysql.conn._sock.family == socket.AF_UNIX
        assert mysql.conn._sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 0
    finally:
        await mysql.close()
        pool.shutdown(wait=False)
    assert not [r for r in caplog.records if "keepalive" in r.getMessage()], caplog.text

    assert await _asyncpg(pg_url, BOUND) == BOUNDED
    assert await _pymysql(mysql_url, BOUND) == BOUNDED
