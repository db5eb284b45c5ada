"""GET /metrics with an Accept version prometheus_client cannot compare: a 400, not a 500.

prometheus_client reads ``version=abc`` as the tuple ("abc",) and compares it with (1, 0, 0):
TypeError. The table relay's API answered 500; the stream relay's let the exception out of
the application (a traceback from uvicorn).
"""

from __future__ import annotations

from typing import Any, cast

import httpx
import pytest

from outboxer import load_settings
from outboxer.http import AsgiApp, HttpApi, Request
from outboxer.metrics import Metrics
from outboxer.stores import create_store
from outboxer.stream_api import StreamApi

MALFORMED = (
    "application/openmetrics-text; version=abc",
    "application/openmetrics-text; version=1.x",
    'application/openmetrics-text; version="1.0.0"',
    "text/plain; version=1.0.0-rc1",
    "application/openmetrics-text; version=" + "9" * 5000,
    "text/html, application/openmetrics-text; version=\xff",
)


@pytest.mark.parametrize("accept", MALFORMED)
async def test_a_malformed_accept_version_is_a_400(pg_url: str, accept: str) -> None:
    api = HttpApi(create_store(pg_url), load_settings({"db": pg_url}, environ={}))
    transport = httpx.ASGITransport(app=AsgiApp(api, "127.0.0.1", read_timeout=5.0))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            response = await client.get("/metrics", headers={"accept": accept.encode("latin-1")})
    finally:
        await api.close()
    assert response.status_code == 400, response.text
    assert response.json()["type"] == "BadRequest"
    assert "version" in response.json()["error"]


@pytest.mark.parametrize(
    ("accept", "content_type"),
    [
        ("application/openmetrics-text; version=1.0.0", "application/openmetrics-text"),
        ("text/plain; version=0.0.4", "text/plain"),
        ("text/html; version=abc, */*", "text/plain"),  # a version prometheus never reads
        (None, "text/plain"),
    ],
)
async def test_well_formed_accept_headers_still_choose_the_format(
    pg_url: str, accept: str | None, content_type: str
) -> None:
    api = HttpApi(create_store(pg_url), load_settings({"db": pg_url}, environ={}))
    transport = httpx.ASGITransport(app=AsgiApp(api, "127.0.0.1", read_timeout=5.0))
    headers = {} if accept is None else {"accept": accept}
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            response = await client.get("/metrics", headers=headers)
    finally:
        await api.close()
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith(content_type)
    assert "outboxer_store_up" in response.text


@pytest.mark.parametrize("accept", MALFORMED)
async def test_the_stream_relays_metrics_refuse_it_too(accept: str) -> None:
    # /metrics reads only the registry: no relay is needed to answer it.
    api = StreamApi(cast(Any, None), Metrics(process_metrics=False))
    response = await api.handle(Request("GET", "/metrics", headers={"accept": accept}))
    assert response.status == 400, response.body
    assert b'"BadRequest"' in response.body
