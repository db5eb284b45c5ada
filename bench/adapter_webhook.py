"""Adapter-only throughput of WebhookPublisher: messages/s through ``publish_batch``.

    .venv/bin/python bench/adapter_webhook.py --messages 20000 --keys 1000 --batch 500

Without ``--url`` it starts a minimal keep-alive HTTP/1.1 receiver (answers 204
at once) in a child process on 127.0.0.1, so publisher and receiver do not share
an event loop; on a small machine the receiver's share of the CPU counts too.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import re
import socket
import uuid

from adapter_redis import arguments, measure  # the shared bench harness
from outboxer.brokers.webhook import WebhookPublisher

_LENGTH = re.compile(rb"content-length:\s*(\d+)", re.IGNORECASE)


async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while head := await reader.readuntil(b"\r\n\r\n"):
            found = _LENGTH.search(head)
            await reader.readexactly(int(found.group(1)) if found else 0)
            writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()


def _receiver(sock: socket.socket) -> None:
    async def serve() -> None:
        server = await asyncio.start_server(_answer, sock=sock)
        await server.serve_forever()

    asyncio.run(serve())


async def main() -> None:
    parser = arguments("WebhookPublisher throughput", "")
    parser.add_argument("--max-connections", type=int, default=64)
    parser.add_argument("--secret", default="bench-secret", help="sign requests ('' to not sign)")
    args = parser.parse_args()
    child = None
    if not args.url:
        sock = socket.create_server(("127.0.0.1", 0))
        args.url = f"http://127.0.0.1:{sock.getsockname()[1]}/hook"
        child = multiprocessing.Process(target=_receiver, args=(sock,), daemon=True)
        child.start()
    try:
        publisher = WebhookPublisher(
            args.url, secret=args.secret or None, max_connections=args.max_connections
        )
        await measure(publisher, args, f"bench.{uuid.uuid4().hex[:8]}")
    finally:
        if child is not None:
            child.terminate()
            child.join()


if __name__ == "__main__":
    asyncio.run(main())
