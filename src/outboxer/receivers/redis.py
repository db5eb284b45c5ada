"""``redis://`` and ``rediss://``: a consumer group on each topic's stream, read with XREADGROUP.

Each topic is the stream ``stream_prefix + topic`` the relay appends to (no patterns: a
stream is named in full). The group is created on the stream from its first entry
(``XGROUP CREATE … 0 MKSTREAM``), so entries added before any consumer existed are read
too. A message is acknowledged (``XACK``) once the transaction that applied it committed.

Entries a consumer read and did not acknowledge stay in the group's pending list under the
consumer's name (``name``, default the host name), so a consumer that restarts under its
name reads its own pending entries first (``XREADGROUP … 0``), in order, before new ones.
Entries of a consumer that never comes back are taken over by the others with
``XAUTOCLAIM`` once idle for ``claim_idle`` seconds (default 60), in passes over the whole
pending list (every ``claim_idle / 2``; Redis scans a bounded part of it per call, and a
receive takes over no more than its ``limit`` over all the streams, so a pass goes on at
each receive until it is through); a live consumer keeps the entries it holds from looking
idle (``XCLAIM … JUSTID`` every third of that time), however long a handler or its retries
take. One receive returns at most ``limit`` entries over all the streams; the rest of a
read waits in the receiver, ours already, and goes out first next time. For
``exit_when_idle`` the receiver is not idle while other consumers of the group hold pending
entries: it waits for their holders to acknowledge them, or takes them over once idle.

A group missing on a reconnect (``XGROUP DESTROY``, or the stream deleted and written
again) is created again from the stream's first entry, as the first time, with a WARNING:
every entry still in the stream is read again, and the inbox skips only those it remembers.

A reply that does not come within ``socket_timeout`` (redis-py's option in the URL; 10 s
unless it says otherwise) is a lost connection: a stalled network fails the XACK (the
entry comes again and the inbox skips it) instead of hanging the consumer. A wait for new
entries (``XREADGROUP … BLOCK``) is kept to half of it, so an idle stream is never taken
for a lost connection.

Options (query string or keyword): ``claim_idle``; the publisher's ``stream_prefix`` and
everything redis-py takes are read by :class:`RedisPublisher`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import deque
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
from redis import exceptions as rexc

from outboxer.brokers.base import describe
from outboxer.brokers.redis import CONSUMER_OPTIONS, RedisPublisher
from outboxer.config import duration_option
from outboxer.errors import ConfigError
from outboxer.receivers.base import Incoming, Receiver, decode, unreadable
from outboxer.redact import get_logger

logger = get_logger("outboxer.receiver")

#: Entries taken over per XAUTOCLAIM call.
_CLAIM_COUNT = 100
#: The start of a group's pending list: an XAUTOCLAIM cursor back there has been through it.
_PEL_START = "0-0"
_PEL_STARTS = (_PEL_START, _PEL_START.encode())
#: Seconds to wait for a reply (``socket_timeout``) unless the URL says otherwise: a
#: connection that went silent (a stalled network) fails instead of hanging the consumer.
_READ_TIMEOUT = 10.0


def _text(value: bytes | None) -> str | None:
    return value.decode("utf-8", "replace") if value is not None else None


def _field(fields: Any, name: bytes) -> bytes:
    """A field's bytes from an entry whose layout may be anything, or b"" if it has none."""
    value = fields.get(name) if isinstance(fields, dict) else None
    return value if isinstance(value, bytes) else b""


class RedisReceiver(Receiver):
    """Reads the group's entries from each topic's stream; XACK after commit."""

    schemes = ("redis", "rediss")
    options = CONSUMER_OPTIONS
    publisher_class = RedisPublisher

    def __init__(self, url: str, **options: Any) -> None:
        super().__init__(url, **options)
        for topic in self.topics:
            if any(char in topic for char in "*?[]"):
                raise ConfigError(f"redis topics name streams in full, not patterns: {topic!r}")
        self.claim_idle = duration_option(
            self.settings.get("claim_idle", 60), "redis option claim_idle", 0.01, 86_400
        )
        self.extend_interval = self.claim_idle / 3
        self.consumer = self.name or "outboxer"
        self.streams = {self._redis.stream_prefix + topic: topic for topic in self.topics}
        self._client: aioredis.Redis | None = None
        #: Streams whose own pending entries (from before a restart) are not all read yet,
        #: and the last one read of each.
        self._backlog: dict[str, str | bytes] = {}
        self._next_claim = 0.0
        #: The streams the current XAUTOCLAIM pass is not through yet, in order, and where
        #: it goes on in each one's pending list (empty: no pass under way).
        self._claim_pass: dict[str, str | bytes] = {}
        #: Entries other consumers of the group held at the last empty read (``idle``).
        self._others_pending = 0
        #: Streams on which this receiver found (or made) the group: one missing later was
        #: destroyed meanwhile.
        self._had_group: set[str] = set()
        #: Seconds a blocking read may wait at most (None: no limit).
        self._longest_block: float | None = None
        #: Entries read (or claimed) beyond a receive's ``limit``, handed out first next time.
        self._overflow: deque[Incoming] = deque()

    @property
    def _redis(self) -> RedisPublisher:
        assert isinstance(self.publisher, RedisPublisher)
        return self.publisher

    def parse(self, url: str, **options: Any) -> RedisPublisher:
        return RedisPublisher(url, **options)

    async def _connect(self) -> None:
        await self._close()
        client = aioredis.Redis.from_url(
            self._redis._driver_url, socket_connect_timeout=10, socket_timeout=_READ_TIMEOUT
        )
        self._client = client
        # The URL's socket_timeout wins; a blocking XREADGROUP must end well before it, or
        # every wait for new entries reads as a lost connection.
        read_timeout = client.connection_pool.connection_kwargs.get("socket_timeout")
        self._longest_block = read_timeout / 2 if read_timeout else None
        await client.ping()
        for stream in self.streams:
            try:
                await client.xgroup_create(stream, self.group, id="0", mkstream=True)
            except rexc.ResponseError as exc:
                # BUSYGROUP: it exists, fine. A server out of memory (noeviction) refuses
                # XGROUP CREATE before looking, even for a group that exists, while it still
                # serves XREADGROUP and XACK: a consumer reconnecting then stayed down as
                # long as Redis was full, with the stream's entries there to apply.
                if "BUSYGROUP" not in str(exc) and not await self._group_exists(client, stream):
                    raise
            else:
                await self._created(client, stream)
            self._had_group.add(stream)
        await self._check_permissions(client)
        self._backlog = dict.fromkeys(self.streams, "0")
        # Still in our pending list: the backlog read from "0" above reads them again.
        self._overflow.clear()
        self._next_claim = 0.0
        self._claim_pass = {}
        self._others_pending = 0

    async def _check_permissions(self, client: Any) -> None:
        """ConfigError if an ACL denies a command the consumer runs later: each was denied
        at its turn (XAUTOCLAIM at the first receive), which read as a lost connection,
        and the reconnect met it again, for ever, with the entries never applied. Each is
        run with nothing to do: from the last possible entry id (past every entry, so
        that XAUTOCLAIM drops no deleted entry from the pending list unreported), on id
        0-0 (no entry has it), taking over only entries idle longer than a century.
        XREADGROUP is not probed (no form of it is sure to read nothing: from that last id
        Redis 7.0 hands out new entries); the first receive meets its refusal."""
        century = 100 * 365 * 86_400_000
        last = f"{2**64 - 1}-{2**64 - 1}"
        probes = []
        async with client.pipeline(transaction=False) as pipe:
            for stream in self.streams:
                for command, args in (
                    ("XAUTOCLAIM", (stream, self.group, self.consumer, century, last)),
                    ("XCLAIM", (stream, self.group, self.consumer, century, "0-0", "JUSTID")),
                    ("XACK", (stream, self.group, "0-0")),
                    ("XPENDING", (stream, self.group)),
                ):
                    pipe.execute_command(command, *args)
                    probes.append((command, stream))
            replies = await pipe.execute(raise_on_error=False)
        denied = [
            f"{command} on {stream!r}"
            for (command, stream), reply in zip(probes, replies, strict=True)
            if isinstance(reply, rexc.NoPermissionError)
        ]
        if denied:
            raise ConfigError(
                f"redis consumer {self.safe_url}: the user may not run {', '.join(denied)} "
                "(NOPERM); a consumer runs XGROUP CREATE, XREADGROUP, XACK, XAUTOCLAIM, "
                "XCLAIM, XPENDING and XLEN on its streams"
            )

    async def _group_exists(self, client: Any, stream: str) -> bool:
        """Whether the group exists on ``stream`` (XINFO GROUPS, which a full server serves)."""
        try:
            groups = await client.xinfo_groups(stream)
        except rexc.ResponseError:  # no such key, or XINFO not allowed: as if it did not
            return False
        names = (self.group, self.group.encode())  # bytes unless decode_responses
        return any(group.get("name") in names for group in groups)

    async def _eviction(self, client: Any) -> str:
        """What the server says of key eviction, for the group-gone warning ("" if nothing)."""
        try:
            policy = await client.config_get("maxmemory-policy")
            stats = await client.info("stats")
        except rexc.ResponseError:  # CONFIG or INFO not allowed: say nothing
            return ""
        evicted = int(stats.get("evicted_keys", 0) or 0)
        name = str(policy.get("maxmemory-policy", "") or "")
        if not evicted:
            return ""
        return f"; Redis has evicted {evicted} key(s) so far (maxmemory-policy {name})"

    async def _created(self, client: Any, stream: str) -> None:
        """Say that the group was just created on ``stream``, from its first entry.

        From ``0``, not ``$``, even when it existed before (XGROUP DESTROY, or the stream
        deleted and written again): from anywhere later, the entries its pending list held
        unacknowledged, and those added while it was missing (all of a stream written
        again), would never be delivered. The price: every entry still in the stream comes
        again, and the inbox skips only those it still remembers (its retention); older
        ones are applied a second time. Loud, then."""
        entries = int(await client.xlen(stream))
        if stream not in self._had_group:
            logger.info(
                "%s: created consumer group %r on stream %r from its first entry: %d "
                "entr%s to read",
                self.safe_url,
                self.group,
                stream,
                entries,
                "y" if entries == 1 else "ies",
            )
            return
        logger.warning(
            "%s: consumer group %r was gone from stream %r (XGROUP DESTROY, or the stream "
            "deleted, or evicted by maxmemory, and written again; entries added before "
            "that and never read are lost%s): created again from the stream's first entry, "
            "so its %d entr%s are read again; the inbox skips those it still remembers, "
            "older ones are applied a second time",
            self.safe_url,
            self.group,
            stream,
            await self._eviction(client),
            entries,
            "y" if entries == 1 else "ies",
        )

    async def _close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(rexc.RedisError, OSError):  # broken: nothing to release
                await client.aclose()

    def _client_now(self) -> Any:  # redis-py's stream signatures are too narrow to type against
        if self._client is None:
            raise ConnectionError("redis receiver is not connected")
        return self._client

    async def _receive(self, limit: int, timeout: float) -> list[Incoming]:
        # COUNT (XREADGROUP, XAUTOCLAIM) bounds each stream, not the reply: with several
        # topics one read returns up to ``limit`` per stream, and the runner, which asked
        # for the room left under its prefetch, held that many times more. Asking each
        # stream for a share of ``limit`` would slow a busy stream while the others are
        # idle, and a read cannot be handed back (the entries are in our pending list now):
        # the rest waits here, in stream order, and goes out before anything new is read,
        # so no later entry of its stream overtakes it. ``_extend`` keeps it from looking
        # idle to other consumers' XAUTOCLAIM, as it does the entries the runner holds.
        if not self._overflow:
            self._overflow.extend(await self._read(limit, timeout))
            if not self._overflow:
                self._others_pending = await self._pending_elsewhere()
        return [self._overflow.popleft() for _ in range(min(limit, len(self._overflow)))]

    def idle(self) -> bool:
        """Not while other consumers of the group hold pending entries: a live one's are
        its own until acknowledged, but a dead one's come to us once idle ``claim_idle``
        seconds, and exiting first would leave them unapplied. So ``exit_when_idle`` waits
        for whatever the group still holds, acknowledged by its holder or taken over."""
        return not self._backlog and not self._overflow and self._others_pending == 0

    async def _pending_elsewhere(self) -> int:
        """Entries other consumers of the group hold, over all the streams."""
        async with self._client_now().pipeline(transaction=False) as pipe:
            for stream in self.streams:
                pipe.xpending(stream, self.group)
            replies = await pipe.execute()
        ours = (self.consumer, self.consumer.encode())  # bytes unless decode_responses
        return sum(
            int(consumer["pending"])
            for reply in replies
            for consumer in reply.get("consumers") or []
            if consumer["name"] not in ours
        )

    async def lag(self, timeout: float = 5.0) -> int | None:
        """Entries of the group's streams not yet delivered to any consumer of the group
        (XINFO GROUPS' ``lag``, Redis 7), summed over its streams: the whole group's
        backlog, the same from every member (max by group). None where Redis cannot tell:
        ``lag`` is nil (entries deleted or trimmed ahead of the group) or absent (before
        Redis 7)."""
        client = self._client
        if not self._connected or client is None:
            return None
        try:
            return await asyncio.wait_for(self._group_lag(client), timeout)
        except Exception as exc:  # noqa: BLE001 -- a metric: unknown this time, never a failure
            logger.debug("%s: no group lag: %s", self.safe_url, describe(exc))
            return None

    async def _group_lag(self, client: Any) -> int | None:
        total = 0
        names = (self.group, self.group.encode())  # bytes unless decode_responses
        for stream in self.streams:
            groups = await client.xinfo_groups(stream)
            mine = [group for group in groups if group.get("name") in names]
            if not mine or mine[0].get("lag") is None:
                return None
            total += int(mine[0]["lag"])
        return total

    async def _read(self, limit: int, timeout: float) -> list[Incoming]:
        client = self._client_now()
        if self._backlog:  # our own pending entries first, in order
            replies = await client.xreadgroup(
                self.group, self.consumer, dict(self._backlog), count=limit
            )
            for raw_stream, entries in replies or []:
                stream = _text(raw_stream) or ""
                if entries:
                    self._backlog[stream] = entries[-1][0]
                else:
                    self._backlog.pop(stream, None)
            # Our own pending entries: read before, by this consumer name's previous run.
            received = await self._entries(replies, redelivered=True)
            if received or self._backlog:
                return received
        loop = asyncio.get_running_loop()
        if self._claim_pass or loop.time() >= self._next_claim:
            if not self._claim_pass:
                self._claim_pass = dict.fromkeys(self.streams, _PEL_START)
            claimed = await self._claim_idle(limit)
            if not self._claim_pass:  # through: the next pass in a while
                self._next_claim = loop.time() + self.claim_idle / 2
            if claimed:
                return claimed
        ids = dict.fromkeys(self.streams, ">")
        if self._longest_block is not None:
            timeout = min(timeout, self._longest_block)
        replies = await client.xreadgroup(
            self.group, self.consumer, ids, count=limit, block=max(1, int(timeout * 1000))
        )
        return await self._entries(replies)

    async def _claim_idle(self, limit: int) -> list[Incoming]:
        """Entries other consumers left idle too long (they died): ours now, ``limit`` at
        most over all the streams of the pass."""
        client = self._client_now()
        received: list[Incoming] = []
        for stream, start in list(self._claim_pass.items()):
            # COUNT bounds one stream's call, not the pass: a claim per stream of up to
            # ``limit`` took that many times more than the runner had room for, and what
            # waited in the overflow, ours and kept fresh by ``_extend``, no other live
            # consumer could take over meanwhile. The pass goes on with the rest next time.
            room = limit - len(received)
            if room <= 0:
                break
            reply = await client.xautoclaim(
                stream,
                self.group,
                self.consumer,
                int(self.claim_idle * 1000),
                start_id=start,
                count=min(room, _CLAIM_COUNT),
            )
            # Redis looks at no more than ten times COUNT pending entries per call and says
            # where it stopped. Started again from 0-0 each time, a dead consumer's entries
            # behind that many entries live consumers still hold were never taken over.
            if reply[0] in _PEL_STARTS:
                del self._claim_pass[stream]
            else:
                self._claim_pass[stream] = reply[0]
            received += await self._entries([(stream, reply[1])], redelivered=True)
            if len(reply) > 2 and reply[2]:  # Redis 7: ids it dropped from the pending list
                self._report_lost(stream, reply[2])
        return received

    async def _entries(self, replies: Any, *, redelivered: bool = False) -> list[Incoming]:
        """The entries of an XREADGROUP or XAUTOCLAIM reply; ``redelivered``: read before
        (from a pending list, not ``>``), perhaps by a consumer that died applying them."""
        received = []
        gone: list[tuple[str, bytes]] = []
        for raw_stream, entries in replies or []:
            stream = raw_stream.decode() if isinstance(raw_stream, bytes) else raw_stream
            for entry_id, fields in entries:
                if not fields:  # trimmed away while pending (MAXLEN): nothing to apply
                    gone.append((stream, entry_id))
                    continue
                try:
                    incoming = self._incoming(stream, entry_id, fields)
                except Exception as exc:  # noqa: BLE001 -- one bad entry must not fail the rest
                    # Raised, it would read as a lost connection, and the reconnect reads the
                    # pending list from 0 again: this entry would come first every time, forever.
                    incoming = unreadable(
                        f"stream entry {_text(entry_id)} cannot be read: {describe(exc)}",
                        _field(fields, b"payload"),
                        topic=self.streams.get(stream, stream),
                    )
                    incoming.token = (stream, entry_id)
                incoming.redelivered = redelivered
                received.append(incoming)
        for stream, entry_id in gone:
            await self._client_now().xack(stream, self.group, entry_id)
        for stream in dict.fromkeys(stream for stream, _ in gone):
            self._report_lost(stream, [entry_id for name, entry_id in gone if name == stream])
        return received

    def _report_lost(self, stream: str, entry_ids: Sequence[bytes]) -> None:
        """Entries handed to this group, never applied, and no longer in the stream: those
        messages are lost. They leave the pending list (nothing is left to apply), not unseen."""
        count = len(entry_ids)
        logger.warning(
            "%s: %d pending entr%s of group %r gone from the stream %r before %s applied "
            "(trimmed by the publisher's maxlen, XTRIM or XDEL): lost; first %s, last %s",
            self.safe_url,
            count,
            "y" if count == 1 else "ies",
            self.group,
            stream,
            "it was" if count == 1 else "they were",
            _text(entry_ids[0]),
            _text(entry_ids[-1]),
        )

    def _incoming(self, stream: str, entry_id: bytes, fields: dict[bytes, bytes]) -> Incoming:
        # Another writer may XADD anything: a field name that is not UTF-8 is nobody's field.
        field = {name.decode("utf-8", "replace"): value for name, value in fields.items()}
        try:
            headers = json.loads(field.get("headers") or b"{}")
        except ValueError:
            headers = {}
        if not isinstance(headers, dict):
            headers = {}
        created = _text(field.get("created_at"))
        if created:
            headers["outboxer-created-at"] = created
        incoming = decode(
            {str(k): str(v) for k, v in headers.items()},
            field.get("payload") or b"",
            message_id=_text(field.get("id")),
            topic=_text(field.get("topic")),
            key=_text(field.get("key")),
            content_type=_text(field.get("content_type")),
            fallback_topic=self.streams.get(stream, stream),
        )
        incoming.token = (stream, entry_id)
        return incoming

    def _by_stream(self, incomings: Sequence[Incoming]) -> dict[str, list[bytes]]:
        grouped: dict[str, list[bytes]] = {}
        for incoming in incomings:
            stream, entry_id = incoming.token
            grouped.setdefault(stream, []).append(entry_id)
        return grouped

    async def _ack(self, incomings: Sequence[Incoming]) -> None:
        async with self._client_now().pipeline(transaction=False) as pipe:
            for stream, entry_ids in self._by_stream(incomings).items():
                pipe.xack(stream, self.group, *entry_ids)
            await pipe.execute()

    async def _extend(self, incomings: Sequence[Incoming]) -> None:
        # Claiming our own entries again resets their idle time: nobody takes them over. Those
        # waiting in the overflow are ours as much (and the runner holds some whenever
        # they wait: it asks for more as soon as it has room).
        async with self._client_now().pipeline(transaction=False) as pipe:
            for stream, entry_ids in self._by_stream([*incomings, *self._overflow]).items():
                pipe.xclaim(stream, self.group, self.consumer, 0, entry_ids, justid=True)
            await pipe.execute()


__all__ = ["RedisReceiver"]
