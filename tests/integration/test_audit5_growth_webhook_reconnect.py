"""A webhook publisher's reconnect leaves no HTTP connection behind.

A wave holds more requests than ``max_connections``: the rest wait for a connection. When
another relay loop reconnects the shared publisher meanwhile (an endpoint that refused a
connection, then came back), the old connections are closed; a request that was still
waiting then got a client of its own from the closed set, sent its message and kept the
connection open: nobody closed it, ``close()`` neither. One more socket per waiting request
and reconnect, for as long as the receiver keeps idle connections alive.
"""

from __future__ import annotations

import asyncio
import uuid

from outboxer.brokers import create_publisher
from outboxer.testing import eventually, make_message
from tests.integration.test_broker_connect_leaks import open_client_sockets
from tests.integration.test_broker_webhook import HookServer

WAITING = 3


async def test_requests_that_waited_through_a_reconnect_leave_no_connection_open() -> None:
    server = await HookServer(delay=0.3).start()  # keeps every connection alive
    publisher = create_publisher(f"{server.url}/hook?max_connections=1", publish_timeout=10)
    try:
        await publisher.connect()
        messages = [
            make_message("orders", {"n": n}, key=str(uuid.uuid4())) for n in range(1 + WAITING)
        ]
        wave = asyncio.create_task(publisher.publish_batch(messages))  # one wave: distinct keys

        async def first_request_in() -> bool:
            return server.in_flight == 1

        await eventually(first_request_in, timeout=5, interval=0.01)
        await publisher.close()  # what a reconnect by another loop does first ...
        await publisher.connect()  # ... then connects anew
        outcomes = await wave
        assert sum(outcome.published for outcome in outcomes) >= WAITING
        await publisher.close()

        async def nothing_open() -> bool:
            return open_client_sockets(server.port) == 0

        await eventually(nothing_open, timeout=1, interval=0.02)
    finally:
        await publisher.close()
        await server.stop()


async def test_a_reconnect_does_not_cut_the_requests_in_flight() -> None:
    """Another loop's reconnect (after its request could not connect) closed every client,
    those of requests going well included: each failed (ReadError), its attempt counted,
    though the receiver may have applied it. Only the idle connections are stale."""
    server = await HookServer(delay=0.3).start()
    publisher = create_publisher(f"{server.url}/hook?max_connections=2", publish_timeout=10)
    try:
        await publisher.connect()
        messages = [make_message("orders", {"n": n}, key=str(uuid.uuid4())) for n in range(2)]
        wave = asyncio.create_task(publisher.publish_batch(messages))

        async def both_in() -> bool:
            return server.in_flight == 2

        await eventually(both_in, timeout=5, interval=0.01)
        await publisher.close()  # what a reconnect by another loop does first ...
        await publisher.connect()  # ... then connects anew
        outcomes = await wave
        assert [outcome.error for outcome in outcomes] == [None, None]
        assert len(server.requests) == 2
    finally:
        await publisher.close()
        await server.stop()
