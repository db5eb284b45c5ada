"""The HTTP API served from a thread of its own, for clients that block (sockets, browsers)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

from outboxer.http import HttpApi, HttpServer


@contextlib.contextmanager
def serving_in_thread(
    make_api: Callable[[], HttpApi], **server_options: Any
) -> Iterator[HttpServer]:
    """An ``HttpServer`` on a free loopback port, on its own event loop in its own thread.

    ``make_api`` runs on that loop (a store's pool belongs to the loop that made it).
    """
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="http-api", daemon=True)
    thread.start()

    async def start() -> HttpServer:
        return await HttpServer(make_api(), "127.0.0.1", 0, **server_options).start()

    try:
        server = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
        try:
            yield server
        finally:
            asyncio.run_coroutine_threadsafe(server.close(), loop).result(30)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
