"""``nats://``: JetStream publish with a PubAck per message, deduplicated by ``Nats-Msg-Id``.

A message is confirmed once JetStream answered its publish with a PubAck: the
stream stored it (replicated as the stream's ``num_replicas`` says). Every
publish carries ``Nats-Msg-Id: <outbox id>``, so a re-publish inside the
stream's duplicate window is acknowledged as a duplicate and stored once.
A PubAck marked duplicate counts only once the stored message it names is read
back as this message on this subject: the same outbox message for another
destination, on another subject of the same stream, is dropped by JetStream as a
duplicate and is retried after the window (``NatsPublisher._publish_wave``).

The messages of a wave are all sent before their PubAcks are awaited together;
the PubAcks come back on one reply subscription of this publisher (nats-py's
``publish_async`` leaves its future pending forever when JetStream answers with
an error, nats-io/nats.py#985). nats-py's own reconnection is off: the relay
reconnects, and a connection lost mid-wave fails the unconfirmed rest of the
wave at once instead of letting it wait for its PubAck timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import re
import ssl
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextvars import ContextVar
from typing import Any
from urllib.parse import quote, unquote, urlunsplit

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import (
    DiscardPolicy,
    Header,
    PubAck,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)

from outboxer.brokers.base import AckedPublisher, NotSent, option_bool, parse_options
from outboxer.brokers.tlsfiles import TLS_FILE_OPTIONS, client_context, tls_files
from outboxer.config import LONGEST_INTERVAL, duration_option
from outboxer.errors import ConfigError, PublishError
from outboxer.message import Message
from outboxer.redact import get_logger, redact_url

logger = get_logger("outboxer.publisher.nats")

MSG_ID_HEADER = "Nats-Msg-Id"
#: Headers the publisher adds for JetStream, not the user's.
_JETSTREAM_HEADERS = (MSG_ID_HEADER, "Nats-Expected-Stream")
#: The stream's duplicate window when outboxer creates the stream (NATS's own default).
DEFAULT_DUPLICATE_WINDOW = 120.0

#: The PubAcks of the running wave that JetStream answered as duplicates (see
#: ``NatsPublisher._publish_wave``); a context variable, as the relay's loops publish at once.
_DUPLICATES: ContextVar[list[tuple[Message, PubAck]] | None] = ContextVar(
    "outboxer_nats_duplicates", default=None
)
#: Seconds a client whose connect failed gets to close its socket.
_ABANDON_TIMEOUT = 2.0
#: Seconds closing a client may take. nats-py's close writes what is still buffered and
#: waits for the socket to take it and to close: a server that stopped reading (a stalled
#: process, a partition once the socket's buffers are full) held the close, and with it
#: the relay's reconnect and the consumer's, or their shutdown, for ever. Past it the
#: socket is cut: what was unsent is lost (publishes whose wave failed already, acks the
#: server redelivers).
CLOSE_TIMEOUT = 5.0
#: Refusals that the same publish will meet again (the message itself is at fault).
_PERMANENT = (nats.errors.MaxPayloadError, nats.errors.BadSubjectError, nats.errors.BadHeaderError)
#: JetStream refusals with a 4xx code that clear up by themselves: 10002, "resource limits
#: exceeded for account" (the account's JetStream storage is used up; space comes back as
#: messages age out or are consumed, or the operator raises the limit). Not the message's fault.
_RETRYABLE_API_ERRORS = frozenset({10002})
#: JetStream's "maximum bytes exceeded" (503): the stream is full and discards new messages,
#: or the message is larger than the stream could ever hold (_never_fits tells them apart).
_STREAM_FULL = 10077


class _StreamFull(PublishError):
    """A publish refused because the stream is at its ``max_bytes`` (retryable until
    _never_fits finds the message larger than the whole stream)."""


#: The connection is gone: reconnect before going on.
_CONNECTION = (
    nats.errors.ConnectionClosedError,
    nats.errors.StaleConnectionError,
    nats.errors.NoServersError,
    nats.errors.OutboundBufferLimitError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.ConnectionDrainingError,
)


def subject_problem(subject: str, *, wildcards: bool) -> str | None:
    """Why NATS refuses ``subject`` (None: it takes it). With ``wildcards``, a filter: ``*``
    stands for one token, ``>`` for the rest; without, a subject to publish to.

    Checked when the publisher or receiver is built: the server refused such a subject at
    connect, which read as an outage, or as a consumer "existing with other settings"."""
    if not subject:
        return "it is empty"
    if any(character.isspace() for character in subject):
        return "it holds white space"
    tokens = subject.split(".")
    if "" in tokens:
        return "it has an empty token (a '.' at either end, or '..')"
    for place, token in enumerate(tokens):
        if token not in ("*", ">"):
            continue
        if not wildcards:
            return f"a subject to publish to has no wildcards ('{token}' is one)"
        if token == ">" and place != len(tokens) - 1:
            return "'>' stands for the remaining tokens, so it can only be the last"
    return None


@functools.lru_cache(maxsize=4096)
def _publish_subject_problem(subject: str) -> str | None:
    """``subject_problem`` of a subject to publish to, once per subject: checked per message."""
    return subject_problem(subject, wildcards=False)


def check_subject(subject: str, *, wildcards: bool, what: str) -> None:
    """ConfigError naming ``what`` (the option) unless NATS takes ``subject``."""
    if (problem := subject_problem(subject, wildcards=wildcards)) is not None:
        raise ConfigError(f"{what} {subject!r:.200} is not a valid NATS subject: {problem}")


#: Header names NATS takes (nats-py refuses any other with BadHeaderError).
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
#: A header NATS cannot carry as it is travels under this prefix, name and value
#: percent-encoded (``ESCAPED_PREFIX`` + ``quote(name)``: ``quote(value)``).
ESCAPED_PREFIX = "Outboxer-Header-"
_NAME_SAFE = "!#$&'*+-.^_`|~"
_VALUE_SAFE = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) != "%")


def _as_is(name: str, value: str) -> bool:
    """Whether NATS carries the header unchanged: nats-py strips a value and turns its CR
    and LF into spaces, refuses a name that is not a token, and JetStream obeys ``Nats-*``
    headers (a user's ``Nats-Rollup``, ``Nats-TTL``, ``Nats-Expected-*`` would purge the
    stream, expire the message, or fail its publish for good)."""
    return (
        _HEADER_NAME.fullmatch(name) is not None
        and name[:5].lower() != "nats-"
        and value.strip() == value
        and "\r" not in value
        and "\n" not in value
    )


def publish_headers(message: Message) -> dict[str, str]:
    """NATS headers for ``message``: the envelope, the user headers and ``Nats-Msg-Id``."""
    headers = {}
    for name, value in message.envelope_headers().items():
        if _as_is(name, value):
            headers[name] = value
        else:
            escaped = ESCAPED_PREFIX + quote(name, safe=_NAME_SAFE)
            headers[escaped] = quote(value, safe=_VALUE_SAFE)
    headers[MSG_ID_HEADER] = str(message.id)
    return headers


def received_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The envelope and user headers of a delivery: the inverse of ``publish_headers``."""
    carried = {}
    for name, value in headers.items():
        if name.startswith(ESCAPED_PREFIX):
            carried[unquote(name[len(ESCAPED_PREFIX) :])] = unquote(value)
        elif name not in _JETSTREAM_HEADERS:
            carried[name] = value
    return carried


def encoded_size(payload: bytes, headers: Mapping[str, str]) -> int:
    """Bytes the server counts against ``max_payload``: header block plus payload."""
    block = len(b"NATS/1.0\r\n\r\n")
    block += sum(len(name.encode()) + len(value.encode()) + 4 for name, value in headers.items())
    return block + len(payload)


def api_error(error: object) -> nats.js.errors.APIError:
    """JetStream's error object as nats-py's typed error (NotFoundError, BadRequestError…).

    ``APIError.from_error`` raises the error in some nats-py releases and returns it in
    others; an object it cannot take (a field it does not know) still gives an APIError.
    """
    if not isinstance(error, Mapping):
        return nats.js.errors.APIError(description=repr(error)[:200])
    try:
        made = nats.js.errors.APIError.from_error(dict(error))
    except nats.js.errors.APIError as exc:
        return exc
    except (TypeError, KeyError, ValueError):
        made = None
    if isinstance(made, nats.js.errors.APIError):
        return made
    code, err_code = error.get("code"), error.get("err_code")
    return nats.js.errors.APIError(
        code=code if isinstance(code, int) else None,
        description=str(error.get("description", error)),
        err_code=err_code if isinstance(err_code, int) else None,
    )


async def abandon(nc: Client) -> None:
    """Close the socket of a client whose connect failed (nats-py leaves it open); bounded,
    since the server may be the one that never answered."""
    await close_client(nc, _ABANDON_TIMEOUT)


async def close_client(nc: Client, timeout: float | None = None) -> None:
    """Close ``nc`` within ``timeout`` seconds (CLOSE_TIMEOUT), else cut its socket, which
    ends nats-py's close at once (its wait for the socket wakes). Never raises for a
    connection that is broken or cut."""
    limit = CLOSE_TIMEOUT if timeout is None else timeout
    closing = asyncio.ensure_future(nc.close())
    try:
        done, _ = await asyncio.wait((closing,), timeout=limit)
        if not done:
            logger.warning(
                "nats: the server did not take the connection's close within %gs: cut", limit
            )
            _cut(nc)
            done, _ = await asyncio.wait((closing,), timeout=limit)
    finally:
        if not closing.done():  # cancelled, or a close that outlived the cut (not seen)
            _cut(nc)
            closing.cancel()
    if done and not closing.cancelled():
        error = closing.exception()
        if error is not None and not isinstance(
            error, nats.errors.Error | OSError | asyncio.TimeoutError
        ):
            raise error


def _cut(nc: Client) -> None:
    """Abort ``nc``'s socket, dropping what it still buffers. nats-py has no call for it:
    its transport's stream writer is reached by name, and a transport without one (none
    yet, a websocket) is left as it is."""
    writer = getattr(getattr(nc, "_transport", None), "_io_writer", None)
    transport = getattr(writer, "transport", None)
    if isinstance(transport, asyncio.WriteTransport):
        transport.abort()


#: The consumer's own URL options (outboxer.receivers.nats), accepted on the relay's side
#: too: one URL serves both.
CONSUMER_OPTIONS = ("ack_wait", "durable")


def stream_warnings(config: StreamConfig) -> list[str]:
    """What in a stream's configuration drops or loses messages JetStream confirmed.

    ``discard: new`` keeps messages from being dropped at ``max_msgs`` and ``max_bytes``
    only (JetStream refuses the publish instead), and at ``max_msgs_per_subject`` only with
    ``discard_new_per_subject``: without it a subject's oldest message goes, as it does past
    ``max_age`` whatever the discard policy (a stream with ``discard: new``, ``max_age`` and
    ``max_msgs_per_subject: 1`` confirmed two messages of a topic and kept one, then none,
    and said nothing)."""

    def given(value: float | None) -> bool:
        return value is not None and value > 0

    discard_new = config.discard == DiscardPolicy.NEW
    dropped = [
        f"{name} {value}"
        for name, value, refused in (
            ("max_msgs", config.max_msgs, discard_new),
            ("max_bytes", config.max_bytes, discard_new),
            # Counts per topic (the subject), not per message key.
            (
                "max_msgs_per_subject",
                config.max_msgs_per_subject,
                discard_new and bool(config.discard_new_per_subject),
            ),
        )
        if given(value) and not refused
    ]
    said = []
    if dropped:
        said.append(
            f"discard {'new' if discard_new else 'old'} with {', '.join(dropped)}: JetStream "
            "removes the oldest messages past them, read by a consumer or not; messages a "
            "consumer group has not applied yet are then lost"
        )
    if given(config.max_age):
        said.append(
            f"max_age {config.max_age}s: JetStream removes messages older than that, read by "
            "a consumer or not (whatever the discard policy); messages a consumer group has "
            "not applied by then are lost"
        )
    if config.retention == RetentionPolicy.INTEREST:
        said.append(
            "interest retention: a message published while no consumer's filter takes its "
            "subject is removed at once (before a consumer group's first connect, say)"
        )
    if config.storage == StorageType.MEMORY:
        said.append(
            "memory storage: the messages a consumer has not applied yet are lost when the "
            "server restarts"
        )
    return said


class NatsPublisher(AckedPublisher[Msg]):
    """Publishes each message to the subject ``subject_prefix + destination`` on JetStream."""

    schemes = ("nats",)
    url_options = frozenset(
        (
            "subject_prefix",
            "stream",
            "create_stream",
            "subjects",
            "duplicate_window",
            "tls",
            "creds",
            "connect_timeout",
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
        subject_prefix: str | None = None,
        stream: str | None = None,
        create_stream: bool | None = None,
        subjects: Sequence[str] | str | None = None,
        duplicate_window: float | None = None,
        tls: bool | None = None,
        creds: str | None = None,
        connect_timeout: float | None = None,
        cafile: str | None = None,
        certfile: str | None = None,
        keyfile: str | None = None,
    ) -> None:
        super().__init__(url, routes=routes, publish_timeout=publish_timeout)
        parts, options = parse_options(url)
        if not parts.hostname:
            raise ConfigError(f"NATS URL needs a host: {redact_url(url)!r} (nats://127.0.0.1:4222)")
        self.subject_prefix = (
            subject_prefix if subject_prefix is not None else options.get("subject_prefix", "")
        )
        #: Expected stream (sent as ``Nats-Expected-Stream``) and the one to create.
        self.stream = stream if stream is not None else (options.get("stream") or None)
        self.create_stream = option_bool(options, "create_stream", create_stream, False)
        if subjects is None:
            subjects = options.get("subjects") or None
        if isinstance(subjects, str):
            subjects = [s.strip() for s in subjects.split(",") if s.strip()]
        self.subjects = list(
            subjects or ([f"{self.subject_prefix}>"] if self.subject_prefix else [])
        )
        # Finite and bounded, as Kafka's connect_timeout: float() took nan and inf, which
        # failed every connect (stream creation) as if NATS were down, for good.
        self.duplicate_window = duration_option(
            duplicate_window
            if duplicate_window is not None
            else options.get("duplicate_window") or DEFAULT_DUPLICATE_WINDOW,
            "nats option duplicate_window",
            0.001,
            LONGEST_INTERVAL,
        )
        # A prefix forms subjects with each destination: checked with a stand-in one.
        if self.subject_prefix and (
            problem := subject_problem(self.subject_prefix + "x", wildcards=False)
        ):
            raise ConfigError(
                f"nats option subject_prefix {self.subject_prefix!r:.200} does not start valid "
                f"NATS subjects: {problem}"
            )
        for subject in self.subjects:
            check_subject(subject, wildcards=True, what="nats option subjects:")
        for topic, route in self.routes.items():
            check_subject(
                self.subject_prefix + route, wildcards=False, what=f"route for topic {topic!r}:"
            )
        if self.create_stream and not self.stream:
            raise ConfigError("create_stream needs a stream name (option stream)")
        if self.create_stream and not self.subjects:
            raise ConfigError("create_stream needs subjects (option subjects, or a subject_prefix)")
        self.tls = option_bool(options, "tls", tls, False)
        files = tls_files(options, {"cafile": cafile, "certfile": certfile, "keyfile": keyfile})
        if files and not self.tls:  # else ignored: nats-py would use the system's CAs
            raise ConfigError(f"nats option {', '.join(files)} needs tls=true")
        #: Made now when files are given (a bad one is a ConfigError at start), else at the
        #: first connect: the system's CA certificates take a while to load.
        self._tls_context = client_context("nats", files) if files else None
        self.creds = creds if creds is not None else (options.get("creds") or None)
        if self.creds:  # nats-py reads it at each connect, where a bad one was an outage
            try:
                with open(self.creds, "rb"):
                    pass
            except OSError as exc:
                reason = exc.strerror or type(exc).__name__
                raise ConfigError(
                    f"nats option creds: cannot read {self.creds!r}: {reason}"
                ) from None
        self.connect_timeout = duration_option(
            connect_timeout
            if connect_timeout is not None
            else options.get("connect_timeout") or 10.0,
            "nats option connect_timeout",
            0.001,
            3600,
        )
        # nats://user:pass@a:4222,b:4222 names a cluster: one server URL per host.
        self.servers = [
            urlunsplit((parts.scheme, host, "", "", "")) for host in parts.netloc.split(",")
        ]
        self._nc: Client | None = None
        self._js: JetStreamContext | None = None
        self._lost = asyncio.Event()
        #: PubAck replies arrive on ``<inbox>.<token>``; each token's future gets the reply.
        self._inbox = ""
        self._replies: dict[str, asyncio.Future[Msg]] = {}
        self._tokens = itertools.count()
        #: A PubAck said no stream listens on a subject (see ``_recreate_stream``).
        self._stream_missing = False
        #: A stream that can never confirm a publish (``_check_stream``): every connect
        #: raises it, so the relay stops with it.
        self._stream_refused: PublishError | None = None

    def subject_for(self, message: Message) -> str:
        return self.subject_prefix + self.destination_for(message)

    async def open_client(
        self, lost: asyncio.Event, on_error: Callable[[Exception], Awaitable[None]]
    ) -> Client:
        """A client connected with this URL's options; ``lost`` is set once it disconnects
        or closes. The publisher and the receiver connect through here."""

        async def on_disconnect() -> None:
            lost.set()

        nc = Client()
        try:
            await nc.connect(
                **self.connection_options(),
                error_cb=on_error,
                disconnected_cb=on_disconnect,
                closed_cb=on_disconnect,
            )
        except BaseException:
            # With reconnects off, nats-py gives up a server that took the TCP connection
            # but never answered (hung, partitioned) without closing it: one socket leaked
            # per reconnect attempt.
            await abandon(nc)
            raise
        return nc

    async def _connect(self) -> None:
        await self._close()
        if self._stream_refused is not None:
            raise self._stream_refused
        lost = self._lost = asyncio.Event()

        # nats-py reports each failed try of a connect here (twice for one refused server)
        # before it raises NoServersError, which the relay logs, backing off: three lines
        # per reconnect in an outage, and the one of the relay without the cause. While
        # connecting, the errors are kept and the last one is raised as the cause instead.
        connecting: list[Exception] | None = []

        async def on_error(error: Exception) -> None:
            if connecting is not None:
                connecting.append(error)
            else:
                logger.warning("nats: %s: %s", type(error).__name__, error)
                if isinstance(error, nats.errors.FlushTimeoutError):
                    # More than nats-py's pending buffer (2 MB) waited flush_timeout for the
                    # socket: the server is not reading. The connection is lost: the wave
                    # stops sending into it and fails at once, and the relay reconnects.
                    lost.set()

        try:
            nc = await self.open_client(lost, on_error)
        except nats.errors.NoServersError as exc:
            if connecting:
                raise connecting[-1] from exc
            raise
        finally:
            tried, connecting = connecting, None
        for error in tried or ():  # a server of a cluster that failed before one took it
            logger.info("nats: connected after %s: %s", type(error).__name__, error)
        self._nc, self._js = nc, nc.jetstream(timeout=self.publish_timeout)
        self._inbox = nc.new_inbox()
        await nc.subscribe(f"{self._inbox}.*", cb=self._on_reply)
        if self.create_stream:
            try:
                await self.ensure_stream(self._js)
            except BaseException:
                await self._close()
                raise

        if self.stream:
            try:
                await self._check_stream(self._js, self.stream)
            except BaseException:
                await self._close()
                raise

    async def _check_stream(self, js: JetStreamContext, stream: str, *, warn: bool = True) -> None:
        """Refuse a stream that never confirms a publish (``no_ack``); warn of settings that
        drop confirmed messages. A stream that cannot be read (missing, not allowed) is
        left to the publishes to report, as before."""
        try:
            config = (await js.stream_info(stream)).config
        except (nats.errors.Error, TimeoutError) as exc:
            logger.debug("no configuration of stream %r: %s", stream, exc)
            return
        if config.no_ack:
            # Its publishes get no PubAck: each wave waited publish_timeout, failed as a
            # timeout, an attempt charged, published again (stored again after the
            # duplicate window), until every message was abandoned, all of them stored.
            self._stream_refused = PublishError(
                f"JetStream stream {stream!r} is configured with no_ack: it stores messages "
                "without acknowledging them, so no publish can ever be confirmed (turn "
                "no_ack off, or publish to another stream)",
                retryable=False,
            )
            raise self._stream_refused
        for warning in stream_warnings(config) if warn else ():
            logger.warning("JetStream stream %r: %s", stream, warning)

    def connection_options(self) -> dict[str, Any]:
        """``nats.connect`` arguments from the URL (servers, TLS, credentials, timeouts);
        the consumer side (outboxer.receivers.nats) connects with them too."""
        options: dict[str, Any] = {
            "servers": self.servers,
            "name": "outboxer",
            "allow_reconnect": False,
            "max_reconnect_attempts": 1,
            "reconnect_time_wait": 0.5,
            "connect_timeout": max(1, round(self.connect_timeout)),
            # A publish that finds more than 2 MB unsent waits for the socket to take it
            # (a "forced flush"), without a bound by default and swallowing the
            # cancellation of the wave's own timeout: a server that stopped reading held
            # the relay's publish for ever. Half the wave's bound leaves the wave time to
            # end with each message's outcome.
            "flush_timeout": self.publish_timeout / 2,
        }
        if self.tls:
            if self._tls_context is None:
                self._tls_context = ssl.create_default_context()
            options["tls"] = self._tls_context
        if self.creds:
            options["user_credentials"] = self.creds
        return options

    async def ensure_stream(self, js: JetStreamContext) -> None:
        """Create the stream unless it exists (an existing stream is never changed)."""
        assert self.stream is not None
        try:
            await js.stream_info(self.stream)
            return
        except nats.js.errors.NotFoundError:
            pass
        try:
            await js.add_stream(
                name=self.stream, subjects=self.subjects, duplicate_window=self.duplicate_window
            )
        except nats.js.errors.BadRequestError as exc:
            if exc.err_code != 10058:  # created meanwhile by another relay: fine
                raise PublishError(
                    f"cannot create JetStream stream {self.stream!r}: {exc}", retryable=False
                ) from exc

    async def _on_reply(self, msg: Msg) -> None:
        future = self._replies.pop(msg.subject[len(self._inbox) + 1 :], None)
        if future is not None and not future.done():
            future.set_result(msg)

    async def _close(self) -> None:
        nc, self._nc, self._js = self._nc, None, None
        for future in self._replies.values():
            future.cancel()
        self._replies.clear()
        if nc is not None and not nc.is_closed:
            await close_client(nc)  # bounded: a server that stopped reading

    def _check_size(self, message: Message, headers: Mapping[str, str]) -> None:
        """Refuse for good what the server would refuse by closing the connection."""
        assert self._nc is not None
        size = encoded_size(message.payload, headers)
        if size > self._nc.max_payload:
            raise PublishError(
                f"message of {size} bytes (headers included) exceeds the server's max_payload "
                f"of {self._nc.max_payload} bytes",
                retryable=False,
            )

    def _refusal(self, subject: str, exc: BaseException) -> BaseException:
        """The error to report for a publish that failed with ``exc``."""
        if isinstance(exc, nats.js.errors.APIError):
            code = exc.code or 0
            if exc.err_code == _STREAM_FULL:
                return _StreamFull(f"JetStream refused {subject!r}: {exc}")
            return PublishError(
                f"JetStream refused {subject!r}: {exc}",
                retryable=not 400 <= code < 500
                or code in (408, 429)
                or exc.err_code in _RETRYABLE_API_ERRORS,
            )
        if isinstance(exc, _PERMANENT):
            return PublishError(
                f"cannot publish to {subject!r}: {type(exc).__name__}: {exc}", retryable=False
            )
        return exc

    def _outcome(self, message: Message, reply: Msg) -> BaseException | None:
        """None if ``reply`` is a PubAck, else the error it means."""
        subject = self.subject_for(message)
        if reply.headers and reply.headers.get(Header.STATUS) == "503":
            self._stream_missing = True
            return PublishError(f"no JetStream stream listens on subject {subject!r}")
        try:
            answer = json.loads(reply.data)
            if "error" in answer:
                return self._refusal(subject, api_error(answer["error"]))
            ack = PubAck.from_response(answer)
        except (ValueError, TypeError, KeyError) as exc:
            return PublishError(f"unexpected PubAck for {subject!r}: {reply.data[:200]!r} ({exc})")
        if ack.duplicate:
            logger.debug("message %s was already in stream %s (duplicate)", message.id, ack.stream)
            duplicates = _DUPLICATES.get()
            if duplicates is not None:  # checked once the wave's acks are all in
                duplicates.append((message, ack))
        return None

    async def _publish_wave(self, messages: Sequence[Message]) -> list[BaseException | None]:
        """The base class's wave, then a check of each PubAck that says "duplicate".

        JetStream drops a publish whose ``Nats-Msg-Id`` it stored within the duplicate
        window and answers it as a duplicate, on whatever subject it came. That is a
        relay's retry when the stored message is on the same subject; when it is not, it
        is the same outbox message for another destination (several destinations copy a
        message under one id) whose subject the same stream captures, and it was never
        stored: it must not count as published.
        """
        # The base class's backstop fails the whole wave, the confirmed messages included,
        # ``publish_timeout`` after about now: the work after the acks (a duplicate check,
        # recreating the stream: JetStream requests with that same timeout) ends before it.
        end = asyncio.get_running_loop().time() + self.publish_timeout - self._wave_margin() / 2
        found: list[tuple[Message, PubAck]] = []
        token = _DUPLICATES.set(found)
        try:
            results = await super()._publish_wave(messages)
        finally:
            _DUPLICATES.reset(token)
        recreate = asyncio.ensure_future(self._recreate_stream()) if self._stream_missing else None
        unanswered = [
            index for index, error in enumerate(results) if isinstance(error, TimeoutError)
        ]
        no_ack = (
            asyncio.ensure_future(self._unacknowledging(messages[unanswered[0]]))
            if unanswered and not self.stream and self._stream_refused is None
            else None
        )
        checks = [asyncio.ensure_future(self._duplicate_error(m, ack)) for m, ack in found]
        full = [
            (index, asyncio.ensure_future(self._never_fits(messages[index], error)))
            for index, error in enumerate(results)
            if isinstance(error, _StreamFull)
        ]
        work: list[asyncio.Future[Any]] = [
            *checks,
            *(check for _, check in full),
            *([recreate] if recreate else []),
            *([no_ack] if no_ack else []),
        ]
        if not work:
            return results
        try:
            await asyncio.wait(work, timeout=self._wave_remaining(end))
        finally:
            for task in work:
                task.cancel()  # no-op for the finished ones
            await asyncio.wait(work)
        if recreate is not None and recreate.cancelled():
            # The next wave that meets no stream tries again.
            logger.warning(
                "cannot create JetStream stream %s again: no answer before publish_timeout",
                self.stream,
            )
        if self._stream_refused is not None:
            # A no_ack stream: not the messages' fault, given back uncharged; the relay
            # reconnects, which raises the refusal and stops it.
            for index in unanswered:
                results[index] = NotSent(self._stream_refused)
        position = {id(message): index for index, message in enumerate(messages)}
        for (message, _), check in zip(found, checks, strict=True):
            error = self._unchecked(message) if check.cancelled() else check.exception()
            if error is None:
                error = check.result()
            if error is not None:
                results[position[id(message)]] = error
        for index, check in full:
            if not check.cancelled() and check.exception() is None and check.result() is not None:
                results[index] = check.result()
        return results

    async def _unacknowledging(self, message: Message) -> None:
        """Check the stream of a message whose PubAck never came for ``no_ack`` (sets the
        refusal): without the ``stream`` option it was not checked at connect."""
        js = self._js
        if js is None:
            return
        try:
            stream = await js.find_stream_name_by_subject(self.subject_for(message))
            await self._check_stream(js, stream, warn=False)
        except (nats.errors.Error, TimeoutError) as exc:
            logger.debug("no stream for %r: %s", self.subject_for(message), exc)
        except PublishError:
            pass  # the refusal, kept in self._stream_refused

    async def _never_fits(self, message: Message, error: _StreamFull) -> PublishError | None:
        """For a publish the stream refused as full (``discard: new`` at ``max_bytes``):
        a refusal for good if the message alone is larger than the stream's whole
        ``max_bytes``, which no consumer's progress can make room for; else None (the
        stream may drain: retried). JetStream answers both with the same error."""
        js = self._js
        if js is None:
            return None
        subject = self.subject_for(message)
        try:
            stream = self.stream or await js.find_stream_name_by_subject(subject)
            limit = (await js.stream_info(stream)).config.max_bytes or -1
        except (nats.errors.Error, TimeoutError) as exc:
            logger.debug("no stream limit for %r: %s", subject, exc)
            return None
        if 0 < limit < len(message.payload):
            return PublishError(
                f"{error}: a payload of {len(message.payload)} bytes can never fit stream "
                f"{stream!r}, whose max_bytes is {limit}",
                retryable=False,
            )
        return None

    def _unchecked(self, message: Message) -> PublishError:
        """A message JetStream answered as a duplicate whose stored copy could not be read
        back before the wave's end: only it fails, retryably (its publish again is checked
        again); the others keep their outcome."""
        return PublishError(
            f"JetStream answered the publish to {self.subject_for(message)!r} as a duplicate of "
            f"Nats-Msg-Id {message.id}, and the stored message could not be read back within "
            f"{self.publish_timeout}s: published again"
        )

    async def _recreate_stream(self) -> None:
        """With ``create_stream``, create the stream again once a publish found no stream on
        its subject: the stream was deleted while the relay ran (by an operator, or with a
        server that lost its storage). It was created only at connect, and the connection
        stays up, so every message failed "no JetStream stream listens" until its attempts
        ran out. The messages of this wave stay failed (retryable); their retry is stored."""
        self._stream_missing = False
        js = self._js
        if not self.create_stream or js is None:
            return
        try:
            await self.ensure_stream(js)
        except (PublishError, nats.errors.Error, TimeoutError) as exc:
            logger.warning("cannot create JetStream stream %s again: %s", self.stream, exc)
        else:
            logger.warning("JetStream stream %s was missing: created it again", self.stream)

    async def _duplicate_error(self, message: Message, ack: PubAck) -> PublishError | None:
        """None if the message JetStream answered ``ack`` (a duplicate) for is ``message``
        on its own subject, else why it does not count as published.

        Retryable, after the duplicate window: a publish after it is stored. A stored
        message that cannot be read back (deleted since, as a work-queue stream does once
        consumed, or no permission to read it) cannot tell a retry from another
        destination's copy, so it takes that path too: at worst a consumer sees the
        message once more, and deduplicates it on ``outboxer-id``.
        """
        subject = self.subject_for(message)
        js = self._js
        stored_subject: str | None = None
        reason = ""
        if js is not None:
            try:
                stored = await js.get_msg(ack.stream, ack.seq)
            except (TimeoutError, nats.errors.Error) as exc:
                reason = f"; the stored message cannot be read back: {type(exc).__name__}: {exc}"
            else:
                stored_id = (stored.headers or {}).get(MSG_ID_HEADER)
                if stored.subject == subject and stored_id == str(message.id):
                    return None
                stored_subject = stored.subject
        if stored_subject is not None:
            reason = f"; sequence {ack.seq} holds it on subject {stored_subject!r}"
        return PublishError(
            f"JetStream stream {ack.stream!r} dropped the publish to {subject!r} as a duplicate "
            f"of Nats-Msg-Id {message.id}{reason}: not stored on {subject!r}, published again "
            "once the stream's duplicate window is over",
            retry_after=await self._window_of(ack.stream),
        )

    async def _window_of(self, stream: str) -> float:
        """The duplicate window of ``stream``, in seconds (outboxer's default if unknown)."""
        js = self._js
        if js is not None:
            with contextlib.suppress(nats.errors.Error, asyncio.TimeoutError):
                window = (await js.stream_info(stream)).config.duplicate_window
                if window:
                    return float(window)
        return self.duplicate_window

    # ----- primitives of AckedPublisher -----------------------------------------------------

    def _connection_lost_event(self) -> asyncio.Event | None:
        nc = self._nc
        return None if nc is None or nc.is_closed else self._lost

    def _transport_lost(self) -> bool:
        nc = self._nc
        return nc is None or nc.is_closed or self._lost.is_set() or self._stream_refused is not None

    async def _send(self, message: Message) -> asyncio.Future[Msg]:
        nc = self._nc
        if nc is None or self._lost.is_set():  # lost: a forced flush gave up (on_error)
            raise nats.errors.ConnectionClosedError()
        subject = self.subject_for(message)
        if (problem := _publish_subject_problem(subject)) is not None:
            # Routes are checked at start, a topic without one only here: a wildcard token
            # was stored on a literal subject ('a.*') that filters match unlike any other, and
            # an empty token failed "no stream listens", retried as if the stream were down.
            raise PublishError(f"cannot publish to {subject!r:.200}: {problem}", retryable=False)
        headers = publish_headers(message)
        if self.stream:
            headers[Header.EXPECTED_STREAM] = self.stream
        token = str(next(self._tokens))
        future: asyncio.Future[Msg] = asyncio.get_running_loop().create_future()
        self._replies[token] = future
        # Answered, or given up (cancelled) by the wave: the token is no longer awaited.
        future.add_done_callback(lambda _: self._replies.pop(token, None))
        try:
            self._check_size(message, headers)
            await nc.publish(
                subject, message.payload, reply=f"{self._inbox}.{token}", headers=headers
            )
        except (PublishError, nats.errors.Error) as exc:
            del self._replies[token]
            future.cancel()
            error = self._refusal(subject, exc)
            if error is exc:
                raise
            raise error from exc
        return future

    def _ack_error(self, message: Message, ack: Msg) -> BaseException | None:
        return self._outcome(message, ack)

    def _connection_error(self, detail: str) -> BaseException:
        return nats.errors.ConnectionClosedError()  # nats-py's fixed text; detail is dropped

    def is_connection_error(self, exc: BaseException) -> bool:
        return isinstance(exc, _CONNECTION) or super().is_connection_error(exc)


__all__ = [
    "ESCAPED_PREFIX",
    "MSG_ID_HEADER",
    "NatsPublisher",
    "encoded_size",
    "publish_headers",
    "received_headers",
    "stream_warnings",
]
