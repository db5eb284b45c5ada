"""What every chaos scenario shares: the workload, the relays, the consumers and the verdict.

A scenario writes messages (some in transactions that roll back), runs real ``outboxer
relay`` processes against real servers, injects its faults, waits until everything
committed arrived, stops the relays with SIGTERM, then checks on the consumer's side:
nothing lost, nothing rolled back delivered, each key's first deliveries in order,
duplicates only of messages in flight at a fault, no row left PROCESSING, no secret in
any log line. Its figures go to stdout (one ``chaos:`` line) and, as JSON, to the file
named by ``OUTBOXER_CHAOS_REPORT``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import http.server
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

import outboxer
from tests.chaos.servers import free_port

OUTBOXER = [sys.executable, "-m", "outboxer.cli"]
TOPIC = "chaos.event"


def wait_until(
    condition: Callable[[], bool],
    timeout: float,
    what: str,
    explain: Callable[[], object] | None = None,
) -> float:
    """Poll ``condition`` until true; return the seconds it took, else fail saying ``what``
    (and what ``explain()`` returns then)."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout:
            detail = f"; {explain()}" if explain is not None else ""
            raise AssertionError(f"{what}: not within {timeout:.0f}s{detail}")
        time.sleep(0.05)
    return time.monotonic() - started


def sleep_until(moment: float) -> None:
    """Sleep until ``time.monotonic()`` reaches ``moment`` (at once if it has)."""
    time.sleep(max(0.0, moment - time.monotonic()))


def first_deliveries(deliveries: Iterable[Delivery]) -> dict[str, float]:
    """When each message arrived first."""
    first: dict[str, float] = {}
    for delivery in deliveries:
        first.setdefault(delivery.message_id, delivery.at)
    return first


# ----- the workload --------------------------------------------------------------------------


@dataclass
class Workload:
    """Every message a scenario wrote: committed ones with their place in their key's order,
    and the ids of those whose transaction rolled back."""

    committed: dict[str, tuple[str, int]] = field(default_factory=dict)
    rolled_back: set[str] = field(default_factory=set)
    _next: Counter[str] = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def write(
        self, conn: psycopg.Connection[Any], keys: Sequence[str], *, roll_back: bool = False
    ) -> list[str]:
        """One transaction of one message per entry of ``keys``; committed or rolled back."""
        if roll_back:
            items = [
                {"topic": TOPIC, "payload": {"key": k, "rolled_back": True}, "key": k} for k in keys
            ]
            messages = outboxer.enqueue_many(conn, items)
            conn.rollback()
            with self._lock:
                self.rolled_back.update(str(m.id) for m in messages)
            return []
        with self._lock:  # numbers are handed out in commit order: one writer per workload
            numbers = []
            for key in keys:
                numbers.append(self._next[key])
                self._next[key] += 1
        items = [
            {"topic": TOPIC, "payload": {"key": k, "n": n}, "key": k}
            for k, n in zip(keys, numbers, strict=True)
        ]
        messages = outboxer.enqueue_many(conn, items)
        conn.commit()
        ids = [str(m.id) for m in messages]
        with self._lock:
            for message_id, key, n in zip(ids, keys, numbers, strict=True):
                self.committed[message_id] = (key, n)
        return ids

    def write_poison(self, db_url: str, key: str, kind: str) -> str:
        """Commit one message of ``key`` whose payload names it a poison of ``kind`` (the
        receiver under test treats it so); returns its id."""
        with psycopg.connect(db_url) as conn, self._lock:
            n = self._next[key]
            [message] = outboxer.enqueue_many(
                conn,
                [{"topic": TOPIC, "payload": {"key": key, "n": n, "poison": kind}, "key": key}],
            )
            conn.commit()
            self._next[key] += 1
            self.committed[str(message.id)] = (key, n)
        return str(message.id)

    def write_backlog(
        self,
        db_url: str,
        keys: Sequence[str],
        count: int,
        *,
        transaction_size: int = 50,
        rollback_every: int = 10,
        seed: int = 1,
    ) -> None:
        """``count`` committed messages on random ``keys``; every ``rollback_every``-th
        transaction (one more, of the same size) rolls back."""
        chooser = random.Random(seed)
        with psycopg.connect(db_url) as conn:
            written = 0
            transactions = 0
            while written < count:
                size = min(transaction_size, count - written)
                batch = [chooser.choice(keys) for _ in range(size)]
                transactions += 1
                if transactions % rollback_every == 0:
                    self.write(conn, batch, roll_back=True)
                    continue
                self.write(conn, batch)
                written += size

    @property
    def messages(self) -> int:
        return len(self.committed)


class SteadyWriter(threading.Thread):
    """Writes ``total`` messages at about ``rate`` a second, as an application would while the
    relays run; every ``rollback_every``-th transaction rolls back.

    ``pause()`` returns once the writer is between transactions with its connection closed
    (a test is about to stop the database: a COMMIT cut short would leave its outcome
    unknown); ``resume()`` reconnects and goes on at the same rate.
    """

    def __init__(
        self,
        workload: Workload,
        db_url: str,
        keys: Sequence[str],
        total: int,
        rate: float,
        *,
        transaction_size: int = 20,
        rollback_every: int = 10,
        seed: int = 2,
    ) -> None:
        super().__init__(daemon=True, name="chaos-writer")
        self.workload, self.db_url, self.keys = workload, db_url, list(keys)
        self.total, self.rate = total, rate
        self.transaction_size, self.rollback_every = transaction_size, rollback_every
        self.chooser = random.Random(seed)
        self.error: BaseException | None = None
        self.written = 0
        self._running = threading.Event()
        self._running.set()
        self._idle = threading.Event()

    def run(self) -> None:
        try:
            self._write()
        except BaseException as exc:  # reported by finish(): a writer error fails the test
            self.error = exc
        finally:
            self._idle.set()

    def _write(self) -> None:
        schedule_origin = time.monotonic()
        transactions = 0
        while self.written < self.total:
            if not self._running.is_set():
                paused_at = time.monotonic()
                self._idle.set()
                self._running.wait()
                self._idle.clear()
                schedule_origin += time.monotonic() - paused_at
            with psycopg.connect(self.db_url) as conn:
                while self.written < self.total and self._running.is_set():
                    size = min(self.transaction_size, self.total - self.written)
                    batch = [self.chooser.choice(self.keys) for _ in range(size)]
                    transactions += 1
                    if transactions % self.rollback_every == 0:
                        self.workload.write(conn, batch, roll_back=True)
                        continue
                    self.workload.write(conn, batch)
                    self.written += size
                    ahead = schedule_origin + self.written / self.rate - time.monotonic()
                    if ahead > 0:
                        time.sleep(ahead)

    def pause(self) -> None:
        self._running.clear()
        assert self._idle.wait(30), "the writer did not pause"

    def resume(self) -> None:
        self._running.set()

    def finish(self, timeout: float) -> None:
        self.join(timeout)
        assert not self.is_alive(), f"the writer did not finish within {timeout}s"
        if self.error is not None:
            raise AssertionError(f"the writer failed: {self.error!r}") from self.error


# ----- the outbox, seen from the test --------------------------------------------------------


def statuses(db_url: str) -> dict[str, int]:
    with psycopg.connect(db_url) as conn:
        rows = conn.execute("SELECT status, count(*) FROM outboxer.outbox GROUP BY status")
        return {str(status): int(count) for status, count in rows}


def wait_for_progress(db_url: str, timeout: float = 60) -> float:
    """Seconds until the outbox holds more PUBLISHED rows than now (the relays recovered)."""
    before = statuses(db_url).get("PUBLISHED", 0)
    return wait_until(
        lambda: statuses(db_url).get("PUBLISHED", 0) > before,
        timeout,
        "the relays publishing again",
    )


def ids_where(db_url: str, condition: str, *params: object) -> set[str]:
    with psycopg.connect(db_url) as conn:
        rows = conn.execute(f"SELECT id FROM outboxer.outbox WHERE {condition}", params)
        return {str(row[0]) for row in rows}


def rows(db_url: str, ids: Sequence[str]) -> list[tuple[object, ...]]:
    """(id, status, attempts, locked_by, last_error) of these messages, for failure reports."""
    with psycopg.connect(db_url) as conn:
        return conn.execute(
            "SELECT id::text, status, attempts, locked_by, left(last_error, 200) "
            "FROM outboxer.outbox WHERE id::text = ANY(%s) ORDER BY seq",
            (list(ids),),
        ).fetchall()


def retried(db_url: str) -> set[str]:
    """Messages the relays attempted more than once: a failed publish, or a lock taken over."""
    return ids_where(db_url, "attempts > 0")


# ----- the relays ----------------------------------------------------------------------------


#: Relay settings of the scenarios unless they say otherwise: small batches, a short lease
#: and quick retries, so that each fault shows (and is recovered from) within seconds.
RELAY_DEFAULTS: dict[str, object] = {
    "batch_size": 100,
    "concurrency": 2,
    "lock_timeout": 2,
    "poll_interval": 0.2,
    "backoff_base": 0.2,
    "backoff_max": 2,
}


def relay_args(**settings: object) -> list[str]:
    """``outboxer relay`` flags: RELAY_DEFAULTS, with ``settings`` changing or adding some."""
    return [
        f"--{name.replace('_', '-')}={value}"
        for name, value in {**RELAY_DEFAULTS, **settings}.items()
    ]


#: Query parameters named like these carry secrets (as outboxer's own redaction assumes).
SECRET_WORDS = ("password", "secret", "token", "key")


@dataclass(frozen=True)
class Secrets:
    """What must never reach a log line, with the forms a URL may carry it in."""

    values: tuple[str, ...]

    @classmethod
    def of(cls, *urls: str, plain: Iterable[str] = ()) -> Secrets:
        """The passwords in ``urls``, their secret-named query values, and ``plain`` ones."""
        found = list(plain)
        for url in urls:
            parts = urllib.parse.urlsplit(url)
            if parts.password:
                found.append(urllib.parse.unquote(parts.password))
            found.extend(
                value
                for name, value in urllib.parse.parse_qsl(parts.query)
                if any(word in name.lower() for word in SECRET_WORDS)
            )
        return cls(tuple(value for value in found if value))

    def found_in(self, line: str) -> list[str]:
        forms = {form for value in self.values for form in (value, urllib.parse.quote(value))}
        return sorted(form for form in forms if form in line)


@dataclass
class RelayProcess:
    relay_id: str
    process: subprocess.Popen[bytes]
    log: Path
    http_port: int


@dataclass(frozen=True)
class Kill:
    """A relay SIGKILLed at ``at``; ``in_flight`` are the rows it held then (PROCESSING)."""

    relay_id: str
    at: float
    in_flight: frozenset[str]


class RelayFleet:
    """Real ``outboxer relay`` processes on one outbox: spawned, killed, stopped, their logs."""

    def __init__(
        self,
        db_url: str,
        broker_url: str,
        workdir: Path,
        *,
        args: Sequence[str] = (),
        http_token: str,
    ) -> None:
        self.db_url, self.broker_url, self.workdir = db_url, broker_url, workdir
        self.args, self.http_token = list(args), http_token
        self.relays: list[RelayProcess] = []
        self.kills: list[Kill] = []

    @property
    def secrets(self) -> Secrets:
        """What the relays were given that must not show in their logs."""
        return Secrets.of(self.db_url, self.broker_url, plain=[self.http_token])

    def spawn(self) -> RelayProcess:
        relay_id = f"chaos-relay-{len(self.relays) + 1}"
        log = self.workdir / f"{relay_id}.log"
        http_port = free_port()
        # Only what this test sets: no OUTBOXER_* of the caller's, no outboxer.toml (cwd).
        env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOXER_")}
        env["OUTBOXER_HTTP_TOKEN"] = self.http_token
        with log.open("ab") as out:  # the relay keeps its own descriptor
            process = subprocess.Popen(
                [
                    *OUTBOXER,
                    "relay",
                    "--db",
                    self.db_url,
                    "--broker",
                    self.broker_url,
                    "--relay-id",
                    relay_id,
                    "--http",
                    f"127.0.0.1:{http_port}",
                    *self.args,
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.workdir,
            )
        relay = RelayProcess(relay_id, process, log, http_port)
        self.relays.append(relay)
        return relay

    def start(self, count: int) -> None:
        """Spawn ``count`` relays and use the first one's HTTP API with its token."""
        for _ in range(count):
            self.spawn()
        self.check_http_api(self.relays[0])

    @property
    def alive(self) -> list[RelayProcess]:
        return [r for r in self.relays if r.process.poll() is None]

    def by_pid(self, pid: int) -> RelayProcess | None:
        return next((r for r in self.relays if r.process.pid == pid), None)

    def kill(self, relay: RelayProcess) -> Kill:
        """SIGKILL ``relay``; what it held PROCESSING then may be published again."""
        at = time.monotonic()
        relay.process.send_signal(signal.SIGKILL)
        relay.process.wait(10)
        held = ids_where(self.db_url, "status = 'PROCESSING' AND locked_by = %s", relay.relay_id)
        kill = Kill(relay.relay_id, at, frozenset(held))
        self.kills.append(kill)
        return kill

    @property
    def in_flight_at_kills(self) -> set[str]:
        return {message_id for kill in self.kills for message_id in kill.in_flight}

    def stop(self, timeout: float = 60) -> None:
        """SIGTERM every live relay: each finishes its batches and exits 0."""
        stopping = self.alive
        for relay in stopping:
            relay.process.send_signal(signal.SIGTERM)
        codes = {relay.relay_id: relay.process.wait(timeout) for relay in stopping}
        assert all(code == 0 for code in codes.values()), (
            f"SIGTERM ends a relay with exit 0: {codes}\n{self.tail()}"
        )

    def terminate_all(self) -> None:
        """End whatever still runs (teardown after a failed test)."""
        for relay in self.alive:
            relay.process.kill()
            relay.process.wait(10)

    def lines(self) -> list[str]:
        return [
            line
            for relay in self.relays
            if relay.log.exists()
            for line in relay.log.read_text(errors="replace").splitlines()
        ]

    def log_count(self, text: str) -> int:
        """How many log lines contain ``text``."""
        return sum(1 for line in self.lines() if text in line)

    def tail(self, count: int = 40) -> str:
        return "\n".join(self.lines()[-count:])

    def check_http_api(self, relay: RelayProcess) -> None:
        """Use the relay's API with its token (so the token travels through the relay)."""
        base = f"http://127.0.0.1:{relay.http_port}"
        wait_until(lambda: _answers(f"{base}/health"), 30, f"{relay.relay_id}'s HTTP API")
        request = urllib.request.Request(
            f"{base}/messages/requeue",
            data=json.dumps({"ids": [str(uuid.uuid4())]}).encode(),
            headers={
                "Authorization": f"Bearer {self.http_token}",
                "Content-Type": "application/json",
            },
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            assert json.loads(response.read()) == {"requeued": 0}
        refused = urllib.request.Request(
            f"{base}/messages/requeue",
            data=b"{}",
            headers={"Authorization": "Bearer wrong", "Content-Type": "application/json"},
        )
        try:
            urllib.request.urlopen(refused, timeout=10).close()
        except urllib.error.HTTPError as refusal:
            assert refusal.code == 401, f"a wrong token is refused with 401, not {refusal.code}"
        else:
            raise AssertionError("a POST with the wrong token was accepted")


def _answers(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=2).close()
    except urllib.error.HTTPError:
        return True  # 503 while starting is an answer
    except OSError:
        return False
    return True


# ----- consumers -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Delivery:
    message_id: str
    key: str | None
    n: int | None
    at: float
    #: The broker delivered this copy before, to a consumer whose ack it never got (the
    #: connection ended): the broker's duplicate, not a second publish by a relay.
    redelivered: bool = False


def _delivery(message_id: str, body: bytes, redelivered: bool = False) -> Delivery:
    try:
        payload = json.loads(body)
    except ValueError:
        payload = {}
    if not isinstance(payload, dict):
        payload = {}
    n = payload.get("n")
    return Delivery(
        message_id,
        payload.get("key"),
        n if isinstance(n, int) else None,
        time.monotonic(),
        redelivered,
    )


class Sink:
    """What a consumer received, in arrival order, from any thread."""

    def __init__(self) -> None:
        self._deliveries: list[Delivery] = []
        self._ids: set[str] = set()
        self._lock = threading.Lock()

    def record(self, delivery: Delivery) -> None:
        with self._lock:
            self._deliveries.append(delivery)
            self._ids.add(delivery.message_id)

    @property
    def deliveries(self) -> list[Delivery]:
        with self._lock:
            return list(self._deliveries)

    def received(self, ids: Iterable[str]) -> bool:
        with self._lock:
            return self._ids.issuperset(ids)

    def count(self) -> int:
        with self._lock:
            return len(self._ids)


class RabbitSink(Sink):
    """A consumer of a durable queue bound to ``exchange``; it reconnects when the broker
    goes away, so it survives a broker restart. Acks after recording each delivery."""

    def __init__(self, amqp_url: str, exchange: str) -> None:
        super().__init__()
        self.amqp_url, self.exchange = amqp_url, exchange
        self.queue = f"{exchange}-queue"
        self.connects = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._stopping = threading.Event()
        self._ready = threading.Event()
        self._task: concurrent.futures.Future[None] | None = None

    def start(self, timeout: float = 30) -> RabbitSink:
        self._thread.start()
        self._task = asyncio.run_coroutine_threadsafe(self._consume(), self._loop)
        if not self._ready.wait(timeout):
            raise RuntimeError(f"could not consume from {self.exchange} within {timeout}s")
        return self

    async def _consume(self) -> None:
        import aio_pika

        from outboxer.brokers.rabbitmq import connect_amqp

        while not self._stopping.is_set():
            try:
                connection = await connect_amqp(self.amqp_url, 5)
            except (TimeoutError, OSError, aio_pika.exceptions.AMQPError):
                await asyncio.sleep(0.2)  # the broker is down: it comes back
                continue
            self.connects += 1
            lost = asyncio.Event()  # aio-pika's closed() resolves on our own close() only
            connection.close_callbacks.add(_setter(lost))
            try:
                channel = await connection.channel()
                await channel.set_qos(prefetch_count=1000)
                exchange = await channel.declare_exchange(
                    self.exchange, aio_pika.ExchangeType.TOPIC, durable=True
                )
                queue = await channel.declare_queue(self.queue, durable=True)
                await queue.bind(exchange, "#")

                async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
                    self.record(
                        _delivery(str(message.message_id), message.body, bool(message.redelivered))
                    )
                    await message.ack()

                await queue.consume(on_message)
                self._ready.set()
                await lost.wait()
            except (TimeoutError, OSError, aio_pika.exceptions.AMQPError):
                await asyncio.sleep(0.2)
            finally:
                with contextlib.suppress(Exception):
                    await connection.close()

    def stop(self) -> None:
        self._stopping.set()

        async def close() -> None:
            from outboxer.brokers.rabbitmq import connect_amqp

            if self._task is not None:
                self._task.cancel()
            with contextlib.suppress(Exception):
                connection = await connect_amqp(self.amqp_url, 5)
                channel = await connection.channel()
                await channel.queue_delete(self.queue)
                await channel.exchange_delete(self.exchange)
                await connection.close()

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(30)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)


def _setter(event: asyncio.Event) -> Callable[..., None]:
    return lambda *_: event.set()


#: What a webhook receiver answers: (status, body), or None to drop the connection unanswered.
Answer = tuple[int, bytes] | None


@dataclass(frozen=True)
class WebhookRequest:
    message_id: str
    body: bytes
    #: The sender's port: ``pid_of_peer`` tells which relay process sent the request.
    peer_port: int


class WebhookSink(Sink):
    """A real HTTP receiver for the webhook broker. ``respond`` decides each answer; a
    request answered 2xx counts as delivered."""

    def __init__(self, respond: Callable[[WebhookRequest], Answer]) -> None:
        super().__init__()
        self.respond = respond
        sink = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                request = WebhookRequest(
                    self.headers.get("Outboxer-Id", ""), body, self.client_address[1]
                )
                answer = sink.respond(request)
                if answer is None:
                    self.close_connection = True
                    return
                status, text = answer
                if 200 <= status < 300:
                    sink.record(_delivery(request.message_id, body))
                self.send_response(status)
                self.send_header("Content-Length", str(len(text)))
                self.send_header("Content-Type", "text/plain")
                self.end_headers()
                self.wfile.write(text)

            def log_message(self, format: str, *args: Any) -> None:
                return  # the test reports what matters; the relays' logs are under test

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = int(self.server.server_address[1])
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self) -> WebhookSink:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def pid_of_peer(peer_port: int, candidates: Iterable[int]) -> int | None:
    """Which of ``candidates`` owns the local TCP socket on 127.0.0.1:``peer_port``.

    Every live socket on that address counts, not the first line that names it: a closed
    connection that used the same ephemeral port lingers in TIME_WAIT (inode 0) while the
    kernel hands the port to a new connection to another address. Under a busy suite the
    first line was such a ghost, the sender went unfound, and the test's "kill the relay
    that delivers this" did not happen.
    """
    wanted = f"0100007F:{peer_port:04X}"
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1] == wanted and fields[9] != "0":
            inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return None
    for pid in candidates:
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd) in inodes:
                        return pid
    return None


# ----- the verdict ---------------------------------------------------------------------------


@dataclass
class Verdict:
    messages: int
    rolled_back: int
    deliveries: int
    duplicates: int
    broker_redeliveries: int
    log_lines: int = 0


def order_violations(workload: Workload, deliveries: Iterable[Delivery]) -> list[str]:
    """Each first delivery that came after a later message of its key ("key: n after m")."""
    last: dict[str, int] = {}
    seen: set[str] = set()
    overtaken: list[str] = []
    for delivery in deliveries:
        if delivery.message_id in seen or delivery.message_id not in workload.committed:
            continue
        seen.add(delivery.message_id)
        key, n = workload.committed[delivery.message_id]
        if n <= last.get(key, -1):
            overtaken.append(f"{key}: {n} after {last[key]}")
        last[key] = max(n, last.get(key, -1))
    return overtaken


def going_back(workload: Workload, deliveries: Iterable[Delivery]) -> list[str]:
    """Each delivery of a message after a later message of its key had been delivered ("key:
    n after m"), copies included, the broker's own redeliveries left out. A relay that fails
    a publish holds its key back until the retry, so only two holders publishing a key's
    messages at the same time, or a holder that died, can make a key go back."""
    last: dict[str, int] = {}
    back: list[str] = []
    for delivery in deliveries:
        if delivery.redelivered or delivery.message_id not in workload.committed:
            continue
        key, n = workload.committed[delivery.message_id]
        if n < last.get(key, -1):
            back.append(f"{key}: {n} after {last[key]}")
        last[key] = max(n, last.get(key, -1))
    return back


def check_deliveries(
    workload: Workload,
    deliveries: Sequence[Delivery],
    *,
    in_flight_at_faults: set[str],
    never_delivered: Iterable[str] = (),
    describe: Callable[[list[str]], object] | None = None,
) -> Verdict:
    """The consumer-side promises (``describe`` shows messages named in a failure); ``never_delivered`` are committed messages expected to be
    refused for good (poison), so neither lost nor ordered."""
    delivered = Counter(d.message_id for d in deliveries)
    # A copy the broker delivered again (its consumer's ack was lost with the connection) is
    # the broker's duplicate; two copies the broker delivered fresh are two publishes.
    fresh = Counter(d.message_id for d in deliveries if not d.redelivered)
    redelivered = sum(1 for d in deliveries if d.redelivered)
    expected = set(workload.committed) - set(never_delivered)
    lost = expected - set(delivered)
    assert not lost, f"{len(lost)} committed message(s) never delivered, e.g. {sorted(lost)[:5]}"
    ghosts = workload.rolled_back & {d.message_id for d in deliveries}
    assert not ghosts, f"{len(ghosts)} rolled-back message(s) delivered, e.g. {sorted(ghosts)[:5]}"
    sneaked = set(never_delivered) & set(delivered)
    assert not sneaked, f"message(s) the broker refuses were delivered: {sorted(sneaked)}"
    strangers = set(delivered) - set(workload.committed)
    assert not strangers, f"deliveries of messages nobody wrote: {sorted(strangers)[:5]}"
    garbled = [d for d in deliveries if (d.key, d.n) != workload.committed[d.message_id]]
    assert not garbled, f"deliveries whose payload is not the one committed: {garbled[:3]}"

    overtaken = order_violations(workload, deliveries)
    assert not overtaken, (
        f"per-key order of first deliveries broken {len(overtaken)} time(s): {overtaken[:8]}"
    )

    duplicated = {message_id for message_id, times in fresh.items() if times > 1}
    unexplained = duplicated - in_flight_at_faults
    assert not unexplained, (
        f"{len(unexplained)} message(s) delivered twice that no fault had in flight, e.g. "
        f"{describe(sorted(unexplained)[:5]) if describe is not None else sorted(unexplained)[:5]}"
    )
    return Verdict(
        messages=workload.messages,
        rolled_back=len(workload.rolled_back),
        deliveries=len(deliveries),
        duplicates=sum(times - 1 for times in fresh.values()),
        broker_redeliveries=redelivered,
    )


def check_outbox_settled(db_url: str, expected: dict[str, int]) -> None:
    """After the relays stopped: every row in its final state, none PROCESSING."""
    counts = statuses(db_url)
    assert "PROCESSING" not in counts, f"rows left PROCESSING after the relays stopped: {counts}"
    assert counts == expected, f"outbox statuses {counts}, expected {expected}"


def check_no_secrets(fleet: RelayFleet) -> int:
    """Every line every relay logged; returns how many were read."""
    lines = fleet.lines()
    leaks = [(found, line[:300]) for line in lines if (found := fleet.secrets.found_in(line))]
    assert not leaks, f"{len(leaks)} log line(s) hold a secret, e.g. {leaks[:3]}"
    return len(lines)


def wait_for_drain(
    sink: Sink,
    workload: Workload,
    db_url: str,
    timeout: float = 90,
    *,
    final: dict[str, int] | None = None,
    also: Callable[[], str] | None = None,
) -> None:
    """Wait until the consumer has every committed message and every row is in its final
    status (``final``, default all PUBLISHED): a message the broker took but whose confirm
    was lost is delivered, yet its row waits FAILED for its retry. Say where things stand
    if that does not come."""
    expected = final or {"PUBLISHED": workload.messages}

    def explain() -> str:
        more = f"; {also()}" if also is not None else ""
        return (
            f"outbox {statuses(db_url)}; consumer has {sink.count()} of {workload.messages}{more}"
        )

    wait_until(
        lambda: sink.received(workload.committed) and statuses(db_url) == expected,
        timeout,
        "every committed message delivered and settled",
        explain,
    )


def finish(
    fleet: RelayFleet,
    workload: Workload,
    sink: Sink,
    *,
    in_flight_at_faults: set[str],
    final: dict[str, int] | None = None,
    never_delivered: Iterable[str] = (),
) -> Verdict:
    """Stop the relays (SIGTERM, exit 0), then check every promise: the consumer's side, the
    outbox's final statuses (default: everything PUBLISHED) and the relays' logs."""
    fleet.stop()
    verdict = check_deliveries(
        workload,
        sink.deliveries,
        in_flight_at_faults=in_flight_at_faults,
        never_delivered=never_delivered,
        describe=lambda ids: rows(fleet.db_url, ids),
    )
    check_outbox_settled(fleet.db_url, final or {"PUBLISHED": workload.messages})
    verdict.log_lines = check_no_secrets(fleet)
    return verdict


def report(scenario: str, **figures: float | int | str) -> None:
    """One ``chaos:`` line on stdout; the same figures as a JSON line in OUTBOXER_CHAOS_REPORT."""
    shown = " ".join(
        f"{name}={value:.2f}" if isinstance(value, float) else f"{name}={value}"
        for name, value in figures.items()
    )
    print(f"chaos: {scenario} {shown}")
    path = os.environ.get("OUTBOXER_CHAOS_REPORT")
    if path:
        with open(path, "a", encoding="utf-8") as out:
            out.write(json.dumps({"scenario": scenario, **figures}) + "\n")
