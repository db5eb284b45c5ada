"""Shared plumbing of the bench: figures, fresh databases, the backlog, relay processes.

Everything here talks to the local services only and cleans up what it created:
databases are named ``outboxer_bench_<run>_*`` and dropped at the end of the run.
"""

from __future__ import annotations

import json
import math
import os
import random
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

import outboxer
from outboxer.message import Message
from outboxer.stores.postgres import PostgresStore

ADMIN_URL = os.environ.get("OUTBOXER_BENCH_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
AMQP_URL = os.environ.get("OUTBOXER_BENCH_AMQP", "amqp://guest:guest@127.0.0.1:5672/")
REDIS_URL = os.environ.get("OUTBOXER_BENCH_REDIS", "redis://127.0.0.1:6379/0")
DESTINATION = "default"
TOPICS = ("order.placed", "order.paid", "order.shipped", "customer.updated")
PAYLOAD_BYTES = 300


def log(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


# ----- figures ------------------------------------------------------------------------------


def percentile(values: Sequence[float], pct: float) -> float:
    """Nearest-rank percentile (p99 of 100 values is the 99th smallest)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(pct / 100.0 * len(ordered)))
    return ordered[rank - 1]


@dataclass
class Figure:
    """One reported figure: every run's value; the table shows the median with min and max."""

    name: str
    unit: str
    runs: list[float] = field(default_factory=list)
    note: str = ""

    @property
    def median(self) -> float:
        return statistics.median(self.runs) if self.runs else math.nan

    @property
    def low(self) -> float:
        return min(self.runs) if self.runs else math.nan

    @property
    def high(self) -> float:
        return max(self.runs) if self.runs else math.nan

    def as_dict(self) -> dict[str, Any]:
        return {
            "unit": self.unit,
            "median": self.median,
            "min": self.low,
            "max": self.high,
            "runs": list(self.runs),
            "note": self.note,
        }


@dataclass(frozen=True)
class Target:
    """A goal from bench/README.md, checked against a figure's median."""

    figure: str
    op: str  # ">=" or "<="
    bound: float
    text: str

    def passed(self, value: float) -> bool:
        if math.isnan(value):
            return False
        return value >= self.bound if self.op == ">=" else value <= self.bound


class Report:
    def __init__(self) -> None:
        self.figures: dict[str, Figure] = {}
        self.meta: dict[str, Any] = {}

    def figure(self, name: str, unit: str, note: str = "") -> Figure:
        if name not in self.figures:
            self.figures[name] = Figure(name, unit, note=note)
        return self.figures[name]

    def add(self, name: str, unit: str, value: float, note: str = "") -> None:
        self.figure(name, unit, note).runs.append(float(value))


# ----- the backlog --------------------------------------------------------------------------


def _pad() -> int:
    sample = {
        "order_id": 10_000_000,
        "customer": "customer-00000",
        "total": "12345.67",
        "currency": "EUR",
        "lines": [{"sku": "SKU-000000", "qty": 9}] * 3,
        "note": "",
    }
    return PAYLOAD_BYTES - len(json.dumps(sample, separators=(",", ":")))


_PAD = "x" * max(_pad(), 0)


def backlog_items(
    count: int, keys: int, *, seed: int = 7, start: int = 0, keyless_share: float = 0.05
) -> Iterator[dict[str, Any]]:
    """``enqueue`` arguments of ``count`` messages of ~300 bytes over ``keys`` keys, a few keyless.

    Keys are drawn at random (seeded), so a batch of 200 usually has a key or two twice:
    the relay then needs a second wave, as it would with real traffic.
    """
    rnd = random.Random(seed + start)
    for n in range(start, start + count):
        key = None if rnd.random() < keyless_share else f"customer-{rnd.randrange(keys):05d}"
        payload = {
            "order_id": 10_000_000 + n,
            "customer": key or "anonymous",
            "total": f"{rnd.randrange(100, 1_000_000) / 100:.2f}",
            "currency": "EUR",
            "lines": [{"sku": f"SKU-{rnd.randrange(1_000_000):06d}", "qty": 1 + n % 9}] * 3,
            "note": _PAD,
        }
        yield {
            "topic": TOPICS[n % len(TOPICS)],
            "payload": payload,
            "key": key,
            "headers": {
                "traceparent": f"00-{rnd.getrandbits(128):032x}-{rnd.getrandbits(64):016x}-01"
            },
        }


def prefill(url: str, count: int, keys: int, chunk: int = 1000) -> float:
    """Insert ``count`` real outbox rows through ``enqueue_many`` (the insert_many SQL); seconds."""
    with psycopg.connect(url) as conn:
        return write_backlog(conn, count, keys, chunk)


def write_backlog(conn: Any, count: int, keys: int, chunk: int = 1000) -> float:
    """``prefill`` on any connection ``enqueue_many`` takes (PostgreSQL, MySQL, SQLite)."""
    started = time.perf_counter()
    items = backlog_items(count, keys)
    while True:
        part = [item for _, item in zip(range(chunk), items, strict=False)]
        if not part:
            break
        outboxer.enqueue_many(conn, part)
        conn.commit()
    return time.perf_counter() - started


def load_messages(url: str, limit: int) -> list[Message]:
    """The first ``limit`` rows as the relay's claim would return them (for the ceilings)."""
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT seq, id, destination, topic, key, payload, content_type, CAST(headers AS text),"
            " attempts, created_at FROM outboxer.outbox ORDER BY seq LIMIT %s",
            (limit,),
        ).fetchall()
    return [
        Message(
            id=r[1],
            topic=r[3],
            payload=bytes(r[5]),
            key=r[4],
            headers=json.loads(r[7]),
            content_type=r[6],
            destination=r[2],
            created_at=r[9],
            attempts=r[8],
            seq=r[0],
        )
        for r in rows
    ]


# ----- databases ----------------------------------------------------------------------------


class Databases:
    """Fresh databases for one bench run: a template holding the backlog, clones of it."""

    def __init__(self, admin_url: str = ADMIN_URL) -> None:
        self.admin_url = admin_url
        self.run_id = uuid.uuid4().hex[:8]
        self.created: list[str] = []
        self._count = 0

    def url(self, name: str) -> str:
        return self.admin_url.rsplit("/", 1)[0] + "/" + name

    def _admin(self, *statements: str) -> None:
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            for statement in statements:
                conn.execute(statement)  # type: ignore[arg-type]

    def _name(self, label: str) -> str:
        self._count += 1
        return f"outboxer_bench_{self.run_id}_{label}_{self._count}"

    def empty(self, label: str = "db") -> str:
        """A new database with the outbox schema applied."""
        name = self._name(label)
        self._admin(f"CREATE DATABASE {name}")
        self.created.append(name)
        url = self.url(name)
        with psycopg.connect(url, autocommit=True) as conn:  # `outboxer schema sql`, applied
            conn.execute(PostgresStore(url).schema_sql().encode())
        return url

    def template(self, count: int, keys: int) -> tuple[str, float]:
        """A database holding ``count`` PENDING messages, vacuumed and analysed; (url, seconds)."""
        url = self.empty("template")
        seconds = prefill(url, count, keys)
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("VACUUM (ANALYZE) outboxer.outbox")
            conn.execute("CHECKPOINT")
        return url, seconds

    def clone(self, template_url: str, label: str = "clone") -> str:
        name = self._name(label)
        self._admin(f"CREATE DATABASE {name} TEMPLATE {template_url.rsplit('/', 1)[1]}")
        self.created.append(name)
        return self.url(name)

    def drop(self, url: str) -> None:
        name = url.rsplit("/", 1)[1]
        self._admin(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        if name in self.created:
            self.created.remove(name)

    def drop_all(self) -> None:
        for name in list(self.created):
            try:
                self.drop(self.url(name))
            except psycopg.Error as exc:
                log(f"could not drop {name}: {exc}")


def server_facts(url: str) -> dict[str, str]:
    names = (
        "server_version",
        "shared_buffers",
        "synchronous_commit",
        "fsync",
        "autovacuum",
        "wal_level",
        "max_connections",
    )
    with psycopg.connect(url) as conn:
        return {name: str(conn.execute(f"SHOW {name}").fetchone()[0]) for name in names}  # type: ignore[index]


def outbox_counts(url: str) -> dict[str, int]:
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT status, count(*) FROM outboxer.outbox GROUP BY status"
        ).fetchall()
    return {status: int(n) for status, n in rows}


def published_times(url: str, ids: Sequence[str], timeout: float = 15.0) -> dict[str, float]:
    """Wall-clock time (epoch s) each message was recorded PUBLISHED, once all of them are.

    Raises if some are still not published after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    with psycopg.connect(url, autocommit=True) as conn:
        while True:
            rows = conn.execute(
                "SELECT id::text, EXTRACT(EPOCH FROM published_at)::float8 FROM outboxer.outbox "
                "WHERE id = ANY(%s::uuid[]) AND status = 'PUBLISHED'",
                (list(ids),),
            ).fetchall()
            if len(rows) == len(ids):
                return {mid: float(at) for mid, at in rows}
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{len(ids) - len(rows)} of {len(ids)} messages not published "
                    f"after {timeout:.0f} s"
                )
            time.sleep(0.05)


# ----- relay processes ----------------------------------------------------------------------

_CLI = "import sys; from outboxer.cli import main; sys.exit(main())"
#: The relay's own defaults (batch 200, concurrency 4): what `outboxer relay` runs with.
_DEFAULTS = outboxer.Settings()


#: Which service a process belongs to, by its name (``comm``).
_SERVICES = {
    "postgres": "postgres",
    "beam.smp": "rabbitmq",
    "erl_child_setup": "rabbitmq",
    "inet_gethost": "rabbitmq",
    "epmd": "rabbitmq",
    "redis-server": "redis",
    "mariadbd": "mariadb",
    "mysqld": "mariadb",
}


def _service_cpu() -> dict[str, float]:
    """CPU seconds so far per service, counting children they reaped (ended backends)."""
    tick = os.sysconf("SC_CLK_TCK")
    totals = dict.fromkeys(set(_SERVICES.values()), 0.0)
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            text = Path(f"/proc/{entry.name}/stat").read_text()
        except OSError:  # ended meanwhile
            continue
        comm = text[text.index("(") + 1 : text.rindex(")")]
        service = _SERVICES.get(comm) or ("postgres" if comm.startswith("postgres") else None)
        if service is not None:
            fields = text.rsplit(")", 1)[1].split()
            totals[service] += sum(int(f) for f in fields[11:15]) / tick
    return totals


def _busy_seconds() -> float:
    """CPU seconds all cores spent busy since boot (everything but idle and iowait)."""
    fields = [int(f) for f in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class BoxMeter:
    """Where the machine's CPU went between ``start`` and ``stop``, in cores (CPU s / wall s).

    ``busy`` is the whole machine; ``postgres``, ``rabbitmq``, ``redis`` the services;
    ``client`` what the caller says its relay or publisher used (or, by default, this
    process); ``other`` the rest (other test suites, the bench itself, the kernel).
    """

    def start(self) -> BoxMeter:
        self._wall = time.monotonic()
        self._busy = _busy_seconds()
        self._services = _service_cpu()
        self._self = _self_cpu()
        return self

    def stop(self, client_cpu: float | None = None) -> dict[str, float]:
        wall = max(time.monotonic() - self._wall, 1e-6)
        services = _service_cpu()
        result = {"busy": (_busy_seconds() - self._busy) / wall}
        for name, seconds in services.items():
            result[name] = (seconds - self._services.get(name, 0.0)) / wall
        client = client_cpu if client_cpu is not None else _self_cpu() - self._self
        result["client"] = client / wall
        result["other"] = result["busy"] - sum(result[name] for name in (*services, "client"))
        result["seconds"] = wall  # not cores: how long the reading is (ticks are 10 ms)
        return result


def _self_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def cpu_of(pid: int) -> float:
    """User + system CPU seconds of a running process so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class RelayRun:
    published: int
    seconds: float
    cpu_seconds: float
    counts: dict[str, int]
    #: WARNING and ERROR lines the relays logged (an outage during the run, say).
    warnings: list[str] = field(default_factory=list)
    #: Cores busy during the drain, by service (see BoxMeter); ``client`` is the relays.
    box: dict[str, float] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.published / self.seconds if self.seconds > 0 else math.nan

    @property
    def cpu_per_1000(self) -> float:
        return 1000.0 * self.cpu_seconds / self.published if self.published else math.nan


class RelayProcess:
    """``outboxer relay`` in a subprocess, with its log in a temporary file."""

    def __init__(
        self,
        db_url: str,
        broker_url: str,
        *,
        batch_size: int = _DEFAULTS.batch_size,
        concurrency: int = _DEFAULTS.concurrency,
        exit_when_idle: bool = True,
        extra: Sequence[str] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        self.argv = [
            sys.executable,
            "-c",
            _CLI,
            "relay",
            "--db",
            db_url,
            "--broker",
            broker_url,
            "--batch-size",
            str(batch_size),
            "--concurrency",
            str(concurrency),
            "--log-level",
            "WARNING",
            *extra,
        ]
        if exit_when_idle:
            self.argv.append("--exit-when-idle")
        # Kept open for the relay's whole life and closed in stop(): no context manager fits.
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115
            "w+", prefix="outboxer-bench-relay-", suffix=".log", delete=False
        )
        self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.cpu_at_start = 0.0
        self.cpu_total: float | None = None
        self.status: int | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def mark(self) -> None:
        self.cpu_at_start = cpu_of(self.pid)

    def reap(self, block: bool = False) -> bool:
        """Collect the exit status and rusage once the process ended; True when it has."""
        if self.status is not None:
            return True
        pid, status, usage = os.wait4(self.pid, 0 if block else os.WNOHANG)
        if pid == 0:
            return False
        self.status = os.waitstatus_to_exitcode(status)
        self.proc.returncode = self.status
        self.cpu_total = usage.ru_utime + usage.ru_stime
        return True

    @property
    def cpu_seconds(self) -> float:
        return (self.cpu_total or 0.0) - self.cpu_at_start

    # os.kill, not Popen.send_signal: that polls first and would reap the process, losing its
    # rusage. Until reap() collects it, the pid is ours (a zombie keeps it), so this is safe.
    def terminate(self) -> None:
        if self.status is None:
            os.kill(self.pid, signal.SIGTERM)

    def kill(self) -> None:
        if self.status is None:
            os.kill(self.pid, signal.SIGKILL)
            self.reap(block=True)

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()[-4000:]

    def close(self) -> None:
        self.kill()
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)


class FloorProcess(RelayProcess):
    """bench/floor_relay.py in a subprocess, with the interface of RelayProcess: the control
    for relay CPU per message (``mode`` "waves": outboxer's publisher; "aiormq": aiormq's
    ``basic_publish`` per message)."""

    def __init__(self, db_url: str, amqp_url: str, exchange: str, mode: str = "waves") -> None:
        floor = Path(__file__).resolve().parent / "floor_relay.py"
        self.argv = [sys.executable, str(floor), db_url, amqp_url, exchange, mode]
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 -- closed in close()
            "w+", prefix="outboxer-bench-floor-", suffix=".log", delete=False
        )
        self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT)
        self.cpu_at_start = 0.0
        self.cpu_total: float | None = None
        self.status: int | None = None


def waiting_for_lock(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute(
        "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
        "WHERE l.locktype = 'advisory' AND NOT l.granted AND a.datname = current_database()"
    ).fetchone()
    return int(row[0]) if row else 0


def run_relays(
    db_url: str,
    broker_url: str,
    *,
    relays: int = 1,
    batch_size: int = _DEFAULTS.batch_size,
    concurrency: int = _DEFAULTS.concurrency,
    stop_after: float | None = None,
    timeout: float = 300.0,
) -> RelayRun:
    """Start ``relays`` relay processes on a prepared table, all held at a gate; time the drain.

    The gate is the destination's claim lock (a session advisory lock held here): every
    relay connects, reaches its first claim and waits. Opening the gate starts the clock,
    so imports and connections are not counted. The drain ends with the last settle
    (``max(published_at)``); ``stop_after`` seconds stops the relays early (SIGTERM).
    """
    lock_key = PostgresStore(db_url).lock_key(DESTINATION)
    started: list[RelayProcess] = []
    with psycopg.connect(db_url, autocommit=True) as gate:
        gate.execute("SELECT pg_advisory_lock(%s)", (lock_key,))
        try:
            started = [
                RelayProcess(db_url, broker_url, batch_size=batch_size, concurrency=concurrency)
                for _ in range(relays)
            ]
            deadline = time.monotonic() + 60
            while waiting_for_lock(gate) < relays * concurrency:
                for relay in started:
                    if relay.reap():
                        raise RuntimeError(
                            f"relay exited before the start ({relay.status}):\n" + relay.output()
                        )
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        "relays did not reach their first claim within 60 s:\n"
                        + "\n".join(r.output() for r in started)
                    )
                time.sleep(0.02)
            for relay in started:
                relay.mark()
            meter = BoxMeter().start()
        finally:
            gate.execute("SELECT pg_advisory_unlock(%s)", (lock_key,))
        opened = time.time()
        try:
            stopping = False
            while not all(relay.reap() for relay in started):
                elapsed = time.time() - opened
                if stop_after is not None and elapsed >= stop_after and not stopping:
                    stopping = True
                    for relay in started:
                        relay.terminate()
                if elapsed > timeout:
                    raise RuntimeError(
                        f"relays still running after {timeout:.0f} s:\n"
                        + "\n".join(r.output() for r in started)
                    )
                time.sleep(0.02)
            box = meter.stop(client_cpu=sum(r.cpu_seconds for r in started))
            # -SIGTERM: our stop reached a relay that was exiting anyway (its handlers were gone).
            failed = [
                r
                for r in started
                if r.status != 0 and not (stopping and r.status == -signal.SIGTERM)
            ]
            if failed:
                raise RuntimeError(f"relay exited with {failed[0].status}:\n{failed[0].output()}")
            row = gate.execute(
                "SELECT count(*), EXTRACT(EPOCH FROM max(published_at)) FROM outboxer.outbox "
                "WHERE status = 'PUBLISHED'"
            ).fetchone()
            warnings = [
                line
                for relay in started
                for line in relay.output().splitlines()
                if " WARNING " in line or " ERROR " in line
            ]
        finally:
            for relay in started:
                relay.close()
    assert row is not None
    published, last = int(row[0]), float(row[1] or opened)
    return RelayRun(
        published,
        max(last - opened, 1e-6),
        sum(r.cpu_seconds for r in started),
        outbox_counts(db_url),
        warnings,
        box,
    )


def wait_listening(db_url: str, relays: int = 1, timeout: float = 30.0) -> None:
    """Wait until ``relays`` relays LISTEN for wake-ups (they are idle and ready)."""
    deadline = time.monotonic() + timeout
    with psycopg.connect(db_url, autocommit=True) as conn:
        while True:
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND application_name = 'outboxer-relay-listen'"
            ).fetchone()
            if row is not None and int(row[0]) >= relays:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"no relay listening on {db_url} after {timeout:.0f} s")
            time.sleep(0.05)
