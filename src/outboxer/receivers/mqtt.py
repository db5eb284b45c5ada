"""``mqtt://`` and ``mqtts://``: an MQTT 5 shared subscription at QoS 1, PUBACK after commit.

Each topic (an MQTT filter with ``+`` and ``#``, before ``topic_prefix``) is subscribed as
``$share/<group>/<topic_prefix><topic>``: the broker hands each message to one of the
group's clients. Acknowledgement is manual (paho's ``manual_ack``): a message's PUBACK
goes out once the transaction that applied it committed, and PUBACKs go out in the order
the messages arrived, as MQTT requires (a message done early waits for those before it).
The broker sends at most ``prefetch`` unacknowledged messages at a time (the CONNECT's
Receive Maximum), those whose PUBACK waits for an earlier message included: a message
retrying holds back every PUBACK after it, and once ``prefetch`` are held back the broker
sends nothing more until it is done (applied or dead-lettered). A message a foreign
publisher sent at QoS 0 gets no PUBACK and keeps no place in that order; at most
``prefetch`` of them wait to be received, later ones are dropped (at most once, as QoS 0).

Sessions. A client connects with Clean Start off and a session expiry (``session_expiry``,
default one day) under a stable client id, ``outboxer-<group>-<name>`` (``name`` defaults
to the host name; ``client_id`` replaces the whole id): the broker keeps what the client
had not acknowledged, and what arrives while it is away, and sends it again, in order,
when the client comes back under the same id. So give every process of a group its own
stable name, and the same one after a restart (a pod name, say): two clients with one id
take the connection from each other. Messages of a client that never comes back stay in
its session until the session expires. A message sent again this way carries the PUBLISH's
DUP flag, read as ``Incoming.redelivered``: the consumer may have died applying it, so the
runner records its attempt before its handler runs (a suspect: docs/design/consumer.md).

The URL is the relay's: host, TLS, credentials, ``topic_prefix`` and ``keepalive`` are read
by :class:`MqttPublisher`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import aiomqtt
import paho.mqtt.client as paho
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from outboxer.brokers.mqtt import (
    CONSUMER_OPTIONS,
    QOS,
    MqttPublisher,
    _Client,
    abandon,
    closed_by_broker,
    disconnect,
    received_properties,
)
from outboxer.config import whole_seconds_option
from outboxer.errors import ConfigError
from outboxer.receivers.base import Incoming, Receiver, decode, take
from outboxer.redact import get_logger

logger = get_logger("outboxer.receiver")

#: The largest Receive Maximum MQTT allows.
_RECEIVE_MAXIMUM = 65_535
#: A filter never subscribed: its UNSUBACK, before a close, proves the PUBACKs taken.
_CLOSE_BARRIER = "outboxer/close-barrier"
#: How long a close waits for that UNSUBACK.
_CLOSE_BARRIER_TIMEOUT = 2.0


class _Token(NamedTuple):
    """What a message is acknowledged with."""

    #: Arrival order on its connection (packet ids are reused once acknowledged).
    seq: int
    mid: int
    #: The QoS it was delivered at: a foreign publisher's QoS 0 message gets no PUBACK
    #: (one for packet id 0 is a protocol error: the broker drops the connection).
    qos: int


class _Received(aiomqtt.Message):
    """aiomqtt's message, plus the PUBLISH's DUP flag, which aiomqtt's own drops."""

    #: The broker sent this PUBLISH before, on an earlier connection of the session, and
    #: had no PUBACK for it (MQTT 5, 4.4: resent with DUP on reconnect): the consumer may
    #: have died applying it. A publisher's DUP is not passed on (3.3.1.1), and a message
    #: that waited in the session without being sent comes with DUP 0.
    dup: bool = False


class _ReceivingClient(_Client):
    """The client, with each PUBLISH's DUP flag kept (``_Received``) and its QoS 0 messages
    waiting to be received bounded.

    Receive Maximum bounds only QoS 1 messages: a foreign publisher's QoS 0 messages come
    as fast as the broker has them, and would pile up without end in the client's queue
    while the consumer is slower. Past ``qos0_limit`` waiting ones they are dropped, as
    QoS 0 (at most once) allows and as the broker itself does with a slow client."""

    def __init__(
        self, *args: Any, qos0_limit: int, on_drop: Callable[[], None], **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.qos0_limit = qos0_limit
        self.qos0_waiting = 0
        self._on_drop = on_drop

    def _on_message(self, client: paho.Client, userdata: Any, message: paho.MQTTMessage) -> None:
        if message.qos == 0:
            if self.qos0_waiting >= self.qos0_limit:
                self._on_drop()
                return
            self.qos0_waiting += 1
        # aiomqtt's _on_message, with the DUP flag kept (its Message has no place for it).
        received = _Received._from_paho_message(message)
        received.dup = bool(message.dup)
        try:
            self._queue.put_nowait(received)
        except asyncio.QueueFull:
            self._logger.warning("Message queue is full. Discarding message.")


class MqttReceiver(Receiver):
    """A shared subscription per topic; PUBACKs, in arrival order, after commit."""

    schemes = ("mqtt", "mqtts")
    options = CONSUMER_OPTIONS
    publisher_class = MqttPublisher
    all_topics = "#"

    def __init__(self, url: str, **options: Any) -> None:
        super().__init__(url, **options)
        if any(character in self.group for character in "/+#"):
            # MQTT 5 (4.8.2): a share name holds none of them. With a "/" the broker reads
            # the rest as the filter (the group receives another topic's messages, or
            # none); with "+" or "#" aiomqtt refuses the filter, which read as an outage
            # retried for ever.
            raise ConfigError(
                f"an MQTT consumer group (the shared subscription's name) cannot hold "
                f"'/', '+' or '#': {self.group!r:.210}"
            )
        for topic in self.topics:
            try:
                aiomqtt.Wildcard(self._mqtt.topic_prefix + topic)
            except ValueError:
                raise ConfigError(
                    f"{topic!r:.300} is not an MQTT topic filter ('+' and '#' stand for "
                    "whole levels, '#' only as the last)"
                ) from None
        self.client_id = str(
            self.settings.get("client_id") or f"outboxer-{self.group}-{self.name or 'consumer'}"
        )
        self.session_expiry = whole_seconds_option(
            self.settings.get("session_expiry", 86_400), "mqtt option session_expiry", 1, 2**32 - 1
        )
        self._client: _ReceivingClient | None = None
        #: QoS 1 messages received on this connection, in order, until their PUBACK went out.
        self._unacked: deque[_Token] = deque()
        #: Arrival numbers (``_Token.seq``) of those done, waiting for the ones before them.
        self._done: set[int] = set()
        self._arrivals = 0
        #: PUBACKs went out on this connection that no later round trip proved read.
        self._unconfirmed_acks = False
        #: QoS 0 messages dropped because too many were waiting (see ``_ReceivingClient``).
        self.qos0_dropped = 0
        #: A connect of this receiver got a session before (Clean Start off keeps it).
        self._had_session = False
        #: Reconnects that found no session: what the broker held for it was dropped.
        self.sessions_lost = 0

    @property
    def _mqtt(self) -> MqttPublisher:
        assert isinstance(self.publisher, MqttPublisher)
        return self.publisher

    def parse(self, url: str, **options: Any) -> MqttPublisher:
        return MqttPublisher(url, **options)

    async def _connect(self) -> None:
        await self._close()
        mqtt = self._mqtt
        properties = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
        properties.SessionExpiryInterval = self.session_expiry
        properties.ReceiveMaximum = min(self.prefetch, _RECEIVE_MAXIMUM)
        client = _ReceivingClient(
            mqtt.hostname,
            mqtt.port,
            username=mqtt.username,
            password=mqtt.password,
            identifier=self.client_id,
            protocol=aiomqtt.ProtocolVersion.V5,
            keepalive=mqtt.keepalive,
            timeout=min(self.connect_timeout, 10.0),
            max_inflight=mqtt.max_inflight,
            tls_context=mqtt.tls_context(),
            clean_start=False,
            properties=properties,
            qos0_limit=self.prefetch,
            on_drop=self._dropped,
        )
        client._client.manual_ack_set(True)
        self._unacked, self._done, self._arrivals = deque(), set(), 0
        self._unconfirmed_acks = False
        try:
            await client.__aenter__()
        except BaseException:
            # As for the publisher: a broker that never sends the CONNACK leaves the socket
            # open and aiomqtt's housekeeping task running, one of each per attempt.
            abandon(client)
            raise
        self._client = client
        if self._had_session and not client.session_present:
            self._session_lost()
        self._had_session = True
        for topic in self.topics:
            await client.subscribe(f"$share/{self.group}/{mqtt.topic_prefix}{topic}", qos=QOS)

    async def _close(self) -> None:
        client, self._client = self._client, None
        if client is None:
            return
        try:
            if self._unconfirmed_acks and not client.lost.is_set():
                # paho counts the connection closed once the DISCONNECT is written, but
                # Mosquitto reads one packet per socket per turn of its loop: the PUBACKs
                # may still wait unread when the same client id connects again (the next
                # connect, a restarted consumer), which takes the session over and drops
                # the old socket with them; the session then redelivers those messages.
                # The broker handles a client's packets in order, so the UNSUBACK proves
                # every PUBACK before it was taken (the filter was never subscribed: the
                # UNSUBSCRIBE changes nothing). Bounded: a dead connection only delays.
                with contextlib.suppress(aiomqtt.MqttError, OSError, asyncio.TimeoutError):
                    await client.unsubscribe(_CLOSE_BARRIER, timeout=_CLOSE_BARRIER_TIMEOUT)
        finally:
            self._unconfirmed_acks = False
            await disconnect(client)

    async def _receive(self, limit: int, timeout: float) -> list[Incoming]:
        client = self._client
        if client is None:
            raise ConnectionError("the MQTT receiver is not connected")
        try:
            messages = await take(client._queue, client.lost, limit, timeout, "the MQTT broker")
        except ConnectionError as exc:
            reason = closed_by_broker(client, self.client_id)
            if not reason:
                raise
            raise ConnectionError(f"{exc}{reason}") from None
        client.qos0_waiting -= sum(1 for message in messages if message.qos == 0)
        received = [self._incoming(message) for message in messages]
        # Only QoS 1 messages get a PUBACK, so only they keep their place in the PUBACK order.
        self._unacked.extend(i.token for i in received if i.token.qos > 0)
        return received

    def _session_lost(self) -> None:
        """The broker kept no session for a client id that had one (CONNACK Session Present
        0 on a reconnect): the messages it held for this consumer, unacknowledged or queued
        while the connection was down, are gone, without a word from the broker. The
        session expired (``session_expiry``), the broker restarted without persistence
        (Mosquitto: ``persistence false``, its default), or an administrator removed it.
        The subscriptions are made again below; the loss can only be reported."""
        self.sessions_lost += 1
        logger.warning(
            "%s: the broker kept no session for client id %r (Session Present 0 on a "
            "reconnect): the messages it held for this consumer are lost (the session "
            "expired after %ds, or the broker restarted without persistence)",
            self.safe_url,
            self.client_id,
            self.session_expiry,
        )

    def _dropped(self) -> None:
        self.qos0_dropped += 1
        if self.qos0_dropped == 1 or self.qos0_dropped % 1000 == 0:
            logger.warning(
                "%s: dropped %d QoS 0 message(s) in all: more than prefetch (%d) were waiting "
                "(publish at QoS 1 to have the broker hold them back instead)",
                self.safe_url,
                self.qos0_dropped,
                self.prefetch,
            )

    def _incoming(self, message: aiomqtt.Message) -> Incoming:
        properties = message.properties
        headers = received_properties(getattr(properties, "UserProperty", None) or [])
        correlation = getattr(properties, "CorrelationData", None)
        payload = message.payload
        incoming = decode(
            headers,
            payload if isinstance(payload, bytes) else str(payload).encode(),
            message_id=correlation.decode("ascii", "replace") if correlation else None,
            content_type=getattr(properties, "ContentType", None),
            fallback_topic=message.topic.value.removeprefix(self._mqtt.topic_prefix),
        )
        self._arrivals += 1
        incoming.token = _Token(self._arrivals, message.mid, message.qos)
        # Sent before and not acknowledged (the consumer died, or the connection did): a
        # suspect for the runner. Only QoS 1 messages can carry it (QoS 0 are never resent).
        incoming.redelivered = isinstance(message, _Received) and message.dup
        return incoming

    async def lag(self, timeout: float = 5.0) -> int | None:
        # MQTT has no way to ask a broker how many messages it holds: neither for a shared
        # subscription's group nor for a client's session (Mosquitto's $SYS topics count the
        # whole broker's messages, not a group's). Unknown, not 0.
        return None

    async def _ack(self, incomings: Sequence[Incoming]) -> None:
        client = self._client
        if client is None:
            raise ConnectionError("the MQTT receiver is not connected")
        # A QoS 0 message is done once committed: there is nothing to send for it.
        self._done.update(i.token.seq for i in incomings if i.token.qos > 0)
        # PUBACKs in the order the messages came (MQTT 5, 4.6): up to the first not done.
        while self._unacked and self._unacked[0].seq in self._done:
            token = self._unacked.popleft()
            self._done.discard(token.seq)
            code = client._client.ack(token.mid, token.qos)
            self._unconfirmed_acks = True
            if code != paho.MQTT_ERR_SUCCESS:
                raise ConnectionError(f"PUBACK not sent: {paho.error_string(code)}")


__all__ = ["MqttReceiver"]
