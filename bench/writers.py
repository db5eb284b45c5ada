"""Application writers for the write-path and latency sections, run in worker processes.

Each writer is one process with one psycopg connection (``synchronous_commit = on``),
the way a web worker writes: a business INSERT, then COMMIT. In the same transaction
the INSERT is alone (``bare``), followed by ``outboxer.enqueue`` of an event
(``enqueue``), followed by a plain INSERT of the same event into ``bench_events``,
no outboxer code (``control``: what writing the event row at all costs), or followed by a
plain INSERT of it into the outbox table itself, without the key lock (``table``: what
the outbox table's own indexes, defaults and trigger cost). Workers are
started before the clock starts and begin together at ``start_at`` (wall clock).
"""

from __future__ import annotations

import json
import os
import random
import resource
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg

import outboxer

BUSINESS_TABLE = """
CREATE TABLE IF NOT EXISTS bench_orders (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    customer    text NOT NULL,
    total       numeric(12, 2) NOT NULL,
    status      text NOT NULL DEFAULT 'placed',
    details     jsonb NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS bench_orders_customer_idx ON bench_orders (customer);
"""

#: The control's event table: the outbox row's columns and types (payload bytea, headers jsonb),
#: a primary key, nothing else: no key lock, no trigger, no further indexes.
EVENTS_TABLE = """
CREATE TABLE IF NOT EXISTS bench_events (
    id            uuid PRIMARY KEY,
    topic         text NOT NULL,
    key           text,
    payload       bytea NOT NULL,
    content_type  text NOT NULL,
    headers       jsonb NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now()
);
"""

INSERT = "INSERT INTO bench_orders (customer, total, details) VALUES (%s, %s, %s) RETURNING id"
#: The control's INSERT, parameters as outboxer's insert passes them (headers as JSON text).
INSERT_EVENT = (
    "INSERT INTO bench_events (id, topic, key, payload, content_type, headers)"
    " VALUES (%s, %s, %s, %s, %s, CAST(%s AS jsonb))"
)
_NOTE = "x" * 150
#: ``table``'s INSERT: the row as ``enqueue`` writes it, minus the key lock and the Python.
INSERT_OUTBOX = (
    "INSERT INTO outboxer.outbox (id, destination, topic, key, payload, content_type, headers)"
    " VALUES (%s, 'default', %s, %s, %s, %s, CAST(%s AS jsonb))"
)
#: What each writer does in a transaction besides the business INSERT (see the module doc).
MODES = ("bare", "enqueue", "control", "table")


def create_business_table(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(BUSINESS_TABLE)  # type: ignore[arg-type]
        conn.execute(EVENTS_TABLE)  # type: ignore[arg-type]


def _connect(url: str) -> psycopg.Connection[Any]:
    conn = psycopg.connect(url)
    conn.execute("SET synchronous_commit = on")
    conn.commit()
    return conn


def _order(rnd: random.Random, keys: int) -> tuple[str, str, str]:
    customer = f"customer-{rnd.randrange(keys):05d}"
    total = f"{rnd.randrange(100, 1_000_000) / 100:.2f}"
    details = '{"channel":"web","lines":3,"note":"' + _NOTE + '"}'
    return customer, total, details


def _event(order_id: int, customer: str, total: str) -> dict[str, Any]:
    """The ~300-byte event that announces the order."""
    return {
        "order_id": order_id,
        "customer": customer,
        "total": total,
        "currency": "EUR",
        "lines": [{"sku": "SKU-000001", "qty": 1}, {"sku": "SKU-000002", "qty": 2}],
        "note": _NOTE,
    }


def _json(value: Any) -> str:
    """JSON as outboxer encodes payloads and headers."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def _uuid7() -> uuid.UUID:
    """A time-ordered UUID, as outboxer's ids are (the primary key index grows at its end)."""
    rand = int.from_bytes(os.urandom(10), "big")  # 80 random bits: 12 for rand_a, 62 for rand_b
    millis = time.time_ns() // 1_000_000
    return uuid.UUID(
        int=millis << 80 | 0x7 << 76 | (rand >> 68) << 64 | 0b10 << 62 | rand & ((1 << 62) - 1)
    )


def _transaction(
    conn: psycopg.Connection[Any], rnd: random.Random, keys: int, mode: str, messages: int = 1
) -> list[str]:
    customer, total, details = _order(rnd, keys)
    row = conn.execute(INSERT, (customer, total, details)).fetchone()
    assert row is not None
    ids: list[str] = []
    if mode != "bare":
        event = _event(row[0], customer, total)
        headers = {"traceparent": f"00-{rnd.getrandbits(128):032x}-{rnd.getrandbits(64):016x}-01"}
        if mode in ("control", "table"):  # the same event, encoded as outboxer encodes it
            for _ in range(messages):
                conn.execute(
                    INSERT_EVENT if mode == "control" else INSERT_OUTBOX,
                    (
                        _uuid7(),
                        "order.placed",
                        customer,
                        _json(event).encode(),
                        "application/json",
                        _json(headers),
                    ),
                )
        elif messages == 1:
            ids.append(
                str(outboxer.enqueue(conn, "order.placed", event, key=customer, headers=headers).id)
            )
        else:
            sent = outboxer.enqueue_many(
                conn,
                [
                    {"topic": "order.placed", "payload": event, "key": customer, "headers": headers}
                    for _ in range(messages)
                ],
            )
            ids.extend(str(message.id) for message in sent)
    conn.commit()
    return ids


def warm_up(_: int) -> int:
    """Imports done, nothing else: lets the pool start all its processes before a run."""
    time.sleep(0.3)
    return 0


def _cpu(pid: int | None = None) -> float:
    """CPU seconds (user + system) of this process, or of local process ``pid``."""
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def write_for(
    url: str, mode: str, start_at: float, end_at: float, keys: int, seed: int
) -> dict[str, Any]:
    """Commit transactions of ``mode`` (see MODES) back to back from ``start_at`` to ``end_at``.

    Returns the count, each transaction's latency (first statement to COMMIT returned),
    and the CPU this writer and its PostgreSQL backend used meanwhile.
    """
    rnd = random.Random(seed)
    conn = _connect(url)
    backend = conn.info.backend_pid
    try:
        for _ in range(5):  # prepared statements, caches
            _transaction(conn, rnd, keys, mode)
        late = time.time() - start_at
        time.sleep(max(0.0, -late))
        latencies: list[float] = []
        client, server = _cpu(), _cpu(backend)
        while time.time() < end_at:
            began = time.perf_counter()
            _transaction(conn, rnd, keys, mode)
            latencies.append((time.perf_counter() - began) * 1000.0)
        client, server = _cpu() - client, _cpu(backend) - server
    finally:
        conn.close()
    return {
        "count": len(latencies),
        "latencies_ms": latencies,
        "late_s": late,
        "client_cpu_s": client,
        "server_cpu_s": server,
    }


def write_paced(
    url: str,
    rate: float,
    messages: int,
    start_at: float,
    end_at: float,
    keys: int,
    seed: int,
    mode: str = "enqueue",
    phase: float = 0.0,
) -> dict[str, Any]:
    """Commit a transaction of ``messages`` enqueued messages every 1/rate s; record commit times.

    ``phase`` (0 to 1) shifts this writer's schedule by that share of its period: N writers
    at phases 0, 1/N, … commit evenly spaced at N x rate in all. Without it they would all
    commit at the same instants, a burst of N every period (a rate of N bursts, not of
    commits: later commits of a burst wait for the first, and the relay's loops wake for
    rows another loop has just claimed).

    ``mode="control"`` writes the same events into a plain table instead (no outboxer code).

    Returns ``[(message id, wall time COMMIT returned)]`` and how far behind schedule it fell.
    """
    rnd = random.Random(seed)
    conn = _connect(url)
    committed: list[tuple[str, float]] = []
    late = 0.0
    try:
        _transaction(conn, rnd, keys, "bare")
        n = 0
        while True:
            due = start_at + (n + phase) / rate
            if due >= end_at:
                break
            wait = due - time.time()
            if wait > 0:
                time.sleep(wait)
            else:
                late = max(late, -wait)
            ids = _transaction(conn, rnd, keys, mode, messages=messages)
            done = time.time()
            committed.extend((message_id, done) for message_id in ids)
            n += 1
    finally:
        conn.close()
    return {"committed": committed, "late_s": late}
