"""Several destinations per message: each is retried, abandoned and counted on its own."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import psycopg

import outboxer
from outboxer import Relay, load_settings
from outboxer.testing import eventually
from tests.integration.test_broker_webhook import HookServer
from tests.rabbit import RabbitConsumer


def by_destination(pg_url: str) -> dict[str, list[tuple[str, int]]]:
    with psycopg.connect(pg_url) as conn:
        rows = conn.execute(
            "SELECT destination, status, attempts FROM outboxer.outbox ORDER BY seq"
        ).fetchall()
    result: dict[str, list[tuple[str, int]]] = {}
    for destination, status, attempts in rows:
        result.setdefault(destination, []).append((status, attempts))
    return result


async def test_one_destination_down_does_not_hold_back_the_other(
    pg_url: str, rabbit_consumer: RabbitConsumer, tmp_path: Path
) -> None:
    receiver = await HookServer().start()
    port = receiver.port
    await receiver.stop()  # the partner's receiver is down
    config = tmp_path / "outboxer.toml"
    config.write_text(f"""
db = "{pg_url}"
poll_interval = 0.1
backoff_base = 0.2
backoff_max = 0.5
max_attempts = 1000

[destinations.internal]
broker = "{rabbit_consumer.broker_url}"

[destinations.partner]
broker = "http://127.0.0.1:{port}/hooks"
envelope = "stripped"
""")
    outbox = outboxer.Outbox(destinations=("internal", "partner"))
    with psycopg.connect(pg_url) as conn:
        sent = [
            outbox.enqueue(
                conn,
                "order.placed",
                {"n": n},
                key=f"k{n % 2}",
                headers={"internal-tenant": "acme", "trace": f"t{n}"},
            )
            for n in range(6)
        ]
    relay = Relay.from_settings(load_settings({}, config_file=config, environ={}))
    task = asyncio.create_task(relay.run())
    try:
        await rabbit_consumer.wait_for(6)

        async def internal_done_partner_down() -> bool:
            rows = by_destination(pg_url)
            return (
                all(s == "PUBLISHED" for s, _ in rows["internal"])
                and any("broker partner" in problem for problem in relay.health_problems())
                # The publisher reports the broker down as soon as its connection fails,
                # before the batch it was publishing is given back: wait for that too.
                and rows["partner"] == [("PENDING", 0)] * 6
            )

        await eventually(internal_done_partner_down, timeout=20)
        # Refused connections are no attempt: the partner's rows wait, untried, for its
        # receiver, however long it is down. The relay probes the receiver and claims
        # nothing meanwhile: several back-offs later the rows are still untouched.
        await asyncio.sleep(1.5)
        assert by_destination(pg_url)["partner"] == [("PENDING", 0)] * 6
        assert any("broker partner" in problem for problem in relay.health_problems())

        receiver = HookServer(port=port)
        await receiver.start()

        async def all_published() -> bool:
            return all(
                s == "PUBLISHED" for rows in by_destination(pg_url).values() for s, _ in rows
            )

        await eventually(all_published, timeout=30)
    finally:
        relay.stop()
        await asyncio.wait_for(task, 30)
        await receiver.stop()

    rows = by_destination(pg_url)
    assert len(rows["internal"]) == len(rows["partner"]) == 6
    assert all(attempts == 0 for _, attempts in rows["internal"]), "internal never failed"
    assert all(attempts == 0 for _, attempts in rows["partner"]), "the outage cost no attempt"
    # Counted per destination (the HTTP API's metrics label them), and in sum.
    internal, partner = relay.destination_stats["internal"], relay.destination_stats["partner"]
    assert (internal.published, internal.failed) == (6, 0)
    assert partner.published == 6 and partner.failed == 0
    assert relay.stats.published == 12 and relay.stats.failed == partner.failed
    assert sorted(d.message_id for d in rabbit_consumer.received) == sorted(str(m.id) for m in sent)
    assert all(d.headers.get("internal-tenant") == "acme" for d in rabbit_consumer.received), (
        "full envelope inside"
    )
    # The relay probes a receiver that refused it with HEAD before it posts again.
    delivered = [r for r in receiver.requests if r.status == 200 and r.method == "POST"]
    assert sorted(r.headers["outboxer-id"] for r in delivered) == sorted(str(m.id) for m in sent)
    assert all("internal-tenant" not in r.headers for r in delivered), "stripped envelope outside"
    assert all(r.target == "/hooks" for r in delivered)
    first = next(r for r in delivered if r.headers["outboxer-id"] == str(sent[0].id))
    assert json.loads(first.body) == {"n": 0}


async def test_an_idle_relay_wakes_for_every_destination_at_once(
    pg_url: str, tmp_path: Path
) -> None:
    """One commit for two destinations wakes both destinations' loops from idle: neither
    waits for the poll interval (30 s here)."""
    config = tmp_path / "outboxer.toml"
    config.write_text(f"""
db = "{pg_url}"
poll_interval = 30

[destinations.internal]
broker = "memory://wake-internal"

[destinations.partner]
broker = "memory://wake-partner"
""")
    relay = Relay.from_settings(load_settings({}, config_file=config, environ={}))
    task = asyncio.create_task(relay.run())
    outbox = outboxer.Outbox(destinations=("internal", "partner"))
    try:
        await asyncio.sleep(1.0)  # both destinations idle, waiting for a NOTIFY
        for n in range(3):
            with psycopg.connect(pg_url) as conn:
                outbox.enqueue(conn, "order.placed", {"n": n})
            started = time.monotonic()

            async def both_published(count: int = n + 1) -> bool:
                rows = by_destination(pg_url)
                return all(
                    sum(s == "PUBLISHED" for s, _ in rows.get(d, [])) == count
                    for d in ("internal", "partner")
                )

            await eventually(both_published, timeout=10)
            assert time.monotonic() - started < 2.0, "woken, not polled"
            await asyncio.sleep(0.3)  # idle again
    finally:
        relay.stop()
        await asyncio.wait_for(task, 30)
