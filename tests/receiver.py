"""A webhook receiver for relay tests: a real HTTP/1.1 server on 127.0.0.1, served by
threads of the test process, so it answers while the test's event loop waits (and while
a relay in another process publishes to it).

Each request is recorded as a Delivery, then answered as the test's ``answer`` says.
"""

from __future__ import annotations

import http.server
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from outboxer.brokers.webhook import decode_header_value


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):  # a relay cancelled or killed
            super().handle_error(request, client_address)


@dataclass(frozen=True)
class Delivery:
    """One request as the receiver saw it."""

    id: str
    key: str | None
    body: bytes
    #: time.monotonic() when the request arrived, and when the receiver answered it.
    arrived: float
    answered: float


#: What the receiver says to one request: HTTP status and body.
Answer = tuple[int, bytes]


def accept(_: Delivery) -> Answer:
    return 200, b"ok"


@dataclass
class Receiver:
    """Records every request, then answers it after ``delay`` seconds with ``answer(...)``."""

    answer: Callable[[Delivery], Answer] = accept
    delay: float = 0.0
    deliveries: list[Delivery] = field(default_factory=list)
    _server: _Server | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        assert self._server is not None, "start() the receiver first"
        return f"http://127.0.0.1:{self._server.server_address[1]}/hook"

    def start(self) -> Receiver:
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as a real receiver

            def do_POST(self) -> None:  # the name http.server calls
                arrived = time.monotonic()
                length = int(self.headers.get("Content-Length", "0"))
                body = self.rfile.read(length)
                if len(body) < length:  # the relay went away mid-request: not delivered
                    self.close_connection = True
                    return
                key = self.headers.get("Outboxer-Key")
                if receiver.delay:
                    time.sleep(receiver.delay)
                delivery = Delivery(
                    id=self.headers.get("Outboxer-Id", ""),
                    key=decode_header_value(key) if key is not None else None,
                    body=body,
                    arrived=arrived,
                    answered=time.monotonic(),
                )
                with receiver._lock:
                    receiver.deliveries.append(delivery)
                status, answer = receiver.answer(delivery)
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "text/plain; charset=utf-8")
                    self.send_header("Content-Length", str(len(answer)))
                    self.end_headers()
                    self.wfile.write(answer)
                except ConnectionError:
                    self.close_connection = True  # the relay gave up (cancelled, or died)

            def log_message(self, *args: Any) -> None:
                return None  # the test asserts on deliveries, not on an access log

        self._server = _Server(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def received(self) -> list[Delivery]:
        with self._lock:
            return list(self.deliveries)
