"""A TCP proxy that delays, stalls or cuts the connections through it, on command.

It runs its own asyncio loop in a thread, so a test can command it from plain blocking
code while relays (separate processes) talk through it. Bytes are never lost or
reordered by a delay or a stall, only held: a delay holds each chunk for a fixed time
after it was read (so latency grows, throughput does not shrink), a stall holds
everything until ``resume()``. ``cut()`` aborts every open connection (both sides see a
reset) and keeps accepting new ones, as when a broker's network drops its sessions.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine
from typing import Any


class FaultProxy:
    """Forwards ``127.0.0.1:port`` to ``target_host:target_port``."""

    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.target_host = target_host
        self.target_port = target_port
        self.port = 0
        self.connections = 0
        self.cuts = 0
        self._delay = 0.0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None
        self._flowing: asyncio.Event | None = None
        self._transports: set[asyncio.WriteTransport] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    # ----- commands (from any thread) ------------------------------------------------------

    def start(self) -> FaultProxy:
        self._thread.start()
        self._call(self._start())
        return self

    def delay(self, seconds: float) -> None:
        """Hold every chunk, each direction, ``seconds`` after it was read (0: none)."""
        self._delay = seconds

    def stall(self) -> None:
        """Forward nothing, either way, until ``resume()``; connections stay open."""
        self._loop.call_soon_threadsafe(self._require_flowing().clear)

    def resume(self) -> None:
        self._loop.call_soon_threadsafe(self._require_flowing().set)

    def cut(self) -> int:
        """Abort every open connection; returns how many there were."""
        self.cuts += 1
        return int(self._call(self._cut()))

    def stop(self) -> None:
        if self._thread.is_alive():
            self._call(self._stop())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        self._loop.close()

    # ----- the loop's side -----------------------------------------------------------------

    def _call(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(30)

    def _require_flowing(self) -> asyncio.Event:
        assert self._flowing is not None, "start() the proxy first"
        return self._flowing

    async def _start(self) -> None:
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _accept(
        self, client_in: asyncio.StreamReader, client_out: asyncio.StreamWriter
    ) -> None:
        try:
            server_in, server_out = await asyncio.open_connection(
                self.target_host, self.target_port
            )
        except OSError:
            client_out.transport.abort()
            return
        self.connections += 1
        for writer in (client_out, server_out):
            self._transports.add(writer.transport)
        for source, sink in ((client_in, server_out), (server_in, client_out)):
            task = asyncio.create_task(self._forward(source, sink))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _forward(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        """Read chunks as they come; a second task writes each once its delay has passed."""
        held: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        writer = asyncio.create_task(self._release(held, sink))
        self._tasks.add(writer)
        writer.add_done_callback(self._tasks.discard)
        try:
            while chunk := await source.read(65536):
                held.put_nowait((time.monotonic() + self._delay, chunk))
        except (ConnectionError, OSError):
            pass  # this side reset the connection: aborting the other side passes that on
        finally:
            if sink.transport.is_closing():  # cut: what is still held goes nowhere
                writer.cancel()
            else:  # the source closed: what it sent before still arrives, then the close
                held.put_nowait((0.0, b""))
            await asyncio.gather(writer, return_exceptions=True)
            self._transports.discard(sink.transport)
            sink.transport.abort()

    async def _release(
        self, held: asyncio.Queue[tuple[float, bytes]], sink: asyncio.StreamWriter
    ) -> None:
        flowing = self._require_flowing()
        while True:
            due, chunk = await held.get()
            if not chunk:
                return
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            await flowing.wait()
            sink.write(chunk)
            await sink.drain()

    async def _cut(self) -> int:
        transports, self._transports = self._transports, set()
        for transport in transports:
            transport.abort()
        return len(transports) // 2

    async def _stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        await self._cut()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
