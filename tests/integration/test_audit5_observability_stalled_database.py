"""/metrics and /health of a process serving several databases, one of which stopped
answering (its connections stalled: no error, no answer): they answer within the API's
store timeout, the stalled database reported down and the others as they are. A scrape
that waited for the stalled database's connection (asyncpg's cancel request, up to its
command timeout, a minute) lost every database's metrics to the scraper's own timeout."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from outboxer import load_settings
from outboxer.http import HttpApi, Request, api_stores
from outboxer.stores.postgres import RELEASE_TIMEOUT
from tests.chaos.proxy import FaultProxy
from tests.relaying import enqueue

#: The store timeout, then the stalled statement's connection closed rather than waited for.
BOUND = 0.5 + RELEASE_TIMEOUT + 0.5


async def test_a_stalled_database_holds_up_no_scrape_nor_health_probe(
    pg_url: str, sqlite_url: str, tmp_path: Path, pg_proxy: FaultProxy
) -> None:
    stalled_url = pg_url.replace(":5432/", f":{pg_proxy.port}/")
    assert stalled_url != pg_url
    path = tmp_path / "outboxer.toml"
    path.write_text(
        f'[databases.steady]\nurl = "{sqlite_url}"\n[databases.stalled]\nurl = "{stalled_url}"\n'
    )
    enqueue(sqlite_url, ("t", "k"))
    settings = load_settings({}, config_file=path, environ={})
    api = HttpApi(api_stores(settings), settings, store_timeout=0.5, status_cache_seconds=0)
    try:
        # Both answer: the API holds a connection to each.
        metrics = (await api.handle(Request("GET", "/metrics"))).body.decode()
        assert 'outboxer_store_up{database="stalled"} 1.0' in metrics
        pg_proxy.stall()
        for attempt in range(2):  # and again: the first one's connection did not hold it up
            started = time.monotonic()
            answer = await asyncio.wait_for(api.handle(Request("GET", "/metrics")), 10)
            took = time.monotonic() - started
            metrics = answer.body.decode()
            assert answer.status == 200
            assert 'outboxer_store_up{database="stalled"} 0.0' in metrics
            assert 'outboxer_store_up{database="steady"} 1.0' in metrics
            assert (
                'outboxer_messages{database="steady",destination="default",status="PENDING"} 1.0'
                in metrics
            )
            assert took < BOUND, f"scrape {attempt} took {took:.1f}s (store timeout 0.5s)"
            started = time.monotonic()
            health = await asyncio.wait_for(api.handle(Request("GET", "/health")), 10)
            took = time.monotonic() - started
            body = json.loads(health.body)
            assert health.status == 200 and body["status"] == "degraded", body
            assert body["databases"]["steady"] == {"database": "ok"}
            assert body["databases"]["stalled"]["database"] != "ok"
            assert took < BOUND, f"health probe {attempt} took {took:.1f}s (store timeout 0.5s)"
    finally:
        pg_proxy.resume()
        await api.close()
