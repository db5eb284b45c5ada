"""The orders example, end to end on the local PostgreSQL and RabbitMQ, in one command::

    .venv/bin/python examples/orders/run.py [--orders 30] [--no-kill] [--keep]

It creates two databases (orders, shipping), starts the shipping service (FastStream +
inbox middleware), the order service (FastAPI + SQLAlchemy domain events) and ``outboxer
relay``; places orders over HTTP; kills the relay with SIGKILL while it works, places more
orders while it is down, starts it again; waits until every order shipped, and prints
what happened. Exit status 0 when every order shipped exactly once.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx
import psycopg

HERE = Path(__file__).resolve().parent
SKIPPED_LINE = "the inbox has applied it already"  # outboxer.contrib.faststream's log line


@dataclass
class Report:
    placed: list[int]
    #: order id -> how many shipments the shipping service wrote for it
    shipments: dict[int, int]
    #: copies the inbox recognised and acknowledged without shipping again
    skipped_copies: int
    #: outbox rows that needed more than one attempt: here, those a restarted relay took
    #: over from the killed one
    taken_over: int
    relay_kills: int
    seconds: float

    @property
    def exactly_once(self) -> bool:
        return sorted(self.shipments) == sorted(self.placed) and all(
            count == 1 for count in self.shipments.values()
        )

    def summary(self) -> str:
        twice = sorted(order for order, count in self.shipments.items() if count > 1)
        missing = sorted(set(self.placed) - set(self.shipments))
        return "\n".join(
            [
                f"orders placed over HTTP:          {len(self.placed)}",
                f"relay killed with SIGKILL:        {self.relay_kills} (and started again)",
                f"messages taken over after it:     {self.taken_over}",
                f"copies skipped by the inbox:      {self.skipped_copies}",
                f"orders shipped:                   {len(self.shipments)}",
                f"shipped more than once:           {twice or 'none'}",
                f"never shipped:                    {missing or 'none'}",
                f"took:                             {self.seconds:.1f} s",
                "every order shipped exactly once" if self.exactly_once else "FAILED",
            ]
        )


@dataclass
class Example:
    orders: int = 30
    kill_relay: bool = True
    #: Prefix of the databases, the exchange and the queue (tests run several at once).
    name: str = "orders_example"
    postgres: str = os.environ.get("EXAMPLE_PG", "postgresql://postgres@127.0.0.1:5432")
    amqp: str = os.environ.get("EXAMPLE_AMQP", "amqp://guest:guest@127.0.0.1:5672/")
    logs: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="orders-example-")))
    timeout: float = 60.0
    _processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    _log_files: list[IO[bytes]] = field(default_factory=list)

    # ----- names -----------------------------------------------------------------------

    def database(self, service: str, driver: str = "postgresql") -> str:
        return f"{self.postgres.replace('postgresql', driver, 1)}/{self.name}_{service}"

    @property
    def exchange(self) -> str:
        return f"{self.name}-events"

    @property
    def queue(self) -> str:
        return f"{self.name}-shipping"

    # ----- the run -----------------------------------------------------------------------

    def run(self) -> Report:
        started = time.monotonic()
        self.reset()
        try:
            self.start_shipping()
            port = self.start_orders()
            self.start_relay()
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
                first_half = self.orders // 2
                placed = self.place(client, first_half)
                kills = 0
                if self.kill_relay:
                    self.wait_until_relay_works()
                    self.kill("relay")
                    kills = 1
                placed += self.place(client, self.orders - first_half)  # relay down: kept
                if self.kill_relay:
                    self.start_relay()
            self.wait_until_shipped(placed)
            return Report(
                placed=placed,
                shipments=self.shipments(),
                skipped_copies=self.skipped_copies(),
                taken_over=self.taken_over(),
                relay_kills=kills,
                seconds=time.monotonic() - started,
            )
        finally:
            self.stop()

    def reset(self) -> None:
        """Fresh databases with outboxer's schema, no exchange or queue of a previous run."""
        from outboxer.stores import create_store

        admin = f"{self.postgres}/postgres"
        with psycopg.connect(admin, autocommit=True) as conn:
            for service in ("orders", "shipping"):
                conn.execute(f"DROP DATABASE IF EXISTS {self.name}_{service} WITH (FORCE)")
                conn.execute(f"CREATE DATABASE {self.name}_{service}")

        async def apply_schemas() -> None:
            for service in ("orders", "shipping"):  # outbox and inbox, both
                async with create_store(self.database(service)) as store:
                    await store.apply_schema()
            await self.delete_broker_objects()

        asyncio.run(apply_schemas())
        with psycopg.connect(self.database("shipping")) as conn:
            conn.execute("CREATE TABLE shipments (order_id int NOT NULL, customer text NOT NULL)")

    async def delete_broker_objects(self) -> None:
        import aio_pika

        connection = await aio_pika.connect(self.amqp)
        async with connection:
            channel = await connection.channel()
            await channel.queue_delete(self.queue)
            await channel.exchange_delete(self.exchange)

    def spawn(self, role: str, args: list[str], env: dict[str, str] | None = None) -> None:
        log = (self.logs / f"{role}.log").open("ab")
        self._log_files.append(log)
        self._processes[role] = subprocess.Popen(
            args,
            cwd=HERE,
            env={**os.environ, **(env or {})},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a Ctrl-C of run.py does not reach it first
        )

    def start_shipping(self) -> None:
        env = {
            "SHIPPING_DB_URL": self.database("shipping", "postgresql+asyncpg"),
            "AMQP_URL": self.amqp,
            "EXCHANGE": self.exchange,
            "QUEUE": self.queue,
        }
        self.spawn("shipping", [sys.executable, "shipping_service.py"], env)
        self.wait_for(lambda: "shipping service ready" in self.log("shipping"), "shipping")

    def start_orders(self) -> int:
        with socket.socket() as probe:  # a free port for uvicorn
            probe.bind(("127.0.0.1", 0))
            port = int(probe.getsockname()[1])
        env = {"ORDERS_DB_URL": self.database("orders", "postgresql+asyncpg")}
        args = [sys.executable, "-m", "uvicorn", "orders_service:app", "--port", str(port)]
        self.spawn("orders", [*args, "--host", "127.0.0.1", "--log-level", "warning"], env)

        def healthy() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        self.wait_for(healthy, "orders")
        return port

    def start_relay(self) -> None:
        broker = f"{self.amqp}?exchange={self.exchange}"
        args = ["relay", "--db", self.database("orders"), "--broker", broker]
        # A short lock: the restarted relay takes the killed one's rows over after 2 s.
        args += ["--lock-timeout", "2s", "--poll-interval", "200ms", "--log-level", "WARNING"]
        self.spawn("relay", [sys.executable, "-m", "outboxer.cli", *args])

    def place(self, client: httpx.Client, count: int) -> list[int]:
        placed = []
        for n in range(count):
            response = client.post("/orders", json={"customer": f"c-{n % 5}", "total": 10.0 + n})
            response.raise_for_status()
            placed.append(int(response.json()["id"]))
        return placed

    def wait_until_relay_works(self) -> None:
        """Until the relay has claimed something: the kill then lands while it works."""

        def claimed() -> bool:
            with psycopg.connect(self.database("orders")) as conn:
                row = conn.execute(
                    "SELECT count(*) FROM outboxer.outbox WHERE status <> 'PENDING'"
                ).fetchone()
            return bool(row and row[0])

        self.wait_for(claimed, "relay", interval=0.002)

    def kill(self, role: str) -> None:
        process = self._processes.pop(role)
        process.send_signal(signal.SIGKILL)
        process.wait()

    def wait_until_shipped(self, placed: list[int]) -> None:
        self.wait_for(lambda: set(self.shipments()) >= set(placed), "shipments")
        time.sleep(0.5)  # a late duplicate would show up now

    def wait_for(self, ready: Any, what: str, interval: float = 0.05) -> None:
        deadline = time.monotonic() + self.timeout
        while not ready():
            for role, process in self._processes.items():
                if process.poll() is not None:
                    raise RuntimeError(f"{role} exited ({process.returncode}): {self.log(role)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"waiting for {what}; logs in {self.logs}")
            time.sleep(interval)

    # ----- what happened ----------------------------------------------------------------

    def shipments(self) -> dict[int, int]:
        with psycopg.connect(self.database("shipping")) as conn:
            rows = conn.execute("SELECT order_id FROM shipments").fetchall()
        return dict(collections.Counter(row[0] for row in rows))

    def taken_over(self) -> int:
        with psycopg.connect(self.database("orders")) as conn:
            # A relay that takes over an expired lock counts the dead relay's attempt.
            row = conn.execute("SELECT count(*) FROM outboxer.outbox WHERE attempts > 0").fetchone()
        return int(row[0]) if row else 0

    def skipped_copies(self) -> int:
        return self.log("shipping").count(SKIPPED_LINE)

    def log(self, role: str) -> str:
        path = self.logs / f"{role}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        for process in self._processes.values():
            process.send_signal(signal.SIGTERM)
        for role, process in list(self._processes.items()):
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            del self._processes[role]
        for log in self._log_files:
            log.close()
        asyncio.run(self.delete_broker_objects())

    def drop_databases(self) -> None:
        with psycopg.connect(f"{self.postgres}/postgres", autocommit=True) as conn:
            for service in ("orders", "shipping"):
                conn.execute(f"DROP DATABASE IF EXISTS {self.name}_{service} WITH (FORCE)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--orders", type=int, default=30, help="how many orders to place")
    parser.add_argument("--no-kill", action="store_true", help="leave the relay alone")
    parser.add_argument("--keep", action="store_true", help="keep the databases afterwards")
    args = parser.parse_args(argv)
    example = Example(orders=args.orders, kill_relay=not args.no_kill)
    try:
        report = example.run()
    finally:
        if not args.keep:
            example.drop_databases()
    print(report.summary())
    print(f"service logs: {example.logs}")
    return 0 if report.exactly_once else 1


if __name__ == "__main__":
    sys.exit(main())
