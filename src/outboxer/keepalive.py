"""TCP keepalives bounded by a connection's statement bound, on both ends of the socket.

The client's (``set_keepalives``, libpq's ``keepalives*`` options) make the client give up a
connection whose database host vanished; the server's (``server_keepalives_sql``: the
``tcp_keepalives_*`` settings of the session, which act on the backend's socket) make
PostgreSQL end a backend whose client host vanished (powered off, partitioned away), and
with it the locks it held: a consumer's inbox claims in its open transaction, a stream
relay's reader lock. Without them the server finds out through the kernel's defaults: a
first probe after two hours, given up some eleven minutes later.

Standard library only: the stores import it as well as the consumer.
"""

from __future__ import annotations

import logging
import math
import socket
from typing import Any

logger = logging.getLogger("outboxer.keepalive")

#: Probes unanswered before the kernel gives the peer up (libpq's ``keepalives_count``).
KEEPALIVE_PROBES = 3
#: The longest idle time or probe interval the kernel takes, in seconds (Linux's
#: MAX_TCP_KEEPIDLE and MAX_TCP_KEEPINTVL).
KEEPALIVE_MAX = 32767


def keepalive_timing(bound: float) -> tuple[int, int, int]:
    """The TCP keepalives of a connection bounded by ``bound`` seconds: idle time before the
    first probe, time between probes, probes unanswered before the kernel gives the
    connection up, in whole seconds (the kernel's unit), about ``bound`` in all. The same
    for every driver and both ends: libpq's options (``libpq_keepalives``), the socket's for
    the others (``set_keepalives``), the server's session settings
    (``server_keepalives_sql``)."""
    seconds = max(2, math.ceil(bound))
    # Linux refuses more than MAX_TCP_KEEPIDLE / MAX_TCP_KEEPINTVL seconds (EINVAL), and libpq
    # then fails the connect: a bound past about 18 hours (a statement_timeout of 1d) made
    # every psycopg connection fail. Capped, a dead peer is still found, only later.
    return (
        min(KEEPALIVE_MAX, max(1, seconds // 2)),
        min(KEEPALIVE_MAX, max(1, seconds // 6)),
        KEEPALIVE_PROBES,
    )


def libpq_keepalives(bound: float) -> dict[str, int]:
    """``keepalive_timing`` as libpq's connect options."""
    idle, interval, count = keepalive_timing(bound)
    return {
        "keepalives": 1,
        "keepalives_idle": idle,
        "keepalives_interval": interval,
        "keepalives_count": count,
    }


#: The socket options of ``keepalive_timing``'s three numbers, by their names on Linux; on
#: macOS the idle time's is TCP_KEEPALIVE. One the platform lacks is left as it is.
KEEPALIVE_OPTIONS = (("TCP_KEEPIDLE", "TCP_KEEPALIVE"), ("TCP_KEEPINTVL",), ("TCP_KEEPCNT",))


def set_keepalives(sock: Any, bound: float | None) -> None:
    """Set ``keepalive_timing(bound)`` on the connected socket ``sock`` of a driver that
    has no option for them (asyncpg sets none, PyMySQL and mysqlclient SO_KEEPALIVE alone:
    the kernel's defaults, a first probe after two hours), as libpq's options do on
    psycopg's: without them a statement whose request reached the server before its host
    vanished waits for its answer for ever (nothing unacknowledged, so no retransmission
    gives up either).

    ``sock``: a socket or asyncio's TransportSocket; for TLS the one under it (asyncpg's
    transport gives that one; PyMySQL's SSLSocket is it, by its descriptor). None, or a
    Unix-domain socket: nothing (no peer host to vanish), nor with no bound (as psycopg).
    A platform refusing an option leaves the connection as the driver made it (logged):
    no keepalives is what it had before, not a reason to refuse the database."""
    if bound is None or sock is None:
        return
    try:
        if sock.family not in (socket.AF_INET, socket.AF_INET6):
            return
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for names, value in zip(KEEPALIVE_OPTIONS, keepalive_timing(bound), strict=True):
            option = next((getattr(socket, n) for n in names if hasattr(socket, n)), None)
            if option is not None:
                sock.setsockopt(socket.IPPROTO_TCP, option, value)
    except OSError as exc:
        logger.warning("cannot set TCP keepalives on a database connection: %s", exc)


def set_keepalives_fd(fd: int, bound: float | None) -> None:
    """``set_keepalives`` on the socket of descriptor ``fd``, which its driver keeps (a C
    driver's: mysqlclient gives only ``fileno()``)."""
    if bound is None or fd < 0:
        return
    try:
        sock = socket.socket(fileno=fd)
    except OSError as exc:  # closed already, or no socket
        logger.debug("no socket to set TCP keepalives on: %s", exc)
        return
    try:
        set_keepalives(sock, bound)
    finally:
        sock.detach()


def set_asyncpg_keepalives(conn: Any, bound: float | None) -> None:
    """``set_keepalives`` on the TCP socket of asyncpg connection ``conn`` (under TLS, the
    one under it: the transport's)."""
    set_keepalives(conn._transport.get_extra_info("socket"), bound)


#: PostgreSQL's settings of the backend's keepalives, in ``keepalive_timing``'s order.
SERVER_KEEPALIVES = ("tcp_keepalives_idle", "tcp_keepalives_interval", "tcp_keepalives_count")


def server_keepalives_sql(bound: float) -> str:
    """A scalar SQL expression that gives the session's backend ``keepalive_timing(bound)``
    (PostgreSQL's ``tcp_keepalives_*``, which any role may set), for a query the connection
    sends anyway: no round trip of its own, and no startup parameter, which a pooler
    refuses ("unsupported startup parameter" from PgBouncer, unless told to ignore it).
    Its value: how many it set.

    Only those nothing configures (source ``default``): the URL's own (``options=-c …``,
    PGOPTIONS, asyncpg's query parameters), the role's or database's (ALTER ROLE … SET) and
    the server's configuration win. A session setting: a transaction rolled back undoes
    it, so it must run in autocommit or a transaction that commits. On a Unix-domain
    socket PostgreSQL takes it and it does nothing. Not ``tcp_user_timeout``: it would also
    give up on a live client reading a big result slowly (data left unacknowledged)."""
    values = ", ".join(
        f"('{name}', '{value}')"
        for name, value in zip(SERVER_KEEPALIVES, keepalive_timing(bound), strict=True)
    )
    return (
        "(SELECT count(set_config(s.name, v.value, false)) FROM pg_catalog.pg_settings s "
        f"JOIN (VALUES {values}) AS v (name, value) ON v.name = s.name "
        "WHERE s.source = 'default')"
    )


async def keep_asyncpg_alive(conn: Any, bound: float) -> None:
    """Both ends of asyncpg connection ``conn``: ``set_asyncpg_keepalives`` and, in a round
    trip of its own, ``server_keepalives_sql`` (for connections that send no query of their
    own at connect: schema changes)."""
    set_asyncpg_keepalives(conn, bound)
    await conn.fetchval(f"SELECT {server_keepalives_sql(bound)}")
