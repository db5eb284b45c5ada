"""The names a webhook's connections actually look up go to outboxer's lookup threads
(outboxer.brokers.resolve), not to asyncio's default executor that a DNS outage fills:

- a receiver's international name as httpx spells it (IDNA 2008: ``straße`` is
  ``xn--strae-oqa``; Python's codec, IDNA 2003, made it ``strasse``, a name nobody asks);
- the proxy httpx connects to when the environment names one (``HTTPS_PROXY``,
  ``HTTP_PROXY``, ``ALL_PROXY``): the receiver's own name is then looked up by the proxy,
  and the proxy's here, once per request.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from outboxer.brokers import resolve
from outboxer.brokers.base import OutcomeKind
from outboxer.brokers.webhook import WebhookPublisher
from outboxer.testing import make_message

#: Looked up by these tests; refused at once (an unknown name), each lookup's thread noted.
RECEIVER = "empfänger-straße.audit20-review-dns.test"
PROXY = "proxy.audit20-review-dns.test"


class Lookups:
    def __init__(self) -> None:
        #: (name asked, thread that asked it) for the names of these tests.
        self.seen: list[tuple[str, str]] = []


@pytest.fixture
def lookups(monkeypatch: pytest.MonkeyPatch) -> Iterator[Lookups]:
    found = Lookups()
    real = socket.getaddrinfo

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        name = host.decode() if isinstance(host, bytes) else str(host)
        if not name.endswith(".audit20-review-dns.test"):
            return real(host, *args, **kwargs)
        found.seen.append((name, threading.current_thread().name))
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    for name in ("http_proxy", "https_proxy", "all_proxy", "no_proxy", "REQUEST_METHOD"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    yield found


async def publish_one(url: str) -> None:
    publisher = WebhookPublisher(url, publish_timeout=5)
    await publisher.connect()
    try:
        [outcome] = await publisher.publish_batch([make_message("audit20", {"n": 1})])
        assert outcome.kind is OutcomeKind.FAILED and outcome.retryable, outcome
    finally:
        await publisher.close()


def routed(seen: list[tuple[str, str]]) -> list[bool]:
    return [thread.startswith(resolve.THREAD_NAME) for _, thread in seen]


async def test_an_international_receiver_name_is_looked_up_as_httpx_spells_it(
    lookups: Lookups,
) -> None:
    await publish_one(f"http://{RECEIVER}:8080/hook")
    assert lookups.seen, "no lookup of the receiver's name"
    assert all(routed(lookups.seen)), (
        f"looked up off outboxer's lookup threads: {lookups.seen} (Python's IDNA spelling "
        f"{RECEIVER.encode('idna').decode()!r} was the one routed)"
    )


async def test_the_environments_proxy_is_looked_up_on_the_lookup_threads(
    lookups: Lookups, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("http_proxy", f"http://{PROXY}:3128")
    await publish_one("http://receiver.example:8080/hook")
    assert [name for name, _ in lookups.seen] == [PROXY], lookups.seen
    assert all(routed(lookups.seen)), f"looked up off outboxer's lookup threads: {lookups.seen}"
