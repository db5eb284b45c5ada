"""``mqtt://`` and ``mqtts://``: an MQTT 5 shared subscription at QoS 1, PUBACK after commit.

Each topic (an MQTT filter with ``+`` and ``#``, before ``topic_prefix``) is subscribed as
``$share/<group>/<topic_prefix><topic>``: the broker hands each message to one of the
group's clients. Acknowledgement is manual (paho's ``manual_ack``): a message's PUBACK
goes out once the transaction that applied it committed, and PUBACKs go out in the order
the messages arrived, as MQTT requires (a message done early waits for those before it).
The broker sends at most ``prefetch`` unacknowledged messages at a time (the CONNECT's
Receive Maximum).

Sessions. A client connects with Clean Start off and a session expiry (``session_expiry``,
default one day) under a stable client id, ``outboxer-<group>-<name>`` (``name`` defaults
to the host name; ``client_id`` replaces the whole id): the broker keeps what the client
had not acknowledged, and what arrives while it is away, and sends it again, in order,
when the client comes back under the same id. So give every process of a group its own
stable name, and the same one after a restart (a pod name, say): two clients with one id
take the connection from each other. Messages of a client that never comes back stay in
its session until the session expires.

The URL is the relay's: host, TLS, credentials, ``topic_prefix`` and ``keepalive`` are read
by :class:`MqttPublisher`.
"""

from __future__ import annotations

import ssl
from collections import deque
from collections.abc import Sequence
from typing import Any

import aiomqtt
import paho.mqtt.client as paho
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from outboxer.brokers.mqtt import QOS, MqttPublisher, _Client, disconnect
from outboxer.config import int_option
from outboxer.receivers.base import Incoming, Receiver, decode, take

#: The largest Receive Maximum MQTT allows.
_RECEIVE_MAXIMUM = 65_535


class MqttReceiver(Receiver):
    """A shared subscription per topic; PUBACKs, in arrival order, after commit."""

    schemes = ("mqtt", "mqtts")
    options = ("client_id", "session_expiry")
    all_topics = "#"

    def __init__(self, url: str, **options: Any) -> None:
        super().__init__(url, **options)
        self.client_id = str(
            self.settings.get("client_id") or f"outboxer-{self.group}-{self.name or 'consumer'}"
        )
        self.session_expiry = int_option(
            self.settings.get("session_expiry", 86_400), "mqtt option session_expiry", 1, 2**32 - 1
        )
        self._client: _Client | None = None
        #: Messages received on this connection, in order, until their PUBACK went out.
        self._unacked: deque[Incoming] = deque()
        self._done: set[int] = set()

    @property
    def _mqtt(self) -> MqttPublisher:
        assert isinstance(self.publisher, MqttPublisher)
        return self.publisher

    def parse(self, url: str) -> MqttPublisher:
        return MqttPublisher(url)

    async def _connect(self) -> None:
        await self._close()
        mqtt = self._mqtt
        properties = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
        properties.SessionExpiryInterval = self.session_expiry
        properties.ReceiveMaximum = min(self.prefetch, _RECEIVE_MAXIMUM)
        client = _Client(
            mqtt.hostname,
            mqtt.port,
            username=mqtt.username,
            password=mqtt.password,
            identifier=self.client_id,
            protocol=aiomqtt.ProtocolVersion.V5,
            keepalive=mqtt.keepalive,
            timeout=min(self.connect_timeout, 10.0),
            max_inflight=mqtt.max_inflight,
            tls_context=ssl.create_default_context() if mqtt.tls else None,
            clean_start=False,
            properties=properties,
        )
        client._client.manual_ack_set(True)
        self._unacked, self._done = deque(), set()
        await client.__aenter__()
        self._client = client
        for topic in self.topics:
            await client.subscribe(f"$share/{self.group}/{mqtt.topic_prefix}{topic}", qos=QOS)

    async def _close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await disconnect(client)

    async def _receive(self, limit: int, timeout: float) -> list[Incoming]:
        client = self._client
        if client is None:
            raise ConnectionError("the MQTT receiver is not connected")
        messages = await take(client._queue, client.lost, limit, timeout, "the MQTT broker")
        received = [self._incoming(message) for message in messages]
        self._unacked.extend(received)
        return received

    def _incoming(self, message: aiomqtt.Message) -> Incoming:
        properties = message.properties
        headers = dict(getattr(properties, "UserProperty", None) or [])
        correlation = getattr(properties, "CorrelationData", None)
        payload = message.payload
        incoming = decode(
            headers,
            payload if isinstance(payload, bytes) else str(payload).encode(),
            message_id=correlation.decode("ascii", "replace") if correlation else None,
            content_type=getattr(properties, "ContentType", None),
            fallback_topic=message.topic.value.removeprefix(self._mqtt.topic_prefix),
        )
        incoming.token = message.mid
        return incoming

    async def _ack(self, incomings: Sequence[Incoming]) -> None:
        client = self._client
        if client is None:
            raise ConnectionError("the MQTT receiver is not connected")
        self._done.update(id(incoming) for incoming in incomings)
        # PUBACKs in the order the messages came (MQTT 5, 4.6): up to the first not done.
        while self._unacked and id(self._unacked[0]) in self._done:
            incoming = self._unacked.popleft()
            self._done.discard(id(incoming))
            code = client._client.ack(incoming.token, QOS)
            if code != paho.MQTT_ERR_SUCCESS:
                raise ConnectionError(f"PUBACK not sent: {paho.error_string(code)}")


__all__ = ["MqttReceiver"]
