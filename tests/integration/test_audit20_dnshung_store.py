"""A broker whose host name does not resolve promptly (a DNS outage: each lookup waits for
the resolver's timeout) must not stall the relay's SQLite statements, for any destination.

asyncio's default executor has min(32, CPUs + 4) threads, and what blocks there is not
interrupted by its caller's timeout. The SQLite store ran its statements there
(``asyncio.to_thread``), behind the name lookups (``loop.getaddrinfo``) and MQTT connects
(aiomqtt runs paho's blocking connect there, its lookup included) of every broker: with as
many MQTT brokers whose name hung as the executor has threads (their first connects), or
one webhook's requests (``max_connections`` lookups at once), the claims, settles and
lease renewals of every destination queued behind the lookups. Now the store's statements
run on a thread of its own, and the brokers' lookups on theirs (see
test_audit20_dnshung_lookups): either alone keeps the relay going, the last test here
pins the first.

The real ``outboxer relay`` runs in its own process; its resolver hangs for one made-up
name only (a ``sitecustomize`` wraps ``socket.getaddrinfo`` there, until the test releases
it): every connection of the test stays on 127.0.0.1. Before, the healthy destination's
messages waited for the lookups (20 s here; a resolver's 5 s times its attempts in a real
outage), /health said "database: no answer within 5s", and a batch in flight lost its
lease (its renewals queued behind the lookups).
"""

from __future__ import annotations

import ast
import asyncio
import json
import os
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import outboxer
from outboxer.stores import create_store
from outboxer.stores.sqlite import sqlite_path
from tests.s3 import silent_listener
from tests.services import free_port, require

HUNG_NAME = "broker.dns-hung.test"
#: How long a lookup of HUNG_NAME hangs unless released: past every wait of the tests.
HANG_SECONDS = 20.0
#: As many MQTT brokers named HUNG_NAME as the default executor has threads: their first
#: connects took all of them.
HUNG_BROKERS = min(32, (os.cpu_count() or 1) + 4)

#: Lookups of HUNG_NAME fail at once (an unknown name) until the armed file appears; then
#: they block until the release file appears (at most DNSHUNG_SECONDS) and fail as a
#: resolver's timeout does, each one appending a line to the log.
SITECUSTOMIZE = """
import os, socket, time

_real = socket.getaddrinfo


def getaddrinfo(host, *args, **kwargs):
    name = host.decode() if isinstance(host, bytes) else host
    if name != os.environ["DNSHUNG_NAME"]:
        return _real(host, *args, **kwargs)
    if not os.path.exists(os.environ["DNSHUNG_ARMED"]):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    with open(os.environ["DNSHUNG_LOG"], "a") as log:
        log.write("lookup\\n")
    deadline = time.monotonic() + float(os.environ["DNSHUNG_SECONDS"])
    while time.monotonic() < deadline and not os.path.exists(os.environ["DNSHUNG_RELEASE"]):
        time.sleep(0.02)
    raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")


socket.getaddrinfo = getaddrinfo
"""


@dataclass
class HungResolver:
    site: Path
    log: Path
    armed: Path
    release: Path

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOXER_")}
        path = [str(self.site), *filter(None, [env.get("PYTHONPATH")])]
        env.update(
            PYTHONPATH=os.pathsep.join(path),
            DNSHUNG_NAME=HUNG_NAME,
            DNSHUNG_SECONDS=str(HANG_SECONDS),
            DNSHUNG_LOG=str(self.log),
            DNSHUNG_ARMED=str(self.armed),
            DNSHUNG_RELEASE=str(self.release),
        )
        return env

    def lookups(self) -> int:
        return len(self.log.read_text().splitlines()) if self.log.exists() else 0


@pytest.fixture
def resolver(tmp_path: Path) -> Iterator[HungResolver]:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    hung = HungResolver(site, tmp_path / "lookups.log", tmp_path / "armed", tmp_path / "release")
    try:
        yield hung
    finally:
        hung.release.touch()


@pytest.fixture
def redis() -> None:
    require("redis")


def enqueue(url: str, destination: str, count: int, **options: str) -> None:
    conn = sqlite3.connect(sqlite_path(url), timeout=30)
    try:
        for n in range(count):
            outboxer.enqueue(conn, "dnshung", {"n": n}, destinations=[destination], **options)
        conn.commit()
    finally:
        conn.close()


def rows(url: str, destination: str, status: str) -> int:
    conn = sqlite3.connect(sqlite_path(url), timeout=30)
    try:
        (count,) = conn.execute(
            "SELECT count(*) FROM outbox WHERE destination = ? AND status = ?",
            (destination, status),
        ).fetchone()
        return int(count)
    finally:
        conn.close()


def start_relay(
    tmp_path: Path, resolver: HungResolver, config: str, *flags: str
) -> subprocess.Popen[bytes]:
    (tmp_path / "outboxer.toml").write_text(config)
    with (tmp_path / "relay.log").open("ab") as out:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "outboxer.cli",
                "relay",
                "--config",
                str(tmp_path / "outboxer.toml"),
                "--relay-id",
                "audit20-dnshung",
                *flags,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=resolver.env(),
            cwd=tmp_path,
        )


def stop_relay(relay: subprocess.Popen[bytes], resolver: HungResolver) -> None:
    resolver.release.touch()  # else the interpreter's exit waits for the hung lookups
    relay.terminate()
    try:
        relay.wait(15)
    except subprocess.TimeoutExpired:
        relay.kill()
        relay.wait()


def wait_for_lookups(resolver: HungResolver, relay: subprocess.Popen[bytes], count: int) -> None:
    deadline = time.monotonic() + 8
    while resolver.lookups() < count:
        assert relay.poll() is None, "the relay exited"
        assert time.monotonic() < deadline, f"{resolver.lookups()} lookup(s) of {HUNG_NAME}"
        time.sleep(0.02)


def hung_brokers() -> str:
    """Destinations of MQTT brokers named HUNG_NAME, one for each executor thread."""
    return "".join(
        f'[destinations.hung{n}]\nbroker = "mqtt://{HUNG_NAME}:1883/"\n'
        for n in range(HUNG_BROKERS)
    )


def health(port: int) -> tuple[float, dict[str, object]]:
    began = time.monotonic()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as answer:
            body = answer.read()
    except urllib.error.HTTPError as error:
        body = error.read()
    return time.monotonic() - began, json.loads(body)


def test_a_healthy_destination_publishes_while_other_brokers_names_hang(
    sqlite_url: str, tmp_path: Path, resolver: HungResolver, redis: None
) -> None:
    resolver.armed.touch()  # hung from the start
    port = free_port()
    prefix = f"audit20-dnshung-{uuid.uuid4().hex[:8]}:"
    relay = start_relay(
        tmp_path,
        resolver,
        f"""
db = "{sqlite_url}"
{hung_brokers()}
[destinations.ok]
broker = "redis://127.0.0.1:6379/0?stream_prefix={prefix}"
""",
        "--http",
        f"127.0.0.1:{port}",
    )
    try:
        wait_for_lookups(resolver, relay, 1)
        time.sleep(0.3)  # the other brokers' first connects too (before: a thread each)
        began = time.monotonic()
        enqueue(sqlite_url, "ok", 20)
        while rows(sqlite_url, "ok", "PUBLISHED") < 20:
            took = time.monotonic() - began
            assert took < 3, (
                f"{rows(sqlite_url, 'ok', 'PUBLISHED')} of 20 messages of the healthy destination "
                f"published in {took:.1f} s, {resolver.lookups()} lookup(s) of the hung name "
                "under way"
            )
            time.sleep(0.02)
        took, answer = health(port)
        assert answer["database"] == "ok", answer
        assert took < 2, f"/health answered in {took:.1f} s"
    finally:
        stop_relay(relay, resolver)


def test_a_batch_renews_its_lease_while_other_brokers_names_hang(
    sqlite_url: str, tmp_path: Path, resolver: HungResolver
) -> None:
    """A batch in flight (its receiver accepts the requests and never answers) when the
    other brokers' names begin to hang, for longer than the lease: its renewals must get
    through meanwhile, or the relay gives the batch up (and another relay would take its
    rows for abandoned)."""
    enqueue(sqlite_url, "slow", 10)
    with silent_listener() as receiver:
        relay = start_relay(
            tmp_path,
            resolver,
            f"""
db = "{sqlite_url}"
{hung_brokers()}
[destinations.slow]
broker = "http://{receiver}/hook"
""",
            "--lock-timeout",  # renewed every 2/3 s
            "2",
            "--shutdown-timeout",  # the unanswered batch is given back at the stop
            "1",
        )
        try:
            deadline = time.monotonic() + 8
            while rows(sqlite_url, "slow", "PROCESSING") < 10:
                assert relay.poll() is None, "the relay exited"
                assert time.monotonic() < deadline, "the batch was never claimed"
                time.sleep(0.02)
            resolver.armed.touch()  # the outage begins: the brokers' retries hang now
            wait_for_lookups(resolver, relay, 1)
            time.sleep(4)  # two leases, the requests unanswered
            assert relay.poll() is None, "the relay exited"
        finally:
            stop_relay(relay, resolver)
    log = (tmp_path / "relay.log").read_text()
    stopped = ast.literal_eval(log.split(" stopped: ", 1)[1].splitlines()[0])
    assert stopped["leases_lost"] == 0, [line for line in log.splitlines() if "lease" in line]
    assert stopped["renewals"] >= 4, stopped


async def test_the_stores_statements_never_wait_for_the_default_executor(sqlite_url: str) -> None:
    """The same in one process: every thread of the loop's default executor blocked (as the
    hung lookups or connects held them), the store opens, claims, renews, settles, and
    closes, waiting as before for a statement a cancelled caller left running (closing the
    connection under it would crash sqlite3), and opens again after."""
    enqueue(sqlite_url, "default", 3)
    loop = asyncio.get_running_loop()
    release = threading.Event()
    # More calls than any default executor has threads (32): the rest wait in its queue.
    blocked = [loop.run_in_executor(None, release.wait, 20) for _ in range(40)]
    store = create_store(sqlite_url)
    try:
        async with asyncio.timeout(3) as within:
            await store.connect()
            claim = await store.claim("default", "r1", 10, 30, False)
            seqs = [message.stored_seq for message in claim]
            assert len(seqs) == 3
            assert await store.renew("default", claim.lease, seqs, 30) == 3
            result = await store.settle("default", claim.lease, seqs, [], [], 5)
            assert result.published == 3

            started, finish = threading.Event(), threading.Event()
            ran_on: list[threading.Thread] = []

            def slow(conn: sqlite3.Connection) -> int:
                ran_on.append(threading.current_thread())
                started.set()
                finish.wait(5)
                return int(conn.execute("SELECT count(*) FROM outbox").fetchone()[0])

            abandoned = asyncio.ensure_future(store._run(slow))  # type: ignore[attr-defined]
            while not started.is_set():
                await asyncio.sleep(0.01)
            abandoned.cancel()
            closing = asyncio.ensure_future(store.close())
            await asyncio.sleep(0.2)
            assert not closing.done(), "closed under a statement still running"
            finish.set()
            await closing
            assert await store.applied_migrations(), "not opened again after close"
    except TimeoutError:
        if within.expired():
            pytest.fail("the store's statements waited for the default executor's threads")
        raise
    finally:
        release.set()
        await asyncio.gather(*blocked)
        await store.close()
    [thread] = ran_on
    assert thread.name.startswith("outboxer-sqlite"), thread.name
    thread.join(2)  # close retired it: it ends once its queue is empty
    assert not thread.is_alive(), "the store's thread outlived its close"
