"""``mqtt://`` and ``mqtts://``: MQTT v5 PUBLISH at QoS 1, confirmed by the broker's PUBACK.

A message is confirmed once the broker answered its PUBLISH with a PUBACK whose
reason code is a success (below 0x80; 0x10 "no matching subscribers" included).
QoS 2 is not offered: paho ignores the reason code of a PUBREC, so a refusal
would go unseen, and a relay's re-publish is a new message to MQTT anyway. aiomqtt's own ``publish`` ignores the reason code, so this
adapter publishes through aiomqtt's paho client and reads each PUBACK's reason
code itself.

The envelope travels as MQTT v5 properties: Content Type, Correlation Data (the
outbox id) and one User Property per envelope header (``outboxer-id``,
``outboxer-topic``, ``outboxer-key``, ``content-type``, user headers …).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import re
import ssl
import uuid
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import quote, unquote

import aiomqtt
import paho.mqtt.client as paho
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from outboxer.brokers import resolve
from outboxer.brokers.base import AckedPublisher, option_bool, parse_options
from outboxer.brokers.tlsfiles import TLS_FILE_OPTIONS, client_context, tls_files
from outboxer.config import int_option, whole_seconds_option
from outboxer.errors import ConfigError, PublishError
from outboxer.message import Message
from outboxer.redact import redact_url

#: PUBACK reason codes that may clear up later (broker busy, over quota); the rest are final.
RETRYABLE_REASONS = frozenset({0x80, 0x83, 0x89, 0x91, 0x96, 0x97})


def _decode_every_failure_in_a_puback() -> None:
    """Let paho decode a PUBACK with any failure reason code it knows.

    paho takes a PUBACK whose reason code MQTT 5 does not list for PUBACK as a malformed
    packet and drops the connection. Mosquitto answers a PUBLISH over its
    ``message_size_limit`` (which it does not advertise as a Maximum Packet Size) with
    0x95 "Packet too large": the connection went, every message of the wave failed as
    "connection lost", and the oversized one did it again at every retry. A failure code
    is a refusal of that one message whatever its packet; paho's table is shared, so this
    widens it for the whole process (decoding only what it dropped the connection on).
    The table is a class attribute from paho-mqtt 2.2 on (2.1 built one per code): hence
    the extra's lower bound."""
    for value, names in ReasonCode.names.items():
        if value >= 0x80 and not any(PacketTypes.PUBACK in kinds for kinds in names.values()):
            next(iter(names.values())).append(PacketTypes.PUBACK)


_decode_every_failure_in_a_puback()
QOS = 1
#: Fixed header (at most 5 bytes), packet id (2) and topic length prefix (2) around a PUBLISH.
_PUBLISH_OVERHEAD = 9


#: MQTT carries the keepalive and the receive maximum in two bytes: a larger keepalive failed
#: every connect inside paho ("'H' format requires …"), which read as an outage for ever.
_TWO_BYTES = 65_535
#: The DISCONNECT reason code of a broker that gave the client's session to a newer
#: connection under the same client id (MQTT 5, 3.14.2.1).
_SESSION_TAKEN_OVER = 0x8E


class _Client(aiomqtt.Client):
    """aiomqtt's client, plus each PUBACK's reason code and the CONNACK's limits."""

    def __init__(self, *args: Any, max_inflight: int, **kwargs: Any) -> None:
        super().__init__(*args, max_inflight_messages=max_inflight, **kwargs)
        self.max_inflight = max_inflight
        self.acks: dict[int, asyncio.Future[ReasonCode]] = {}
        self.lost = asyncio.Event()
        #: The reason code of the broker's DISCONNECT, if it sent one (MQTT 5).
        self.disconnect_reason: ReasonCode | None = None
        self.receive_maximum: int | None = None
        self.maximum_packet_size: int | None = None
        #: The CONNACK's Session Present flag: the broker resumed a session it kept.
        self.session_present = False

    def _on_connect(
        self,
        client: paho.Client,
        userdata: Any,
        flags: paho.ConnectFlags,
        reason_code: ReasonCode,
        properties: Properties | None = None,
    ) -> None:
        self.session_present = bool(getattr(flags, "session_present", False))
        if properties is not None:
            self.receive_maximum = getattr(properties, "ReceiveMaximum", None)
            self.maximum_packet_size = getattr(properties, "MaximumPacketSize", None)
        if self.receive_maximum and self.receive_maximum < self.max_inflight:
            # Keep within the broker's Receive Maximum (paho does not; its setter refuses once
            # connected, and nothing is in flight before the CONNACK); paho queues the rest.
            client._max_inflight_messages = self.receive_maximum
        super()._on_connect(client, userdata, flags, reason_code, properties)

    def _on_publish(
        self,
        client: paho.Client,
        userdata: Any,
        mid: int,
        reason_code: ReasonCode,
        properties: Properties,
    ) -> None:
        future = self.acks.pop(mid, None)
        if future is not None and not future.done():
            future.set_result(reason_code)
        super()._on_publish(client, userdata, mid, reason_code, properties)

    def _on_disconnect(
        self,
        client: paho.Client,
        userdata: Any,
        flags: paho.DisconnectFlags,
        reason_code: ReasonCode,
        properties: Properties | None = None,
    ) -> None:
        if flags.is_disconnect_packet_from_server:
            self.disconnect_reason = reason_code
        self.lost.set()
        super()._on_disconnect(client, userdata, flags, reason_code, properties)

    def send(
        self, topic: str, payload: bytes, retain: bool, properties: Properties
    ) -> asyncio.Future[ReasonCode]:
        """Hand one QoS 1 PUBLISH to paho; the future gets the PUBACK's reason code."""
        info = self._client.publish(topic, payload, QOS, retain, properties)
        if info.rc != paho.MQTT_ERR_SUCCESS:
            raise aiomqtt.MqttCodeError(info.rc, "could not publish")
        future: asyncio.Future[ReasonCode] = asyncio.get_running_loop().create_future()
        self.acks[info.mid] = future
        return future

    @property
    def disconnected(self) -> asyncio.Future[None]:
        return self._disconnected


async def disconnect(client: _Client) -> None:
    """Disconnect ``client`` (also the consumer side's, outboxer.receivers.mqtt)."""
    for future in client.acks.values():
        future.cancel()
    client.acks.clear()
    # A broken connection has nothing left to disconnect gracefully.
    with contextlib.suppress(aiomqtt.MqttError, OSError, asyncio.TimeoutError):
        await client.__aexit__(None, None, None)
    if client.disconnected.done() and not client.disconnected.cancelled():
        client.disconnected.exception()  # retrieved: a lost connection was already reported


def closed_by_broker(client: _Client | None, client_id: str) -> str:
    """Why the broker closed the connection, when its DISCONNECT said (else "")."""
    reason = None if client is None else client.disconnect_reason
    if reason is None:
        return ""
    if reason.value == _SESSION_TAKEN_OVER:
        return (
            f": the broker handed its session to another client that connected with client "
            f"id {client_id!r} (0x8e); each process needs an id of its own"
        )
    return f": the broker closed it: {reason} (0x{reason.value:02x})"


def abandon(client: _Client) -> None:
    """Release what a client whose connect failed still holds: its socket (unregistered
    from the event loop, which also stops aiomqtt's housekeeping task) and paho's socket
    pair. aiomqtt's own ``__aexit__`` would wait its whole timeout for a DISCONNECT
    acknowledgement that a never-connected client does not get."""
    client._client._reset_sockets()  # paho has no public close for a client never connected


#: Code points an MQTT string should not hold (MQTT 5, 1.5.4): control characters and
#: non-characters. Mosquitto closes the connection on a PUBLISH holding one, so a header
#: value with a tab or a line break failed its whole wave, and itself again at every retry.
_UNSAFE = re.compile(
    "[\x00-\x1f\x7f-\x9f\ufdd0-\ufdef"
    + "".join(chr(plane << 16 | 0xFFFE) + chr(plane << 16 | 0xFFFF) for plane in range(17))
    + "]"
)
#: A user property MQTT cannot carry as it is travels under this prefix, name and value
#: percent-encoded (UTF-8).
ESCAPED_PREFIX = "outboxer-header-"
#: The longest topic name MQTT carries: its length prefix is two bytes.
MAX_TOPIC_BYTES = _TWO_BYTES


@functools.lru_cache(maxsize=4096)  # the relay asks per message; topics repeat
def topic_problem(topic: str) -> str | None:
    """Why ``topic`` cannot be the topic name of a PUBLISH (None: it can). Its levels may be
    empty (``a//b``); a wildcard is for subscriptions only; a control character or a
    non-character makes Mosquitto close the connection, which failed every message of the
    wave as "connection lost" (retried, with the offending one, for ever)."""
    if not topic:
        return "it is empty"
    if "+" in topic or "#" in topic:
        return "it holds a wildcard ('+' or '#'), which only a subscription may"
    if (found := _UNSAFE.search(topic)) is not None:
        return (
            f"it holds {found.group()!r} at index {found.start()}: MQTT topic names must not "
            "hold control characters or non-characters"
        )
    try:
        size = len(topic.encode())
    except UnicodeEncodeError as exc:
        return f"it holds a lone surrogate {topic[exc.start]!r} at index {exc.start}"
    if size > MAX_TOPIC_BYTES:
        return f"it is {size} bytes in UTF-8, over MQTT's {MAX_TOPIC_BYTES}"
    return None


def _user_properties(message: Message) -> list[tuple[str, str]]:
    carried = []
    for name, value in message.envelope_headers().items():
        if _UNSAFE.search(name) or _UNSAFE.search(value):
            name, value = ESCAPED_PREFIX + quote(name, safe=""), quote(value, safe="")
        carried.append((name, value))
    return carried


def received_properties(pairs: Iterable[tuple[str, str]]) -> dict[str, str]:
    """A delivery's User Properties as envelope and user headers (``_user_properties``'s
    inverse)."""
    carried = {}
    for name, value in pairs:
        if name.startswith(ESCAPED_PREFIX):
            carried[unquote(name[len(ESCAPED_PREFIX) :])] = unquote(value)
        else:
            carried[name] = value
    return carried


def publish_properties(message: Message) -> Properties:
    """MQTT v5 PUBLISH properties carrying ``message``'s envelope."""
    properties = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    properties.ContentType = message.content_type
    properties.CorrelationData = str(message.id).encode()
    properties.UserProperty = _user_properties(message)
    return properties


#: The consumer's own URL options (outboxer.receivers.mqtt), accepted on the relay's side
#: too: one URL serves both (the relay takes ``client_id`` as its ids' prefix).
CONSUMER_OPTIONS = ("client_id", "session_expiry")


class MqttPublisher(AckedPublisher[ReasonCode]):
    """Publishes each message to the MQTT topic ``topic_prefix + destination``."""

    schemes = ("mqtt", "mqtts")
    url_options = frozenset(
        (
            "topic_prefix",
            "retain",
            "keepalive",
            "max_inflight",
            *TLS_FILE_OPTIONS,
            *CONSUMER_OPTIONS,
        )
    )

    def __init__(
        self,
        url: str,
        *,
        routes: Mapping[str, str] | None = None,
        publish_timeout: float = 30.0,
        topic_prefix: str | None = None,
        retain: bool | None = None,
        client_id: str | None = None,
        keepalive: int | None = None,
        max_inflight: int | None = None,
        cafile: str | None = None,
        certfile: str | None = None,
        keyfile: str | None = None,
    ) -> None:
        super().__init__(url, routes=routes, publish_timeout=publish_timeout)
        parts, options = parse_options(url)
        if not parts.hostname:
            raise ConfigError(f"MQTT URL needs a host: {redact_url(url)!r} (mqtt://127.0.0.1:1883)")
        self.hostname: str = parts.hostname
        self.tls = parts.scheme == "mqtts"
        files = tls_files(options, {"cafile": cafile, "certfile": certfile, "keyfile": keyfile})
        if files and not self.tls:  # else ignored: the connection would be plaintext
            raise ConfigError(f"mqtt option {', '.join(files)}: TLS needs an mqtts:// URL")
        #: Made now when files are given (a bad one is a ConfigError at start), else at the
        #: first connect: the system's CA certificates take a while to load.
        self._tls_context = client_context("mqtt", files) if files else None
        self.port = parts.port or (8883 if self.tls else 1883)
        self.username = parts.username
        self.password = parts.password
        self.topic_prefix = (
            topic_prefix if topic_prefix is not None else options.get("topic_prefix", "")
        )
        if self.topic_prefix and (problem := topic_problem(self.topic_prefix)) is not None:
            raise ConfigError(
                f"mqtt option topic_prefix {self.topic_prefix!r:.200} is not a valid MQTT "
                f"topic name: {problem}"
            )
        for topic, route in self.routes.items():
            if (problem := topic_problem(self.topic_prefix + route)) is not None:
                raise ConfigError(
                    f"route for topic {topic!r:.200}: {self.topic_prefix + route!r:.200} is "
                    f"not a valid MQTT topic name: {problem}"
                )
        self.retain = option_bool(options, "retain", retain, False)
        # Each publisher connects under an id of its own. The URL's client_id is a prefix,
        # not the id: the URL is shared by every relay replica and by the consumers
        # (outboxer.receivers.mqtt reads the same option as a consumer's stable id). Two
        # clients with one id take the connection from each other for ever, and a relay
        # (Clean Start on) taking a consumer's id wiped that consumer's session: the
        # messages the broker held for it were lost. ``client_id=`` is the exact id.
        prefix = options.get("client_id") or "outboxer"
        self.client_id = client_id or f"{prefix}-{uuid.uuid4().hex[:12]}"
        self.keepalive = whole_seconds_option(
            keepalive if keepalive is not None else options.get("keepalive") or 60,
            "mqtt option keepalive",
            1,
            _TWO_BYTES,
        )
        self.max_inflight = int_option(
            max_inflight if max_inflight is not None else options.get("max_inflight") or 1000,
            "mqtt option max_inflight",
            1,
            _TWO_BYTES,
        )
        self._client: _Client | None = None

    def topic_for(self, message: Message) -> str:
        return self.topic_prefix + self.destination_for(message)

    def tls_context(self) -> ssl.SSLContext | None:
        """The context of an mqtts:// URL (verifying, against ``cafile`` if given); None for
        mqtt://. The consumer side (outboxer.receivers.mqtt) connects with it too."""
        if self.tls and self._tls_context is None:
            self._tls_context = ssl.create_default_context()
        return self._tls_context

    async def _connect(self) -> None:
        await self._close()
        timeout = min(self.publish_timeout, 10.0)
        # paho looks the name up inside the blocking connect that aiomqtt runs on asyncio's
        # default executor, where a lookup a DNS outage holds outlives the connect's
        # timeout: a thread per attempt, and the relay's exit (asyncio.run joins that
        # executor) waited for them. A name that hangs fails the attempt here first.
        await resolve.looked_up(self.hostname, self.port, timeout)
        client = _Client(
            self.hostname,
            self.port,
            username=self.username,
            password=self.password,
            identifier=self.client_id,
            protocol=aiomqtt.ProtocolVersion.V5,
            keepalive=self.keepalive,
            timeout=timeout,
            max_inflight=self.max_inflight,
            tls_context=self.tls_context(),
        )
        try:
            await client.__aenter__()
        except BaseException:
            # A broker that takes the TCP connection but never sends the CONNACK (hung,
            # partitioned) makes aiomqtt give up with the socket still open and its
            # housekeeping task running: one of each leaked per reconnect attempt.
            abandon(client)
            raise
        self._client = client

    async def _close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await disconnect(client)

    def _refusal(self, topic: str, reason: ReasonCode) -> PublishError:
        return PublishError(
            f"broker refused PUBLISH to {topic!r}: {reason} (0x{reason.value:02x})",
            retryable=reason.value in RETRYABLE_REASONS,
        )

    # ----- primitives of AckedPublisher -----------------------------------------------------

    def _connection_lost_event(self) -> asyncio.Event | None:
        return None if self._client is None else self._client.lost

    def _transport_lost(self) -> bool:
        client = self._client
        return client is None or client.lost.is_set()

    async def _send(self, message: Message) -> asyncio.Future[ReasonCode]:
        client = self._client
        if client is None:
            raise self._connection_error("is not open")
        topic = self.topic_for(message)
        if (problem := topic_problem(topic)) is not None:
            # Decided before sending: the broker would drop the connection, and the wave.
            raise PublishError(f"cannot publish to {topic!r:.200}: {problem}", retryable=False)
        properties = publish_properties(message)
        if client.maximum_packet_size:  # a broker drops the connection on a larger packet
            packed_properties = properties.pack()  # type: ignore[no-untyped-call]
            size = (
                _PUBLISH_OVERHEAD
                + len(topic.encode())
                + len(message.payload)
                + len(packed_properties)
            )
            if size > client.maximum_packet_size:
                raise PublishError(
                    f"PUBLISH of {size} bytes exceeds the broker's maximum packet size "
                    f"of {client.maximum_packet_size} bytes",
                    retryable=False,
                )
        try:
            return client.send(topic, message.payload, self.retain, properties)
        except ValueError as exc:  # paho: wildcard in the topic, topic or payload too long
            raise PublishError(f"cannot publish to {topic!r}: {exc}", retryable=False) from exc

    def _ack_error(self, message: Message, ack: ReasonCode) -> BaseException | None:
        return self._refusal(self.topic_for(message), ack) if ack.is_failure else None

    def _connection_error(self, detail: str) -> BaseException:
        return aiomqtt.MqttError(f"the MQTT connection {detail}{self._lost_reason()}")

    def _lost_reason(self) -> str:
        return closed_by_broker(self._client, self.client_id)

    def is_connection_error(self, exc: BaseException) -> bool:
        return (
            isinstance(exc, aiomqtt.MqttError) and not isinstance(exc, PublishError)
        ) or super().is_connection_error(exc)


__all__ = [
    "ESCAPED_PREFIX",
    "MqttPublisher",
    "publish_properties",
    "received_properties",
    "topic_problem",
]
