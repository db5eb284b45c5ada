"""``redis://`` and ``rediss://``: one XADD per message to a Redis stream, pipelined per wave.

A message is confirmed once Redis answered its XADD with an entry id: the entry
is in the server's memory (and in its AOF/RDB as far as the server's own
persistence settings go). A wave travels as one non-transactional pipeline, so
a batch costs one round trip per wave; each XADD's reply is mapped on its own.

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

import contextlib
import json
from collections.abc import Mapping, Sequence
from urllib.parse import urlencode

import redis.asyncio as aioredis
from redis import exceptions as rexc
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.typing import EncodableT, FieldT

from outboxer.brokers.base import Publisher, parse_options
from outboxer.errors import ConfigError, PublishError
from outboxer.message import Message

#: Our own URL options; the rest of the query string goes to redis-py.
_OPTIONS = ("stream_prefix", "maxlen")

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


def entry_fields(message: Message) -> dict[FieldT, EncodableT]:
    """The stream entry for ``message`` (see the module docstring)."""
    fields: dict[FieldT, EncodableT] = {"id": str(message.id), "topic": message.topic}
    if message.key is not None:
        fields["key"] = message.key
    fields["content_type"] = message.content_type
    fields["payload"] = message.payload
    fields["headers"] = json.dumps(dict(message.headers), ensure_ascii=False, separators=(",", ":"))
    if message.created_at is not None:
        fields["created_at"] = message.created_at.isoformat()
    return fields


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
        parts, options = parse_options(url)
        self.stream_prefix = (
            stream_prefix if stream_prefix is not None else options.get("stream_prefix", "")
        )
        if maxlen is None and options.get("maxlen", "") != "":
            try:
                maxlen = int(options["maxlen"])
            except ValueError:
                raise ConfigError(f"maxlen must be an integer, not {options['maxlen']!r}") from None
        if maxlen is not None and maxlen <= 0:
            raise ConfigError(
                f"maxlen must be positive (or absent for unbounded streams), not {maxlen}"
            )
        #: Trim each stream to about this many entries (``XADD … MAXLEN ~ n``); None keeps all.
        self.maxlen = maxlen
        rest = {name: value for name, value in options.items() if name not in _OPTIONS}
        self._driver_url = parts._replace(query=urlencode(rest)).geturl()
        self._client: aioredis.Redis | None = None

    def stream_for(self, message: Message) -> str:
        return self.stream_prefix + self.destination_for(message)

    async def _connect(self) -> None:
        await self._close()
        # No hidden resends in the driver: the relay retries, and a failed wave is reported as such.
        client = aioredis.Redis.from_url(
            self._driver_url, retry=Retry(NoBackoff(), 0), socket_connect_timeout=10
        )
        try:
            await client.ping()
        except BaseException:
            await client.aclose()
            raise
        self._client = client

    async def _close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            # A broken connection has nothing left to release.
            with contextlib.suppress(rexc.RedisError, OSError):
                await client.aclose()

    async def _publish_wave(self, messages: Sequence[Message]) -> list[BaseException | None]:
        if self._client is None:
            return [rexc.ConnectionError("redis publisher is not connected")] * len(messages)
        try:
            async with self._client.pipeline(transaction=False) as pipe:
                for message in messages:
                    pipe.xadd(
                        self.stream_for(message),
                        entry_fields(message),
                        maxlen=self.maxlen,
                        approximate=True,
                    )
                replies = await pipe.execute(raise_on_error=False)
        except (rexc.ConnectionError, rexc.TimeoutError, OSError) as exc:
            return [exc] * len(messages)
        results: list[BaseException | None] = []
        for message, reply in zip(messages, replies, strict=True):
            if isinstance(reply, rexc.ResponseError):
                error = PublishError(
                    f"redis refused XADD to stream {self.stream_for(message)!r}: {reply}",
                    retryable=reply_is_retryable(reply),
                )
                error.__cause__ = reply
                results.append(error)
            elif isinstance(reply, BaseException):
                results.append(reply)
            else:
                results.append(None)
        return results

    def is_connection_error(self, exc: BaseException) -> bool:
        return isinstance(
            exc, rexc.ConnectionError | rexc.TimeoutError
        ) or super().is_connection_error(exc)


__all__ = ["RedisPublisher", "entry_fields"]
