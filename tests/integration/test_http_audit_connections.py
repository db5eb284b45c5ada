"""The HTTP API against hostile clients: connection floods (a real server, a real database)."""

from __future__ import annotations

import asyncio
import json

import httpx

from outboxer import load_settings
from outboxer.http import HttpApi, HttpServer
from outboxer.stores import create_store
from outboxer.testing import eventually


async def test_connections_beyond_the_limit_are_refused_at_once_not_held(sqlite_url: str) -> None:
    # uvicorn's limit_concurrency counts connections only when a request arrives: a client
    # that opens connections and sends nothing had every one held (a file descriptor each, in
    # the relay's process) until the read deadline. The limit must bound what is held.
    limit, opened = 8, 40
    api = HttpApi(create_store(sqlite_url), load_settings({"db": sqlite_url}, environ={}))
    server = await HttpServer(api, "127.0.0.1", 0, max_connections=limit, read_timeout=30).start()
    idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    try:
        for _ in range(opened):
            idle.append(await asyncio.open_connection("127.0.0.1", server.port))

        async def answer(reader: asyncio.StreamReader) -> bytes | None:
            try:
                return await asyncio.wait_for(reader.read(), 3)
            except TimeoutError:
                return None  # still held by the server

        answers = await asyncio.gather(*(answer(reader) for reader, _ in idle))
        held = [each for each in answers if each is None]
        refused = [each for each in answers if each is not None]
        assert len(held) == limit, f"{len(held)} idle connections held; the limit is {limit}"
        for each in refused:
            head, _, body = each.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 503 Service Unavailable"), each
            assert json.loads(body)["type"] == "ServiceUnavailable", each
        # Once the idle clients leave, the API answers again.
        for _, writer in idle:
            writer.close()
        idle.clear()
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:

            async def healthy() -> bool:  # once the server has seen the idle ones close
                return (await client.get("/health")).status_code == 200

            await eventually(healthy, timeout=10)
    finally:
        for _, writer in idle:
            writer.close()
        await server.close()


async def test_as_many_connections_as_the_limit_are_answered(sqlite_url: str) -> None:
    # uvicorn's limit_concurrency counts the connection of the request itself: given
    # max_connections, it answered 503 to the max_connections-th (with a limit of 1, to all).
    limit = 4
    api = HttpApi(create_store(sqlite_url), load_settings({"db": sqlite_url}, environ={}))
    server = await HttpServer(api, "127.0.0.1", 0, max_connections=limit, read_timeout=30).start()
    idle = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(limit - 1)]
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
            response = await client.get("/health")
        assert response.status_code == 200, response.text
    finally:
        for _, writer in idle:
            writer.close()
        await server.close()


async def test_a_database_that_accepts_and_never_answers_costs_each_request_the_store_timeout(
    pg_url: str,
) -> None:
    """A black-holed database (TCP accepted, nothing answered): /status, /messages and the
    POSTs waited for the driver's own 60 s connect timeout, holding their connections; they
    answer 503 after the store timeout, as /health does."""
    import socket
    import time

    import httpx

    from outboxer import load_settings
    from outboxer.http import HttpApi, HttpServer
    from outboxer.stores import create_store

    hole = socket.create_server(("127.0.0.1", 0))
    hole.listen(16)
    try:
        url = f"postgresql://app:x@127.0.0.1:{hole.getsockname()[1]}/test"
        api = HttpApi(create_store(url), load_settings({"db": url}, environ={}), store_timeout=0.5)
        server = await HttpServer(api, "127.0.0.1", 0).start()
        try:
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
                for path in ("/status", "/messages"):
                    started = time.monotonic()
                    answer = await client.get(path)
                    took = time.monotonic() - started
                    assert answer.status_code == 503, (path, answer.text)
                    assert took < 5, f"{path} took {took:.1f}s"
        finally:
            await server.close()
    finally:
        hole.close()
