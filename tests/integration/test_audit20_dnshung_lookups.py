"""The brokers' name lookups run on threads of their own (outboxer.brokers.resolve), one per
question under way however many connects ask it, not on asyncio's default executor.

Before, a webhook whose host name hung (a DNS outage) held a default-executor thread per
request (``max_connections`` at once), so every other lookup of the process (a healthy
broker's reconnect, a healthy webhook's next connection) and everything else run there
waited for the resolver's timeout; and ``asyncio.run`` waits for that executor at its
end, so a stopped relay did not exit until the hung lookups ended.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from outboxer.brokers.base import OutcomeKind
from outboxer.brokers.webhook import WebhookPublisher
from outboxer.testing import make_message
from tests.integration.test_audit20_dnshung_store import (
    HUNG_NAME,
    SITECUSTOMIZE,
    HungResolver,
    enqueue,
    start_relay,
    wait_for_lookups,
)

#: Requests at once to the hung name: more than any default executor has threads (32).
REQUESTS = 40
#: How long a hung lookup lasts unless the test releases it: past the tests' waits.
HANG = 20.0


@dataclass
class HungLookups:
    #: The names of the threads that looked HUNG_NAME up.
    threads: list[str] = field(default_factory=list)
    release: threading.Event = field(default_factory=threading.Event)


@pytest.fixture
def hung_lookups(monkeypatch: pytest.MonkeyPatch) -> Iterator[HungLookups]:
    """This process's lookups of HUNG_NAME hang until released."""
    hung = HungLookups()
    real = socket.getaddrinfo

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host not in (HUNG_NAME, HUNG_NAME.encode()):
            return real(host, *args, **kwargs)
        hung.threads.append(threading.current_thread().name)
        hung.release.wait(HANG)
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    try:
        yield hung
    finally:
        hung.release.set()


async def test_a_webhooks_requests_to_a_hung_name_share_one_lookup_off_the_default_executor(
    hung_lookups: HungLookups,
) -> None:
    publisher = WebhookPublisher(
        f"http://{HUNG_NAME}:8080/hook?max_connections={REQUESTS}&timeout=0.5"
    )
    batch = [make_message("dnshung", {"n": n}) for n in range(REQUESTS)]
    await publisher.connect()
    try:
        outcomes = await publisher.publish_batch(batch)
        assert {(o.kind, o.retryable) for o in outcomes} == {(OutcomeKind.FAILED, True)}
        loop = asyncio.get_running_loop()
        began = time.monotonic()
        # The default executor answers at once, lookups of other names included.
        try:
            await asyncio.wait_for(loop.run_in_executor(None, lambda: None), 2)
            await asyncio.wait_for(loop.getaddrinfo("localhost", 80), 2)
        except TimeoutError:
            pytest.fail(
                f"the default executor did not answer within 2 s: {len(hung_lookups.threads)} "
                f"lookup(s) of {HUNG_NAME} under way"
            )
        took = time.monotonic() - began
        assert took < 1, f"the default executor answered in {took:.1f} s"
        assert len(hung_lookups.threads) == 1, hung_lookups.threads
        assert hung_lookups.threads[0].startswith("outboxer-getaddrinfo"), hung_lookups.threads
        # The next attempt's requests wait for the same lookup: no new thread.
        await publisher.publish_batch(batch)
        assert len(hung_lookups.threads) == 1, hung_lookups.threads
    finally:
        hung_lookups.release.set()  # before the loop's end waits for its default executor
        await publisher.close()


@pytest.fixture
def resolver(tmp_path: Path) -> Iterator[HungResolver]:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    hung = HungResolver(site, tmp_path / "lookups.log", tmp_path / "armed", tmp_path / "release")
    hung.armed.touch()
    try:
        yield hung
    finally:
        hung.release.touch()


def test_a_stopped_relay_exits_while_its_brokers_lookups_still_hang(
    sqlite_url: str, tmp_path: Path, resolver: HungResolver
) -> None:
    enqueue(sqlite_url, "default", REQUESTS)
    relay = start_relay(
        tmp_path,
        resolver,
        f'db = "{sqlite_url}"\nbroker = "http://{HUNG_NAME}:8080/hook?max_connections={REQUESTS}"\n',
        "--shutdown-timeout",  # the batch waiting on the lookups is given back at the stop
        "1",
    )
    try:
        wait_for_lookups(resolver, relay, 1)
        time.sleep(0.5)  # the batch's requests are all waiting on lookups
        relay.terminate()
        began = time.monotonic()
        try:
            relay.wait(6)
        except subprocess.TimeoutExpired:
            pytest.fail(
                f"the relay had not exited {time.monotonic() - began:.0f} s after SIGTERM, "
                f"{resolver.lookups()} lookup(s) of {HUNG_NAME} under way"
            )
        assert relay.returncode == 0, (tmp_path / "relay.log").read_text()[-3000:]
    finally:
        resolver.release.touch()
        if relay.poll() is None:
            relay.kill()
            relay.wait()
