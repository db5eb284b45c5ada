"""A broker that hands a client's session to a newer connection under the same client id
says so (MQTT 5 DISCONNECT, reason 0x8E, as Mosquitto >= 2.0.15, EMQX and HiveMQ send it):
the relay's publish error and the consumer's lost connection name the cause and the id,
where both read as a bare lost connection before, repeated at every reconnect while two
processes fought over one id. The local Mosquitto (2.0.11) closes the connection without
that DISCONNECT, so a few lines of MQTT on a loopback socket play the broker here."""

from __future__ import annotations

import asyncio
import contextlib
import struct

import pytest

from outboxer.brokers.mqtt import MqttPublisher
from outboxer.errors import BrokerUnavailableError
from outboxer.receivers import create_receiver
from outboxer.testing import make_message

CONNACK = bytes([0x20, 3, 0, 0, 0])  # session not present, success, no properties
TAKEN_OVER = bytes([0xE0, 2, 0x8E, 0])  # DISCONNECT, Session taken over, no properties


async def _packet(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    first = (await reader.readexactly(1))[0]
    length, shift = 0, 0
    while True:
        byte = (await reader.readexactly(1))[0]
        length |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            break
    return first, await reader.readexactly(length)


def _suback(body: bytes) -> bytes:
    """A SUBACK granting QoS 1 to every filter of a SUBSCRIBE's ``body``."""
    packet_id, position = body[:2], 2
    properties, shift = 0, 0
    while True:  # the properties' length (a variable byte integer), then the properties
        byte = body[position]
        position += 1
        properties |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            break
    position += properties
    filters = 0
    while position < len(body):
        (size,) = struct.unpack_from("!H", body, position)
        position += 2 + size + 1
        filters += 1
    payload = packet_id + b"\x00" + bytes([1]) * filters
    return bytes([0x90, len(payload)]) + payload


class TakingOverBroker:
    """Answers CONNECT and SUBSCRIBE, then sends each client DISCONNECT 0x8E."""

    def __init__(self) -> None:
        self.connected = asyncio.Event()
        self.take_over = asyncio.Event()
        self.port = 0
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> TakingOverBroker:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._server is not None
        self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            kind, _ = await _packet(reader)
            assert kind >> 4 == 1  # CONNECT
            writer.write(CONNACK)
            await writer.drain()
            taking_over = asyncio.ensure_future(self.take_over.wait())
            self.connected.set()
            while not taking_over.done():
                read = asyncio.ensure_future(_packet(reader))
                await asyncio.wait({read, taking_over}, return_when=asyncio.FIRST_COMPLETED)
                if not read.done():
                    read.cancel()
                    break
                kind, body = read.result()
                if kind >> 4 == 8:  # SUBSCRIBE
                    writer.write(_suback(body))
                    await writer.drain()
            writer.write(TAKEN_OVER)
            await writer.drain()
        writer.close()


async def test_the_relay_s_publish_error_names_the_taken_over_session() -> None:
    async with TakingOverBroker() as broker:
        publisher = MqttPublisher(f"mqtt://127.0.0.1:{broker.port}", client_id="relay-a16")
        await publisher.connect()
        try:
            broker.take_over.set()
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 5.0
            while not publisher._transport_lost() and loop.time() < deadline:
                await asyncio.sleep(0.01)
            [outcome] = await publisher.publish_batch([make_message("a16/x", {"n": 1})])
        finally:
            await publisher.close()
    assert not outcome.published
    text = str(outcome.error)
    assert "another client" in text and "'relay-a16'" in text and "0x8e" in text


async def test_the_consumer_s_lost_connection_names_the_taken_over_session() -> None:
    async with TakingOverBroker() as broker:
        url = f"mqtt://127.0.0.1:{broker.port}?client_id=consumer-a16"
        receiver = create_receiver(url, group="g", topics=["a16/x"])
        await receiver.connect()
        try:
            broker.take_over.set()
            with pytest.raises(BrokerUnavailableError) as caught:
                for _ in range(50):
                    await receiver.receive(10, 0.1)
        finally:
            await receiver.close()
    text = str(caught.value)
    assert "another client" in text and "'consumer-a16'" in text and "0x8e" in text
