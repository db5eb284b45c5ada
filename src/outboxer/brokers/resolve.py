"""The brokers' name lookups, on threads of their own rather than asyncio's default executor.

asyncio resolves a host name (``loop.getaddrinfo``, for every connection its drivers open:
aiormq, redis-py, nats-py, httpx) on the event loop's default executor, min(32, CPUs + 4)
threads shared with everything else of the process that blocks. A lookup lasts as long as
the resolver waits (a DNS outage: its timeout times its attempts, 10 to 30 s), and a
connect's timeout cancels the wait, not the lookup: each reconnect to a broker whose name
hangs, and each request of a webhook to one (its ``max_connections`` at once), held one
more thread, and the lookups of every other broker (a healthy webhook's next connection, a
reconnect) queued behind them; so did the process's exit, which waits for that executor.

Here a lookup of a broker's host runs on a daemon thread of its own, and the callers
asking the same question (the same host, port, family, type, protocol and flags) while it
is under way wait for that one lookup: a hung name costs one thread per question for as
long as the resolver takes, however many connects retry meanwhile. The process's exit does
not wait for it. Names no publisher connects to are resolved as the loop did
(``install``); so are all, past MAX_LOOKUPS questions under way at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import copy
import ipaddress
import os
import socket
import threading
import types
from collections.abc import Awaitable, Callable, Iterable
from typing import Any
from urllib.parse import unquote, urlsplit

#: Distinct questions under way at once on this module's threads; past it a lookup runs as
#: asyncio's own would (on the default executor), never waits for a place.
MAX_LOOKUPS = 64
#: The name of a lookup's thread: it shows in thread dumps.
THREAD_NAME = "outboxer-getaddrinfo"

_AddrInfo = list[tuple[Any, ...]]
_Question = tuple[Any, Any, int, int, int, int]

_guard = threading.Lock()
#: The lookups under way, by question (process-wide: any loop's callers share them).
_under_way: dict[_Question, concurrent.futures.Future[_AddrInfo]] = {}
#: The host names of the brokers publishers connect to (lower case), resolved here.
_hosts: set[str] = set()


def _forget_lookups() -> None:
    # A forked child has none of the parent's threads: a question left in the table would
    # wait for ever for a lookup that no thread makes.
    global _guard
    _guard = threading.Lock()
    _under_way.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_lookups)


def _host_key(host: object) -> str | None:
    if isinstance(host, bytes | bytearray):
        try:
            host = bytes(host).decode("ascii")
        except UnicodeDecodeError:
            return None
    return host.lower().rstrip(".") if isinstance(host, str) else None


def _spellings(host: str) -> set[str]:
    """``host`` as a caller may pass it to getaddrinfo: as written, in IDNA 2003 (the
    socket module's codec) or in IDNA 2008 (httpx's and anyio's, with the ``idna``
    package). They differ for some letters (``ß``: ``ss`` against ``xn--…``): the
    spelling httpx asked for was not routed here."""
    names = {host.lower().rstrip(".")}
    with contextlib.suppress(UnicodeError):
        names.add(host.encode("idna").decode("ascii").lower().rstrip("."))
    if not host.isascii():
        try:
            import idna
        except ImportError:  # no client here that spells it so
            return names
        # anyio's spelling (UTS 46 mapping), and httpx's (lower case, no mapping).
        for name, uts46 in ((host, True), (host.lower(), False)):
            with contextlib.suppress(UnicodeError, ValueError):  # idna.IDNAError included
                names.add(idna.encode(name, uts46=uts46).decode("ascii").lower().rstrip("."))
    return names


def hosts_of(url: str) -> list[str]:
    """The host names of a broker URL: one, or a cluster's (``nats://a:4222,b:4222``);
    numeric addresses too (asyncio does not look them up)."""
    hosts = []
    for part in urlsplit(url).netloc.split(","):
        server = part.rpartition("@")[2]
        if server.startswith("["):  # an IPv6 address
            continue
        host = server.rpartition(":")[0] if ":" in server else server
        if host:
            hosts.append(unquote(host))
    return hosts


def install(loop: asyncio.AbstractEventLoop, hosts: Iterable[str]) -> bool:
    """Resolve ``hosts`` (broker host names) on this module's threads from now on, in every
    loop this was called for; ``loop``'s lookups of other names go on as before. Whether
    ``loop`` resolves here: one whose ``getaddrinfo`` is not asyncio's own (uvloop resolves
    in libuv; another library replaced it) is left as it is."""
    with _guard:
        for host in hosts:
            _hosts.update(_spellings(host))
    if isinstance(getattr(loop, "getaddrinfo", None), _Routed):
        return True
    if getattr(type(loop), "getaddrinfo", None) is not asyncio.BaseEventLoop.getaddrinfo:
        return False
    try:
        if "getaddrinfo" in vars(loop):
            return False
        setattr(loop, "getaddrinfo", _Routed(loop))  # noqa: B010 -- an instance attribute
    except (TypeError, AttributeError):  # no instance attributes (a C loop)
        return False
    return True


async def looked_up(host: str, port: int, timeout: float) -> None:
    """Look ``host`` up through the running loop (here, once ``install`` routed it), within
    ``timeout`` seconds; raise as the lookup does (socket.gaierror), or TimeoutError.

    For a driver that resolves inside a blocking connect it runs on the default executor
    (aiomqtt's paho): a name that hangs there holds a thread past the connect's timeout,
    one more each attempt. Asked here first, such a name fails the attempt before the
    driver is called; one that answers was just answered (the driver asks again, from the
    resolver's cache in the usual setups). A numeric address is not looked up."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        loop = asyncio.get_running_loop()
        await asyncio.wait_for(loop.getaddrinfo(host, port, type=socket.SOCK_STREAM), timeout)


class _Routed:
    """``loop.getaddrinfo``: a broker's host resolved here, any other name by the loop's
    own method. A class, not a closure, so that ``install`` knows a loop it served."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._own: Callable[..., Awaitable[_AddrInfo]] = types.MethodType(
            asyncio.BaseEventLoop.getaddrinfo, loop
        )
        self._loop = loop

    def __call__(
        self,
        host: Any,
        port: Any,
        *,
        family: int = 0,
        type: int = 0,
        proto: int = 0,
        flags: int = 0,
    ) -> Awaitable[_AddrInfo]:
        key = _host_key(host)
        if key is not None and key in _hosts:
            lookup = _lookup((host, port, family, type, proto, flags))
            if lookup is not None:
                return _answer(self._loop, lookup)
        return self._own(host, port, family=family, type=type, proto=proto, flags=flags)


def _lookup(question: _Question) -> concurrent.futures.Future[_AddrInfo] | None:
    """The lookup under way for ``question``, started if none is; None past MAX_LOOKUPS."""
    with _guard:
        lookup = _under_way.get(question)
        if lookup is not None:
            return lookup
        if len(_under_way) >= MAX_LOOKUPS:
            return None
        lookup = _under_way[question] = concurrent.futures.Future()
    try:
        threading.Thread(
            target=_resolve, args=(question, lookup), name=THREAD_NAME, daemon=True
        ).start()
    except BaseException:
        with _guard:
            _under_way.pop(question, None)
        raise
    return lookup


def _resolve(question: _Question, lookup: concurrent.futures.Future[_AddrInfo]) -> None:
    host, port, family, type_, proto, flags = question
    try:
        answer = socket.getaddrinfo(host, port, family, type_, proto, flags)
    except BaseException as exc:  # noqa: BLE001 -- every waiter gets it
        with _guard:
            _under_way.pop(question, None)
        lookup.set_exception(exc)
    else:
        # Out of the table before the answer goes out: a caller asking after it starts a
        # new lookup, never gets a stale one (nothing is cached).
        with _guard:
            _under_way.pop(question, None)
        lookup.set_result(answer)


async def _answer(
    loop: asyncio.AbstractEventLoop, lookup: concurrent.futures.Future[_AddrInfo]
) -> _AddrInfo:
    """The outcome of ``lookup`` for one caller. Not ``asyncio.wrap_future``: a caller that
    gives up (its connect timed out) would cancel the lookup shared with the others."""
    waiter: asyncio.Future[_AddrInfo] = loop.create_future()

    def settle(done: concurrent.futures.Future[_AddrInfo]) -> None:
        if waiter.done():  # the caller gave up
            return
        error = done.exception()
        if error is not None:
            # Each caller its own exception: raised in several tasks, one object would
            # gather all their tracebacks.
            waiter.set_exception(_copied(error))
        else:
            waiter.set_result(list(done.result()))  # each caller its own list

    def answered(done: concurrent.futures.Future[_AddrInfo]) -> None:
        with contextlib.suppress(RuntimeError):  # its loop closed: nobody waits any more
            loop.call_soon_threadsafe(settle, done)

    lookup.add_done_callback(answered)
    return await waiter


def _copied(error: BaseException) -> BaseException:
    try:
        return copy.copy(error)
    except Exception:  # noqa: BLE001 -- an exception that cannot be copied: shared
        return error
