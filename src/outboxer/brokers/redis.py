"""``redis://`` and ``rediss://``: one XADD per message to a Redis stream, pipelined per wave.

A message is confirmed once Redis answered its XADD with an entry id: the entry
is in the server's memory (and in its AOF/RDB as far as the server's own
persistence settings go). A wave travels as one write of all its XADDs (a
non-transactional pipeline), so a batch costs one round trip per wave; each XADD's
reply is mapped on its own.

The wave's commands are written as RESP here, on connections redis-py makes (its
handshake, TLS, AUTH, SELECT and protocol come from the URL), and its replies read
with redis-py's parser. redis-py's own pipeline costs about twice the whole relay's
CPU per message from version 8 on (bench/README.md), for work a wave of XADDs does
not need.

Entry layout (every value is a byte string):

``id``            the outbox message id (UUID text); consumers deduplicate on it
``topic``         the outbox topic
``key``           the message key; the field is absent for a keyless message
``content_type``  the payload's content type
``payload``       the payload bytes, unchanged
``headers``       the user headers as a JSON object text (``{}`` when none)
``created_at``    ISO-8601 creation time; absent when unknown
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import cast
from urllib.parse import urlencode

import redis.asyncio as aioredis
from redis import exceptions as rexc
from redis.asyncio.connection import Connection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from outboxer.brokers.base import (
    NotSent,
    Publisher,
    check_url_repeats,
    parse_options,
    unknown_names,
)
from outboxer.brokers.tlsfiles import TLS_FILE_OPTIONS, client_context
from outboxer.config import int_option
from outboxer.errors import ConfigError, PublishError
from outboxer.message import Message
from outboxer.redact import get_logger, redact_url
from outboxer.retry import Backoff

logger = get_logger("outboxer.publisher.redis")

#: Our own URL options; the rest of the query string goes to redis-py.
_OPTIONS = ("stream_prefix", "maxlen")
#: The consumer's own URL options (outboxer.receivers.redis), not the driver's: one URL
#: serves the relay and the consumers.
CONSUMER_OPTIONS = ("claim_idle",)

#: Error replies that may clear up on their own (failover, memory freed, loading).
_RETRYABLE_REPLIES = (
    "BUSY",
    "CLUSTERDOWN",
    "LOADING",
    "MASTERDOWN",
    "MISCONF",
    "NOREPLICAS",
    "TRYAGAIN",
)


def _bulk(value: bytes) -> bytes:
    return b"$%d\r\n%b\r\n" % (len(value), value)


#: The most streams whose XADD head a publisher keeps encoded.
_HEADS_KEPT = 1024

#: Redis's default ``proto-max-bulk-len``: the longest argument it takes, assumed when the
#: server does not say (CONFIG refused, as managed services do).
DEFAULT_BULK_LIMIT = 512 * 1024 * 1024

#: The bulk strings of the entry's field names.
_FIELD_NAMES = {
    name: _bulk(name.encode())
    for name in ("id", "topic", "key", "content_type", "payload", "headers", "created_at")
}


def xadd_command(head: tuple[int, bytes], fields: Mapping[str, str | bytes]) -> bytes:
    """One XADD in RESP: ``head`` is (its argument count, its bulk strings) before the
    fields (XADD, the stream, the trim option, ``*``); every value is sent as UTF-8."""
    count, prefix = head
    chunks = [b"*%d\r\n" % (count + 2 * len(fields)), prefix]
    for name, value in fields.items():
        data = value if isinstance(value, bytes) else value.encode()
        chunks.append(_FIELD_NAMES[name])
        chunks.append(b"$%d\r\n" % len(data))
        chunks.append(data)
        chunks.append(b"\r\n")
    return b"".join(chunks)


def entry_fields(message: Message) -> dict[str, str | bytes]:
    """The stream entry for ``message`` (see the module docstring)."""
    fields: dict[str, str | bytes] = {"id": str(message.id), "topic": message.topic}
    if message.key is not None:
        fields["key"] = message.key
    fields["content_type"] = message.content_type
    fields["payload"] = message.payload
    fields["headers"] = json.dumps(dict(message.headers), ensure_ascii=False, separators=(",", ":"))
    if message.created_at is not None:
        fields["created_at"] = message.created_at.isoformat()
    return fields


#: Error replies of a server that takes no writes now, whatever the command: out of memory
#: under ``noeviction``, a replica (a failover demoted the node this connection reached), a
#: failed RDB save with ``stop-writes-on-bgsave-error``, too few replicas for
#: ``min-replicas-to-write``, a replica whose primary is down, a script running too long.
_WRITES_REFUSED = ("OOM", "READONLY", "MISCONF", "NOREPLICAS", "MASTERDOWN", "BUSY")

#: How long a publisher whose XADDs met such a refusal again right after a connect whose
#: probe passed waits before it connects again, by the refused waves in a row with no XADD
#: taken (the relay's outage back-off). The connect probe cannot see every refusal: a user whose ACL does not cover the probe (NOPERM) is not
#: probed, and under ``noeviction`` a Redis a few kilobytes short of full takes the probe
#: and refuses each XADD of a larger message (its own arguments count as used memory).
#: Reconnected at once, the relay claimed, sent and gave back the same batch in a hot loop:
#: 224 connects and claims a second, for as long as it lasted, no attempt counted.
_REFUSAL_HOLD = Backoff(base=0.2, multiplier=2.0, cap=15.0, jitter=0.25)


def refuses_writes(error: rexc.ResponseError) -> bool:
    """Whether ``error`` says the server takes no write at all now (not this entry's fault)."""
    if isinstance(error, rexc.OutOfMemoryError | rexc.ReadOnlyError | rexc.MasterDownError):
        return True
    return str(error).split(" ", 1)[0].upper() in _WRITES_REFUSED


def reply_is_retryable(error: rexc.ResponseError) -> bool:
    """Whether Redis may accept the same XADD later (WRONGTYPE, NOPERM, ERR … never will)."""
    if isinstance(
        error,
        rexc.OutOfMemoryError
        | rexc.ReadOnlyError
        | rexc.AskError
        | rexc.TryAgainError
        | rexc.ClusterDownError,
    ):
        return True
    return str(error).split(" ", 1)[0].upper() in _RETRYABLE_REPLIES


def _longest(fields: Mapping[str, str | bytes], limit: int) -> int:
    """The length of the longest value of ``fields`` in bytes, exact where it may pass
    ``limit`` (a text is encoded only when its UTF-8 could be that long)."""
    longest = 0
    for value in fields.values():
        size = len(value)
        if isinstance(value, str) and size * 4 > limit:
            size = len(value.encode())
        longest = max(longest, size)
    return longest


async def _bulk_limit(connection: Connection) -> int:
    """The server's ``proto-max-bulk-len``, or Redis's default when CONFIG is refused
    (NOPERM, a renamed command) or says nothing usable."""
    await connection.send_command("CONFIG", "GET", "proto-max-bulk-len")
    try:
        reply = await connection.read_response()
    except rexc.ResponseError:
        return DEFAULT_BULK_LIMIT
    if isinstance(reply, dict):  # RESP3
        reply = [item for pair in reply.items() for item in pair]
    if isinstance(reply, list) and len(reply) == 2:
        with contextlib.suppress(TypeError, ValueError):
            return max(1, int(reply[1]))
    return DEFAULT_BULK_LIMIT


async def _memory_settings(connection: Connection) -> dict[str, str]:
    """The server's ``maxmemory*`` settings by name ({} when CONFIG is refused)."""
    await connection.send_command("CONFIG", "GET", "maxmemory*")
    try:
        reply = await connection.read_response()
    except rexc.ResponseError:
        return {}
    if isinstance(reply, dict):  # RESP3
        reply = [item for pair in reply.items() for item in pair]
    if not isinstance(reply, list):
        return {}
    texts = [
        item.decode("utf-8", "replace") if isinstance(item, bytes) else str(item) for item in reply
    ]
    return dict(zip(texts[::2], texts[1::2], strict=False))


def eviction_risk(settings: Mapping[str, str]) -> str | None:
    """Why the server may evict stream keys (None: it never does, or CONFIG said nothing).

    Only an ``allkeys-*`` policy evicts keys without a TTL, as streams are: the whole
    stream goes, entries no consumer group read yet and the groups with it, silently."""
    policy = settings.get("maxmemory-policy", "").lower()
    limit = settings.get("maxmemory", "0")
    if not policy.startswith("allkeys-") or limit in ("", "0"):
        return None
    return f"maxmemory {limit} with maxmemory-policy {policy}"


async def _write_refusal(
    connection: Connection, prefix: str, refused_stream: str | None = None
) -> rexc.ResponseError | None:
    """The error reply with which the server refuses every write now (see
    ``refuses_writes``), or None. Probed with ``XGROUP CREATE`` on a key that does not
    exist: Redis checks memory, persistence, replicas and the replica role before it runs
    a write command, and this one then fails on its own ("requires the key to exist")
    without writing anything. A user not allowed it (NOPERM: an ACL whose key patterns
    cover the streams only, or without XGROUP) is probed with ``XADD`` on the stream whose
    XADD was refused last, if any (``refused_stream``), with the id 0-0, which Redis 6.2
    and later refuse before they look the key up: its ACL allowed that XADD."""
    probe = f"{prefix}outboxer:write-probe:{uuid.uuid4().hex}"
    commands: list[tuple[str, ...]] = [("XGROUP", "CREATE", probe, "outboxer-write-probe", "$")]
    if refused_stream is not None:
        commands.append(("XADD", refused_stream, "0-0", "id", "write-probe"))
    for command in commands:
        await connection.send_command(*command)
        try:
            await connection.read_response()
        except rexc.NoPermissionError:
            continue
        except rexc.ResponseError as reply:
            return reply if refuses_writes(reply) else None
        return None
    return None


def _closed_by_server(connection: Connection) -> bool:
    """Whether Redis closed this idle connection, as its reader already saw (the end of the
    stream, or a reset), without I/O: redis-py finds out only when it reads a reply, so a
    wave written on it failed, as attempted, after a Redis restart or an idle timeout."""
    reader = getattr(connection, "_reader", None)  # redis-py's StreamReader, while connected
    if not isinstance(reader, asyncio.StreamReader):
        return not connection.is_connected
    return reader.at_eof() or reader.exception() is not None


def _check_driver_options(url: str, driver_url: str) -> None:
    """The options left for redis-py checked now, with no I/O: it refuses an unknown or bad
    one only when it connects, where a typo (``stream_prefx=``) read as an outage retried
    for ever."""
    try:
        pool = aioredis.ConnectionPool.from_url(driver_url)
        pool.make_connection()  # type: ignore[no-untyped-call]
    except ValueError as exc:  # redis-py's own message names the option, not its value
        raise ConfigError(f"redis:// broker: {exc} ({redact_url(url)!r:.200})") from None
    except TypeError as exc:
        known = {*_OPTIONS, *CONSUMER_OPTIONS, *TLS_FILE_OPTIONS}
        for cls in pool.connection_class.__mro__:
            if "__init__" in vars(cls):
                known.update(inspect.signature(vars(cls)["__init__"]).parameters)
        unknown = set(parse_options(url)[1]) - known
        if not unknown:
            raise ConfigError(f"redis:// broker: {exc} ({redact_url(url)!r:.200})") from None
        raise ConfigError(
            f"redis:// broker: unknown URL option(s) {unknown_names(unknown, known)} in "
            f"{redact_url(url)!r:.200}"
        ) from None


class RedisPublisher(Publisher):
    """Appends each message to the stream ``stream_prefix + destination``."""

    schemes = ("redis", "rediss")

    def __init__(
        self,
        url: str,
        *,
        routes: Mapping[str, str] | None = None,
        publish_timeout: float = 30.0,
        stream_prefix: str | None = None,
        maxlen: int | None = None,
    ) -> None:
        super().__init__(url, routes=routes, publish_timeout=publish_timeout)
        # Not left to redis-py: its parsing keeps a name's first value, ours its last.
        check_url_repeats(url, "redis:// broker")
        parts, options = parse_options(url)
        self.stream_prefix = (
            stream_prefix if stream_prefix is not None else options.get("stream_prefix", "")
        )
        given: object = maxlen if maxlen is not None else (options.get("maxlen") or None)
        if given is not None:
            # int() took "1_000", and a number past Redis's 64-bit range failed every XADD
            # inside the relay; absent means unbounded streams.
            maxlen = int_option(given, "redis option maxlen", 1, 2**63 - 1)
        #: Trim each stream to about this many entries (``XADD … MAXLEN ~ n``); None keeps all.
        self.maxlen = maxlen
        _check_tls_files(parts.scheme, options)
        rest = {
            name: value
            for name, value in options.items()
            if name not in _OPTIONS and name not in CONSUMER_OPTIONS
        }
        self._driver_url = parts._replace(query=urlencode(rest)).geturl()
        _check_driver_options(url, self._driver_url)
        self._client: aioredis.Redis | None = None
        #: Connections with no wave on them; a wave takes one, or has the pool make one.
        self._idle: list[Connection] = []
        #: Per stream: the XADD's argument count and bulk strings before the fields.
        self._heads: dict[str, tuple[int, bytes]] = {}
        #: The server's ``proto-max-bulk-len``, read at connect.
        self.bulk_limit = DEFAULT_BULK_LIMIT
        #: A wave met a reply refusing every write (``refuses_writes``): reconnect first.
        self._writes_refused = False
        #: Waves in a row that met such a refusal with no XADD taken (``_REFUSAL_HOLD``),
        #: the last refusal, its stream, and the time.monotonic() before which no connect.
        self._refused_waves = 0
        self._refusal: PublishError | None = None
        self._refused_stream: str | None = None
        self._refused_until = 0.0

    def stream_for(self, message: Message) -> str:
        return self.stream_prefix + self.destination_for(message)

    async def _connect(self) -> None:
        await self._close()
        self._writes_refused = False
        wait = self._refused_until - time.monotonic()
        if self._refused_waves > 1 and wait > 0 and self._refusal is not None:
            # No I/O: the relay backs off as in an outage, /health naming the reply.
            raise PublishError(
                f"redis takes no writes now: {self._refusal.__cause__ or self._refusal} "
                f"(refused {self._refused_waves} wave(s) in a row; connecting again in "
                f"{wait:.1f}s)"
            )
        # No hidden resends in the driver: the relay retries, and a failed wave is reported as such.
        client = aioredis.Redis.from_url(
            self._driver_url, retry=Retry(NoBackoff(), 0), socket_connect_timeout=10
        )
        # The PING goes on the waves' first connection: idle, it is the one whose reader
        # sees Redis close it (see _transport_lost), before any wave ran.
        connection = self._new_connection(client)
        try:
            await connection.connect()  # type: ignore[no-untyped-call]
            await connection.send_command("PING")
            await connection.read_response()
            self.bulk_limit = await _bulk_limit(connection)
            if (risk := eviction_risk(await _memory_settings(connection))) is not None:
                logger.warning(
                    "%s: Redis may evict whole streams (%s): entries published and not yet "
                    "read by every consumer group are then lost, and the groups with them; "
                    "use noeviction or a volatile-* policy",
                    self.safe_url,
                    risk,
                )
            refusal = await _write_refusal(connection, self.stream_prefix, self._refused_stream)
            if refusal is not None:
                # Backed off as an outage by the relay, rather than connected, claimed and
                # failed (see _publish_wave).
                raise PublishError(f"redis takes no writes now: {refusal}")
        except BaseException:
            with contextlib.suppress(rexc.RedisError, OSError):
                await connection.disconnect(nowait=True)
            await client.aclose()
            raise
        self._client, self._idle = client, [connection]

    async def _close(self) -> None:
        idle, self._idle = self._idle, []
        for connection in idle:
            with contextlib.suppress(rexc.RedisError, OSError):
                await connection.disconnect()
        client, self._client = self._client, None
        if client is not None:
            # A broken connection has nothing left to release.
            with contextlib.suppress(rexc.RedisError, OSError):
                await client.aclose()

    def _transport_lost(self) -> bool:
        return (
            self._client is None
            or self._writes_refused
            or any(_closed_by_server(c) for c in self._idle)
        )

    def _head(self, stream: str) -> tuple[int, bytes]:
        head = self._heads.get(stream)
        if head is None:
            args = [b"XADD", stream.encode()]
            if self.maxlen is not None:
                args += [b"MAXLEN", b"~", str(self.maxlen).encode()]
            args.append(b"*")
            if len(self._heads) >= _HEADS_KEPT:  # topics without end: memory stays bounded
                self._heads.clear()
            head = self._heads[stream] = (len(args), b"".join(_bulk(arg) for arg in args))
        return head

    @staticmethod
    def _new_connection(client: aioredis.Redis) -> Connection:
        """A connection of the client's pool settings that the pool does not hand out."""
        return cast(Connection, client.connection_pool.make_connection())  # type: ignore[no-untyped-call]

    async def _publish_wave(self, messages: Sequence[Message]) -> list[BaseException | None]:
        if self._client is None:
            return [rexc.ConnectionError("redis publisher is not connected")] * len(messages)
        results: list[BaseException | None] = [None] * len(messages)
        commands: list[bytes] = []
        sent: list[int] = []  # the index in messages of each command
        for index, message in enumerate(messages):
            try:
                fields = entry_fields(message)
                if (size := _longest(fields, self.bulk_limit)) > self.bulk_limit:
                    # Redis answers a longer argument with a protocol error and closes the
                    # connection: every message of the wave failed as a lost connection,
                    # the same again at each retry, until their attempts ran out.
                    results[index] = PublishError(
                        f"message {message.id}: a field of {size} bytes exceeds the server's "
                        f"proto-max-bulk-len of {self.bulk_limit} bytes",
                        retryable=False,
                    )
                    continue
                command = xadd_command(self._head(self.stream_for(message)), fields)
            except UnicodeEncodeError as exc:  # a lone surrogate: never sendable, on its own
                results[index] = PublishError(
                    f"message {message.id} cannot be encoded for redis: {exc}", retryable=False
                )
                continue
            commands.append(command)
            sent.append(index)
        if not commands:
            return results
        client = self._client
        connection = self._idle.pop() if self._idle else self._new_connection(client)
        reusable = written = False
        taken = refused = False  # an XADD of this wave got an entry id; one met a refusal
        deadline = self._wave_deadline()
        unread = 0  # the position in sent of the next reply
        try:
            await connection.connect()  # type: ignore[no-untyped-call]
            written = True
            await connection.send_packed_command(b"".join(commands))
            # Replies come in order: those read by the deadline are kept, the rest time out
            # on their own (see Publisher._publish_wave). One timer for the wave, not one
            # a reply.
            async with asyncio.timeout_at(deadline):
                for unread, index in enumerate(sent):  # noqa: B007 - read after a timeout
                    try:
                        await connection.read_response()
                        taken = True
                    except rexc.ResponseError as reply:  # read whole: the next reply follows
                        message = messages[index]
                        error = PublishError(
                            f"redis refused XADD to stream {self.stream_for(message)!r}: {reply}",
                            retryable=reply_is_retryable(reply),
                        )
                        error.__cause__ = reply
                        if refuses_writes(reply):
                            # The server's state, not the message: an attempt charged for it
                            # abandoned every message of an outage of some minutes (OOM under
                            # noeviction, a failover that made this node a replica, which
                            # this connection stayed on for ever). Given back unsent, and
                            # the relay reconnects, backing off while _connect's probe
                            # meets the same refusal.
                            self._writes_refused = refused = True
                            self._refusal, self._refused_stream = error, self.stream_for(message)
                            results[index] = NotSent(error)
                            continue
                        results[index] = error
            reusable = True
        except TimeoutError:
            # Not reused: the unread replies would answer the next wave's commands.
            for index in sent[unread:]:
                results[index] = self._wave_timed_out()
        except (rexc.ConnectionError, rexc.TimeoutError, OSError) as exc:
            # No connection to write on: nothing reached Redis, no attempt is counted.
            failure = exc if written else NotSent(exc)
            for index in sent:
                results[index] = failure
        finally:
            if reusable and self._client is client:
                self._idle.append(connection)
            else:  # broken, replies left unread by a cancelled wave, or closed: not reused
                with contextlib.suppress(rexc.RedisError, OSError):
                    await connection.disconnect(nowait=True)
            self._count_refusal(taken=taken, refused=refused)
        return results

    def _count_refusal(self, *, taken: bool, refused: bool) -> None:
        """After a wave: a refusal leaves the next connect to the probe; a second one in a
        row with no XADD taken between holds it off (``_REFUSAL_HOLD``), longer each time:
        the probe passed and did not tell. An XADD taken ends the run."""
        if refused:
            self._refused_waves = 1 if taken else self._refused_waves + 1
            if self._refused_waves > 1:
                hold = _REFUSAL_HOLD.delay(self._refused_waves - 1)
                self._refused_until = time.monotonic() + hold
        elif taken:
            self._refused_waves = 0
            self._refusal = self._refused_stream = None
            self._refused_until = 0.0

    def is_connection_error(self, exc: BaseException) -> bool:
        return isinstance(
            exc, rexc.ConnectionError | rexc.TimeoutError
        ) or super().is_connection_error(exc)


__all__ = ["RedisPublisher", "entry_fields"]


#: redis-py's TLS file options, in tlsfiles' order (CA, certificate, key).
_TLS_FILES = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")


def _check_tls_files(scheme: str, options: Mapping[str, str]) -> None:
    """Load the URL's TLS files once now: redis-py loads them at each connect, where a bad
    one read as an outage for ever ("Error 2 connecting … No such file or directory")."""
    files = {
        ours: options[theirs]
        for ours, theirs in zip(TLS_FILE_OPTIONS, _TLS_FILES, strict=True)
        if options.get(theirs)
    }
    if not files:
        return
    if scheme.lower() != "rediss":
        named = ", ".join(theirs for theirs in _TLS_FILES if options.get(theirs))
        raise ConfigError(f"redis option {named}: TLS needs a rediss:// URL")
    client_context("redis", files, names=_TLS_FILES, password=options.get("ssl_password"))
