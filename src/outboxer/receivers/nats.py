"""``nats://``: a durable JetStream pull consumer per topic, acked after commit.

Each topic (a subject or a subject pattern with ``*`` and ``>``, before ``subject_prefix``)
gets a durable pull consumer on the stream that captures it (``stream``, or the one
JetStream names for the subject): named after the group (``durable``), explicit acks,
every message from the stream's start. Every consumer process of the group pulls from it.
A message is acked (``+ACK``) once the transaction that applied it committed; while a
handler or its retries take long the receiver sends in-progress acks (``+WPI``) every
third of ``ack_wait`` (default 30 s), so JetStream does not hand the message to another
puller meanwhile. At shutdown, messages held but not started are handed back (``-NAK``).

JetStream redelivers what a crashed consumer held once ``ack_wait`` has passed, and a
puller meanwhile gets newer messages. So that a key's messages stay in order across a
crash, a receiver that finds messages of its consumer unacknowledged, or pull requests
still open (a killed process's last pull can still be handed messages, at most
``_LONGEST_PULL`` seconds), when it starts waits ``ack_wait`` plus that before its first
pull: JetStream then hands out those redeliveries first. It hands them out in the order
their ``ack_wait`` ran out, not the stream's, so the receiver gathers them all (until a
pull brings a message delivered for the first time, or nothing) and passes them on
sorted by stream sequence.

A durable deleted on the server (by an operator, or with its stream) is noticed after a
few seconds of empty pulls (JetStream does not answer pulls to a consumer that does not
exist): the receive fails as a lost connection, and the reconnect creates it again, from
the stream's start (the inbox skips what was applied).

The URL is the relay's: servers, TLS and credentials are read by :class:`NatsPublisher`
(with ``create_stream``, the stream is created as the relay would create it).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import re
from collections import deque
from collections.abc import Sequence
from typing import Any

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import DEFAULT_PREFIX, AckPolicy, ConsumerConfig, DeliverPolicy, StatusCode

from outboxer.brokers.base import describe
from outboxer.brokers.nats import (
    CONSUMER_OPTIONS,
    NatsPublisher,
    check_subject,
    close_client,
    received_headers,
    stream_warnings,
)
from outboxer.config import duration_option
from outboxer.errors import ConfigError
from outboxer.receivers.base import Incoming, Receiver, decode
from outboxer.redact import get_logger

logger = get_logger("outboxer.receiver")

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")
#: What a JetStream consumer's name cannot hold (nats-py's check, which raises on connect).
_NOT_IN_NAMES = frozenset(">*. /\\\t\r\n")
#: JetStream's err_code for a consumer filter subject outside its stream's subjects.
_FILTER_NOT_IN_STREAM = 10093
#: Seconds a pull request stays open at most (its ``expires``).
_LONGEST_PULL = 1.0
#: Messages per pull, and its expiry, while gathering a crashed holder's redeliveries.
_RECOVERY_BATCH = 500
_RECOVERY_PULL = 0.2
#: Seconds of pulls that brought nothing between checks that the consumer still exists.
_CHECK_EVERY = 5.0
#: Seconds a pull waits for JetStream's answer past its ``expires``.
_PULL_MARGIN = 1.0


class _Puller:
    """Pull requests to one durable consumer, and the inbox their messages come to.

    Not nats-py's ``fetch``: it reads a status from a message's headers wherever it comes
    from, so a message a foreign publisher stored with a header line such as
    ``NATS/1.0 503`` failed every pull (read as a lost connection: redelivered after the
    reconnect, it failed it again, for ever) and one with ``NATS/1.0 100`` was dropped
    unseen (redelivered every ``ack_wait`` without end). A stored message comes with its
    ``$JS.ACK`` reply subject; JetStream's own status messages have none."""

    def __init__(self, stream: str, durable: str, inbox: str, subscription: Subscription) -> None:
        self.stream = stream
        self.durable = durable
        self.next_subject = f"{DEFAULT_PREFIX}.CONSUMER.MSG.NEXT.{stream}.{durable}"
        self.inbox = inbox
        self.subscription = subscription
        self._requests = itertools.count()


def durable_name(group: str, topic: str, several: bool) -> str:
    """A valid consumer name for the group (and the topic, if the group has several)."""
    name = _UNSAFE.sub("_", group)
    if several:
        digest = hashlib.sha1(topic.encode()).hexdigest()[:8]
        name = f"{name}-{_UNSAFE.sub('_', topic)[:40]}-{digest}"
    return name


class NatsReceiver(Receiver):
    """Pulls the group's messages from a durable JetStream consumer per topic."""

    schemes = ("nats",)
    options = CONSUMER_OPTIONS
    publisher_class = NatsPublisher
    all_topics = ">"

    def __init__(self, url: str, **options: Any) -> None:
        super().__init__(url, **options)
        self.ack_wait = duration_option(
            self.settings.get("ack_wait", 30), "nats option ack_wait", 0.5, 86_400
        )
        self.extend_interval = self.ack_wait / 3
        for topic in self.topics:
            check_subject(
                self._nats.subject_prefix + topic, wildcards=True, what="nats consumer topic"
            )
        several = len(self.topics) > 1
        durable = self.settings.get("durable")
        if durable and several:
            raise ConfigError("nats option durable names one consumer: give one topic with it")
        if durable and any(character in _NOT_IN_NAMES for character in str(durable)):
            # nats-py refuses it at every connect, which read as an outage retried for ever.
            raise ConfigError(
                f"nats option durable must be a consumer name without '.', '*', '>', '/', "
                f"'\\' or white space: {str(durable)!r:.200}"
            )
        self.durables = {
            topic: str(durable) if durable else durable_name(self.group, topic, several)
            for topic in self.topics
        }
        self._nc: Client | None = None
        self._js: JetStreamContext | None = None
        self._subscriptions: list[_Puller] = []
        self._next_check = 0.0
        self._turn = 0
        self._lost = asyncio.Event()
        self._pull_after = 0.0
        self._pulled_nothing = False
        #: After a crash: gather the redeliveries first (``_recover``), then hand them out
        #: from here in stream order.
        self._recovering = False
        self._sorted: deque[Incoming] = deque()
        #: Streams whose configuration was looked at (``_warn_of``).
        self._warned: set[str] = set()

    @property
    def _nats(self) -> NatsPublisher:
        assert isinstance(self.publisher, NatsPublisher)
        return self.publisher

    def parse(self, url: str, **options: Any) -> NatsPublisher:
        return NatsPublisher(url, **options)

    async def _connect(self) -> None:
        await self._close()
        lost = self._lost = asyncio.Event()

        async def on_error(error: Exception) -> None:
            lost.set()

        nc = await self._nats.open_client(lost, on_error)
        self._nc = nc
        js = self._js = nc.jetstream(timeout=self.connect_timeout)
        if self._nats.create_stream:
            await self._nats.ensure_stream(js)
        busy = 0
        for topic, durable in self.durables.items():
            subject = self._nats.subject_prefix + topic
            stream = self._nats.stream or await js.find_stream_name_by_subject(subject)
            await self._warn_of(js, stream)
            config = ConsumerConfig(
                durable_name=durable,
                ack_policy=AckPolicy.EXPLICIT,
                deliver_policy=DeliverPolicy.ALL,
                filter_subject=subject,
                ack_wait=self.ack_wait,
                max_deliver=-1,
            )
            try:
                info = await js.add_consumer(stream, config)
            except nats.js.errors.BadRequestError as exc:
                if exc.err_code == _FILTER_NOT_IN_STREAM:
                    raise ConfigError(
                        f"nats consumer topic {topic!r:.200} (subject {subject!r:.200}) is not "
                        f"among the subjects of stream {stream!r}: {exc.description}"
                    ) from exc
                raise ConfigError(
                    f"JetStream consumer {durable!r} on stream {stream!r} exists with other "
                    f"settings ({exc.description}): delete it or set ack_wait to match"
                ) from exc
            # Messages delivered and not acked, and pull requests still open (a killed
            # process's last pull may yet be handed messages nobody will ack).
            busy += (info.num_ack_pending or 0) + (info.num_waiting or 0)
            inbox = nc.new_inbox()
            subscription = await nc.subscribe(f"{inbox}.*")
            self._subscriptions.append(_Puller(stream, durable, inbox, subscription))
        # Redeliveries of a crashed holder come before newer messages only once ack_wait is
        # over: pulling earlier would apply a key's newer messages first.
        loop = asyncio.get_running_loop()
        self._pull_after = loop.time() + self.ack_wait + _LONGEST_PULL if busy else 0.0
        self._recovering = bool(busy)
        self._sorted = deque()
        self._next_check = 0.0

    async def _warn_of(self, js: JetStreamContext, stream: str) -> None:
        """Say once per stream what in its configuration drops messages before this group
        applied them (``discard: old`` with limits, memory storage): JetStream says nothing
        when it does, and the consumer sees no gap."""
        if stream in self._warned:
            return
        self._warned.add(stream)
        try:
            config = (await js.stream_info(stream)).config
        except (nats.errors.Error, TimeoutError) as exc:
            logger.debug("%s: no configuration of stream %r: %s", self.safe_url, stream, exc)
            return
        for warning in stream_warnings(config):
            logger.warning("%s: JetStream stream %r: %s", self.safe_url, stream, warning)

    def idle(self) -> bool:
        return self._pulled_nothing

    async def _close(self) -> None:
        nc, self._nc = self._nc, None
        self._js = None
        self._subscriptions = []
        if nc is not None and not nc.is_closed:
            # Closing flushes acks written and not yet sent (a broken connection has none),
            # within CLOSE_TIMEOUT: a server that stopped reading held the close for ever.
            await close_client(nc)

    async def _receive(self, limit: int, timeout: float) -> list[Incoming]:
        if self._nc is None or self._nc.is_closed or self._lost.is_set():
            raise ConnectionError("the connection to NATS is closed")
        loop = asyncio.get_running_loop()
        wait = self._pull_after - loop.time()
        self._pulled_nothing = False
        if wait > 0:
            await asyncio.sleep(min(wait, timeout))
            return []
        if self._recovering:
            await self._recover()
        if self._sorted:
            return [self._sorted.popleft() for _ in range(min(limit, len(self._sorted)))]
        messages = await self._pull(limit, timeout)
        if not messages:
            if loop.time() >= self._next_check:
                await self._check_consumers()
                self._next_check = loop.time() + _CHECK_EVERY
            self._pulled_nothing = True  # a real pull found nothing (not the startup wait)
        return [self._incoming(message) for message in messages]

    async def lag(self, timeout: float = 5.0) -> int | None:
        """The messages of the stream its durable consumers have not delivered yet
        (``num_pending``), summed over the group's topics: the whole group's backlog, the
        same from every member. Redeliveries due (an ack_wait that ran out) are not in it."""
        js, pullers = self._js, list(self._subscriptions)
        if not self._connected or js is None or not pullers:
            return None
        try:
            return await asyncio.wait_for(self._pending(js, pullers, timeout), timeout)
        except Exception as exc:  # noqa: BLE001 -- a metric: unknown this time, never a failure
            logger.debug("%s: no consumer backlog: %s", self.safe_url, describe(exc))
            return None

    @staticmethod
    async def _pending(js: JetStreamContext, pullers: Sequence[_Puller], timeout: float) -> int:
        # Requests of their own (a reply inbox each): they take nothing from the pulls.
        infos = await asyncio.gather(
            *(js.consumer_info(p.stream, p.durable, timeout=timeout) for p in pullers)
        )
        return sum(info.num_pending or 0 for info in infos)

    async def _check_consumers(self) -> None:
        """ConnectionError if a consumer is gone (deleted by an operator, or with its
        stream): JetStream leaves pulls to it unanswered, so they would just bring nothing,
        for ever. The reconnect creates it again."""
        assert self._js is not None
        for puller in self._subscriptions:
            try:
                await self._js.consumer_info(puller.stream, puller.durable)
            except nats.js.errors.NotFoundError as exc:
                raise ConnectionError(
                    f"JetStream consumer {puller.durable!r} on stream {puller.stream!r} is "
                    f"gone ({exc.description})"
                ) from None

    async def _pull(self, limit: int, timeout: float) -> list[Msg]:
        puller = self._subscriptions[self._turn % len(self._subscriptions)]
        self._turn += 1
        wait = min(timeout / len(self._subscriptions), _LONGEST_PULL)
        loop = asyncio.get_running_loop()
        started = loop.time()
        # As nats-py's fetch: what is there at once (a server before 2.10 lingers on such
        # a request until it expires), else wait for the first to come.
        messages = await self._request(puller, limit, wait, no_wait=True)
        left = wait - (loop.time() - started)
        if not messages and left > 0.01:
            messages = await self._request(puller, limit, left, no_wait=False)
        return messages

    async def _request(
        self, puller: _Puller, limit: int, wait: float, *, no_wait: bool
    ) -> list[Msg]:
        assert self._nc is not None
        request: dict[str, Any] = {"batch": limit, "expires": int(wait * 1e9)}
        if no_wait:
            request["no_wait"] = True
        # A reply subject per request: a late status of an earlier one ends nothing here.
        reply = f"{puller.inbox}.{next(puller._requests)}"
        await self._nc.publish(puller.next_subject, json.dumps(request).encode(), reply=reply)
        messages: list[Msg] = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait + _PULL_MARGIN
        while len(messages) < limit:
            left = deadline - loop.time()
            if left <= 0:
                break
            try:
                message = await puller.subscription.next_msg(timeout=left)
            except (TimeoutError, nats.errors.TimeoutError):
                break
            if message.reply:  # stored: whatever its headers say, it is a message to apply
                messages.append(message)
                continue
            if message.subject != reply:
                continue  # the end of an earlier request
            status = (message.headers or {}).get("Status", "")
            if status == StatusCode.CONTROL_MESSAGE:
                continue
            if status in (StatusCode.NO_MESSAGES, StatusCode.REQUEST_TIMEOUT):
                break  # this request is over
            description = (message.headers or {}).get("Description", "")
            if status == StatusCode.CONFLICT and "deleted" not in description.lower():
                break  # e.g. too many pulls waiting: this one is over, the next may do
            raise ConnectionError(
                f"JetStream answered a pull with {status!r} {description[:200]!r}"
            )
        return messages

    async def _recover(self) -> None:
        """Take every redelivery of a crashed holder before anything new, and hand them out
        in stream order: JetStream redelivers in the order their ack_wait ran out, which is
        not the stream's (a key's messages could come swapped)."""
        redelivered: list[Msg] = []
        newer: list[Msg] = []
        quiet = 0
        while quiet < len(self._subscriptions):
            messages = await self._pull(_RECOVERY_BATCH, _RECOVERY_PULL)
            quiet = 0 if messages else quiet + 1
            for message in messages:
                (redelivered if message.metadata.num_delivered > 1 else newer).append(message)
            if newer:  # JetStream hands out redeliveries first: none is left due
                break
            if redelivered:
                await self._each_message(redelivered, "in_progress")  # while we gather
        redelivered.sort(key=lambda m: (m.metadata.stream or "", m.metadata.sequence.stream))
        self._sorted.extend(self._incoming(message) for message in [*redelivered, *newer])
        self._recovering = False

    def _incoming(self, message: Msg) -> Incoming:
        headers = received_headers(message.headers or {})
        incoming = decode(headers, message.data, fallback_topic=message.subject)
        incoming.token = message
        # JetStream counts deliveries: above 1, an earlier one was never acknowledged (its
        # consumer died, or its ack_wait ran out, or it was handed back with a NAK).
        incoming.redelivered = message.metadata.num_delivered > 1
        return incoming

    async def _each(self, incomings: Sequence[Incoming], action: str) -> None:
        await self._each_message([incoming.token for incoming in incomings], action)

    async def _each_message(self, messages: Sequence[Msg], action: str) -> None:
        for message in messages:
            await getattr(message, action)()
        if self._nc is not None:
            await self._nc.flush(timeout=10)  # sent, not just written to the buffer

    async def _ack(self, incomings: Sequence[Incoming]) -> None:
        await self._each(incomings, "ack")

    async def _extend(self, incomings: Sequence[Incoming]) -> None:
        # Also the redeliveries gathered and not yet handed to the runner.
        await self._each([*incomings, *self._sorted], "in_progress")

    async def _release(self, incomings: Sequence[Incoming]) -> None:
        await self._each([*incomings, *self._sorted], "nak")
        self._sorted.clear()


__all__ = ["NatsReceiver", "durable_name"]
