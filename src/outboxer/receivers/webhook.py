"""The webhook receiver: an ASGI app that applies the relay's webhooks like every consumer.

``WebhookReceiver(db=URL, group=NAME, handler=fn, secret=SECRET)`` is an ASGI application;
mount it in any ASGI app (Starlette's ``app.mount("/hooks", receiver)``, FastAPI, Django's
ASGI router) or serve it alone (``uvicorn module:receiver``). For each POST it

1. checks the signature with :func:`outboxer.webhook_signature.verify_request` (401 if
   it does not check out, or if it covers the body only: scheme v1, which a request
   stripped of its v2 signature looks like; ``require_signed_headers=False`` accepts that
   from relays older than v2; ``secret=None`` accepts unsigned requests, for trusted
   networks); only the headers the signature covers reach the handler;
2. applies the message in the consumer's transaction, as ``outboxer consume`` does: the
   inbox claim and the handler's writes commit together (``consumer_db``);
3. answers 200 once that committed, or for a duplicate (the inbox had it), or for a
   message held behind a dead letter of its key; that answer is the acknowledgement.

A handler that raises rolls back and the answer is 503 with ``Retry-After`` set to the
consumer's backoff for that attempt: the relay sends the message again (it honours
Retry-After, up to its own backoff cap). After ``max_attempts`` failures, counted by this
process, the message goes to the dead-letter table and the answer is 200. A claim-checked
payload the object store does not return (no answer within ``object_store_timeout``, or
the object is missing) is such a failure too, as ``outboxer consume`` counts it. The relay sends
a key's next message only after the previous one's 2xx, so a key's messages are applied
in order. A database that does not answer is a 503 too, with no attempt counted.

The body is read whole before a session is taken (slow clients hold none), within
``body_timeout`` (408 past it) and ``max_body`` (413); both answers close the connection,
and ``close()`` answers the bodies still arriving with 503 at once. A body over ``max_body``
is read to its end and thrown away before the 413 (within ``body_timeout``, while its bytes
keep coming, up to 64 MiB or four times ``max_body``): a connection closed with bytes unread
is reset, which made the sender lose the 413 (the relay retried what is never taken).

Request layout (see ``docs/brokers/webhook.md``): the body is the payload; ``Outboxer-Id``,
``Outboxer-Topic``, ``Outboxer-Key`` (percent-encoded), ``Outboxer-Created-At`` and
``Content-Type`` carry the envelope; the user's headers come as they are, or as
``Outboxer-Header-<name>`` for names HTTP or outboxer own. The handler sees those user
headers, without HTTP's own (Host, User-Agent, Accept …).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, MutableMapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from outboxer.brokers.base import describe
from outboxer.brokers.webhook import (
    HEADER_CREATED_AT,
    HEADER_KEY,
    HEADER_TOPIC,
    RESERVED_PREFIX,
    decode_header_value,
)
from outboxer.consumer import Consumer, Handler, HoldFailed, Unreadable
from outboxer.consumer_db import BatchFailed, Result, Session
from outboxer.errors import ConfigError
from outboxer.message import HEADER_CREATED_AT as ENVELOPE_CREATED_AT
from outboxer.message import HEADER_KEY as ENVELOPE_KEY
from outboxer.message import HEADER_TOPIC as ENVELOPE_TOPIC
from outboxer.receivers.base import decode
from outboxer.redact import get_logger, redact_text
from outboxer.retry import Backoff
from outboxer.stores import create_store
from outboxer.webhook_signature import (
    DEFAULT_TOLERANCE,
    HEADER_ID,
    HEADER_SIGNATURE,
    HEADER_SIGNED_HEADERS,
    HEADER_TIMESTAMP,
    Secret,
    WebhookSignatureError,
    verify_request,
)

if TYPE_CHECKING:
    from outboxer.claimcheck import ObjectStore
    from outboxer.crypto import KeyRing

# Redacting: this runs inside the user's ASGI app, whose handlers see these lines as they are.
logger = get_logger("outboxer.consumer.webhook")

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

#: Request headers that are HTTP's (or a proxy's), not the message's.
_TRANSPORT = frozenset(
    {
        "host",
        "content-length",
        "content-type",
        "user-agent",
        "accept",
        "accept-encoding",
        "connection",
        "keep-alive",
        "transfer-encoding",
        "te",
        "expect",
        "authorization",
        "forwarded",
        "via",
    }
)
_ENVELOPE = frozenset(
    name.lower()
    for name in (HEADER_ID, HEADER_TOPIC, HEADER_KEY, HEADER_CREATED_AT, HEADER_TIMESTAMP)
) | {HEADER_SIGNATURE.lower(), HEADER_SIGNED_HEADERS.lower()}
#: Messages whose failures are remembered (oldest forgotten first).
_REMEMBERED = 10_000
#: The bytes of a body over ``max_body`` read and thrown away before the 413, at least (four
#: times ``max_body`` if that is more); past them its connection closes unread.
_MAX_DRAIN = 64 * 1024 * 1024
#: Seconds without a byte of such a body after which the 413 is sent without the rest.
_DRAIN_IDLE = 1.0


class WebhookReceiver:
    """An ASGI app applying one consumer group's webhooks to a database (see the module)."""

    def __init__(
        self,
        *,
        db: str,
        group: str,
        handler: Handler | str,
        secret: Secret | Sequence[Secret] | None,
        tolerance: float | None = DEFAULT_TOLERANCE,
        concurrency: int = 4,
        max_attempts: int = 10,
        backoff: Backoff | None = None,
        abandoned_blocks_key: bool = False,
        schema: str = "outboxer",
        table: str = "outbox",
        max_body: int = 16 * 1024 * 1024,
        async_driver: str | None = None,
        keyring: KeyRing | None = None,
        object_store: ObjectStore | None = None,
        require_signed_headers: bool = True,
        shutdown_timeout: float = 30.0,
        object_store_timeout: float = 30.0,
        body_timeout: float | None = 30.0,
    ) -> None:
        if body_timeout is not None and not body_timeout > 0:
            raise ConfigError("body_timeout must be positive (or None: no bound)")
        if max_body < 0:
            raise ConfigError("max_body must not be negative")
        self.consumer = Consumer(
            db=db,
            broker=None,
            group=group,
            handler=handler,
            concurrency=concurrency,
            max_attempts=max_attempts,
            backoff=backoff,
            abandoned_blocks_key=abandoned_blocks_key,
            schema=schema,
            table=table,
            async_driver=async_driver,
            keyring=keyring,
            object_store=object_store,
            # How long close() lets the transactions in flight end, as `consume` lets its
            # handlers; and a claim-checked payload's fetch, as `consume` bounds it.
            shutdown_timeout=shutdown_timeout,
            object_store_timeout=object_store_timeout,
        )
        self.secret = secret
        self.tolerance = tolerance
        #: Refuse requests signed with v1 only (the body), whose topic, key, content type
        #: and user headers nobody vouches for; False accepts relays older than scheme v2.
        self.require_signed_headers = require_signed_headers
        self.max_body = max_body
        #: A body over max_body is read to its end and thrown away before the 413 (a
        #: connection closed with bytes unread is reset, and the sender loses the answer),
        #: within body_timeout and while bytes keep coming (a pause of _DRAIN_IDLE ends it),
        #: unless it is longer than this: then the 413 comes at once, the body unread.
        self.max_drain = max(_MAX_DRAIN, 4 * max_body)
        #: Seconds to read a request's whole body (408, connection closed, past it); None:
        #: no bound. Bodies are read before a session is taken, so a slow one holds no
        #: session, but a server's graceful shutdown waits for it.
        self.body_timeout = body_timeout
        #: The deadlines of the bodies being read: close() expires them (a 503 at once).
        self._reading: set[asyncio.Timeout] = set()
        self._sessions: asyncio.Queue[Session] | None = None
        self._all: list[Session] = []
        self._executor: ThreadPoolExecutor | None = None
        self._starting = asyncio.Lock()
        self._failures: OrderedDict[Any, int] = OrderedDict()
        #: Requests' transactions, shielded from their request's cancellation (see handle),
        #: with the session each one uses and its message id: held here, or the event loop's
        #: weak reference alone would keep them; close() waits for them.
        self._in_flight: dict[_Work, tuple[Session, Any]] = {}
        #: Set by close(): requests waiting for a session, and those arriving, get a 503.
        self._stopping = asyncio.Event()
        self._closed = False
        #: Executors of closed receivers whose transactions were left running (see close).
        self._retired: list[ThreadPoolExecutor] = []

    @property
    def stats(self) -> Any:
        return self.consumer.stats

    # ----- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Check the schema and open the connections (done by the first request otherwise;
        after close(), only this opens them again)."""
        await self._open(reopen=True)

    async def _open(self, *, reopen: bool) -> None:
        async with self._starting:
            if self._sessions is not None:
                return
            if self._closed and not reopen:
                # A request after close(): opening again here would leave connections that
                # no lifespan shutdown closes any more.
                raise _Closed
            store = create_store(
                self.consumer.db, schema=self.consumer.schema, table=self.consumer.table
            )
            try:
                await store.connect()
                await store.check_schema()
            finally:
                await store.close()
            self._executor = self.consumer._threads()
            sessions = [
                self.consumer._make_session(self._executor)
                for _ in range(self.consumer.concurrency)
            ]
            for session in sessions:
                await session.open()
            self._all = sessions
            self._sessions = asyncio.Queue()
            for session in sessions:
                self._sessions.put_nowait(session)
            self._stopping = asyncio.Event()
            self._closed = False

    async def close(self) -> None:
        """Stop taking requests (503 with Retry-After from now on), let the transactions in
        flight end (``shutdown_timeout``), then close the connections.

        A transaction still running then keeps its connection: closing it under a sync
        driver's thread, inside the transaction, is undefined (a crash, or a commit of half
        its work); it is logged, and its connection is closed when it ends."""
        async with self._starting:  # not while start() is opening connections
            sessions, self._all, self._sessions = self._all, [], None
            executor, self._executor = self._executor, None
            self._closed = True
            self._stopping.set()
        now = asyncio.get_running_loop().time()
        for deadline in self._reading:  # bodies still arriving: cut now, nothing applied
            deadline.reschedule(now)
        if self._in_flight:
            await asyncio.wait(list(self._in_flight), timeout=self.consumer.shutdown_timeout)
        running = {work: held for work, held in self._in_flight.items() if not work.done()}
        busy = {id(session) for session, _ in running.values()}
        for session in sessions:
            if id(session) not in busy:
                await session.close()
        if running:
            logger.warning(
                "webhook receiver closed with %d transaction(s) still running after "
                "shutdown_timeout (%gs), left to end on their own connections: %s",
                len(running),
                self.consumer.shutdown_timeout,
                ", ".join(str(message_id) for _, message_id in running.values()),
            )
            if executor is not None:
                self._retired.append(executor)  # their connections close on its threads
        elif executor is not None:
            executor.shutdown(wait=False)

    async def _close_late(self, session: Session) -> None:
        """Close the connection of a transaction that ended after close() left it running."""
        try:
            await session.close()
        except Exception as exc:  # noqa: BLE001 -- nothing uses it any more
            logger.debug("closing a connection after its late transaction: %s", exc)
        if len(self._in_flight) <= 1:  # this transaction's own entry, discarded when it ends
            retired, self._retired = self._retired, []
            for executor in retired:
                executor.shutdown(wait=False)

    # ----- ASGI ------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            raise RuntimeError(f"WebhookReceiver serves HTTP, not {scope['type']}")
        headers = {
            name.decode("latin-1").lower(): value.decode("latin-1")
            for name, value in scope.get("headers", [])
        }
        if scope["method"] != "POST":
            await _respond(send, 405, {"error": "webhooks are POSTed"}, {"allow": "POST"})
            return
        length = headers.get("content-length")
        announced = int(length) if length is not None and length.isdigit() else 0  # 0: none
        too_large = {"error": f"body over {self.max_body} bytes"}
        # A body over max_body is read and thrown away before the 413 (see max_drain): closed
        # with bytes of it unread, the connection was reset by the receiver's kernel, which
        # made the sender lose the 413; outboxer's relay saw a connection reset, retried,
        # and spent every attempt on a message this receiver never takes.
        over = announced > self.max_body
        if over and (
            announced > self.max_drain
            or self._stopping.is_set()
            # The client waits for a 100 Continue before it sends the body: none is sent.
            or headers.get("expect", "").strip().lower() == "100-continue"
        ):
            # Refused before a byte of it is read (the connection closes: its body is unread).
            await _respond(send, 413, too_large, _CLOSE)
            return
        if self._stopping.is_set():
            await _respond(send, *_closing_now())
            return
        body = bytearray()
        received = 0  # the body's bytes, those thrown away included
        # One timer for the whole body (none with body_timeout=None): a client trickling it,
        # or stalling after its headers, holds no session (taken after the body), but would
        # hold its connection, its memory and a server's graceful shutdown for ever.
        loop = asyncio.get_running_loop()
        when = None if self.body_timeout is None else loop.time() + self.body_timeout
        deadline = asyncio.timeout_at(when)
        complete = False
        self._reading.add(deadline)
        try:
            async with deadline:
                while True:
                    if over:
                        # Thrown away: a sender going silent is not waited for.
                        try:
                            async with asyncio.timeout(_DRAIN_IDLE) as idle:
                                event = await receive()
                        except TimeoutError:
                            if not idle.expired():
                                raise
                            break
                    else:
                        event = await receive()
                    if event.get("type") == "http.disconnect":
                        # The client went away mid-body: applied and recorded in the inbox, a
                        # part of the message would make the sender's full retry a duplicate,
                        # never applied.
                        return
                    chunk = event.get("body", b"")
                    received += len(chunk)
                    if not over:
                        body += chunk
                        if len(body) > self.max_body:
                            over = True
                            body = bytearray()  # never kept
                    if over and received > self.max_drain:
                        break  # closed unread, as a body announced that long is
                    if not event.get("more_body"):
                        complete = True
                        break
        except TimeoutError:
            if not deadline.expired():
                raise  # not this deadline's
        finally:
            self._reading.discard(deadline)
        if over:
            # Read to its end, or as far as body_timeout, close(), a silent sender or
            # max_drain let it be: the connection closes all the same.
            await _respond(send, 413, too_large, _CLOSE)
            return
        if not complete:
            if self._stopping.is_set():  # close() cut it: the relay sends it again
                await _respond(send, *_closing_now())
            else:
                error = f"body not received within body_timeout ({self.body_timeout:g}s)"
                await _respond(send, 408, {"error": error}, _CLOSE)
            return
        if length is not None and not (length.isdigit() and len(body) >= int(length)):
            # A server that hands over a short body as complete: the same partial message.
            error = f"body of {len(body)} bytes, not the {length[:20]!r} of its Content-Length"
            await _respond(send, 400, {"error": error})
            return
        status, answer, extra = await self.handle(headers, bytes(body))
        await _respond(send, status, answer, extra)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            event = await receive()
            if event["type"] == "lifespan.startup":
                try:
                    await self.start()
                except Exception as exc:  # noqa: BLE001 -- reported to the server, which stops
                    await send({"type": "lifespan.startup.failed", "message": describe(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif event["type"] == "lifespan.shutdown":
                await self.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # ----- one request -----------------------------------------------------------------------

    async def handle(
        self, headers: Mapping[str, str], body: bytes
    ) -> tuple[int, dict[str, Any], dict[str, str]]:
        """The answer to one POST (status, JSON body, extra headers); ``headers`` lowercased."""
        if self.secret is not None:
            try:
                verified = verify_request(
                    self.secret,
                    headers,
                    body,
                    self.tolerance,
                    require_signed_headers=self.require_signed_headers,
                )
            except WebhookSignatureError as exc:
                return 401, {"error": str(exc)}, {}
            if verified.signed_headers is not None:
                # Only what the signature covers is the message's: a header added on the
                # way (a proxy's, or an attacker's Outboxer-Key) reaches no handler.
                signed = verified.signed_headers
                headers = {name: value for name, value in headers.items() if name in signed}
        incoming = decode(_envelope(headers), body, content_type=headers.get("content-type"))
        if incoming.malformed is not None and HEADER_ID.lower() not in headers:
            return 400, {"error": f"not an outboxer webhook: {incoming.malformed}"}, {}
        try:
            await self._open(reopen=False)
        except _Closed:
            return _CLOSING
        except Exception as exc:  # noqa: BLE001 -- the database is down: the relay retries
            logger.warning("webhook receiver cannot start: %s", describe(exc))
            return 503, {"error": "the database does not answer"}, {"retry-after": "5"}
        assert self._sessions is not None
        sessions = self._sessions
        session = await _checkout(sessions, self._stopping)
        if session is None:
            return _CLOSING
        # Shielded: a request cancelled mid-transaction (the server cancels it when the client
        # hangs up or at shutdown, or a timeout around the app does) used to hand its session
        # back at once while the transaction went on (a sync driver's call runs in a thread,
        # which no cancellation stops). The next request to get it ran its handler on the
        # same connection, inside that open transaction: with psycopg it failed with a 503
        # although nothing was wrong with it; with a driver that does not notice, one commit
        # takes the other's half-done writes and inbox claim along, or one rollback undoes an
        # acknowledged message. The work now ends (commit or rollback) before its session
        # serves another request.
        work = asyncio.ensure_future(self._apply_on(sessions, session, incoming))
        self._in_flight[work] = (session, incoming.delivery.id)
        work.add_done_callback(self._discard)
        return await asyncio.shield(work)

    def _discard(self, work: _Work) -> None:
        self._in_flight.pop(work, None)

    async def _apply_on(
        self, sessions: asyncio.Queue[Session], session: Session, incoming: Any
    ) -> tuple[int, dict[str, Any], dict[str, str]]:
        """``_apply`` on ``session``, which goes back to ``sessions`` once it is done."""
        try:
            return _redacted(await self._apply(session, incoming))
        except HoldFailed as exc:  # the object store's trouble (counted): retried
            logger.warning("webhook %s not dead-lettered yet: %s", incoming.delivery.id, exc)
            error = redact_text(f"claim-check store error: {exc}")
            return 503, {"error": error}, {"retry-after": "1"}
        except Exception as exc:  # noqa: BLE001 -- recording a dead letter failed: retried
            self.consumer.stats.database_errors += 1
            logger.warning("webhook %s: database error: %s", incoming.delivery.id, describe(exc))
            if session.broken():
                await _reopen(session)
            error = redact_text(f"database error: {describe(exc)}")
            return 503, {"error": error}, {"retry-after": "1"}
        finally:
            if sessions is self._sessions:
                sessions.put_nowait(session)
            else:
                # The receiver closed meanwhile: nobody takes this session from that queue.
                await self._close_late(session)

    async def _apply(
        self, session: Session, incoming: Any
    ) -> tuple[int, dict[str, Any], dict[str, str]]:
        consumer, delivery = self.consumer, incoming.delivery
        stats = consumer.stats
        stats.received += 1
        if incoming.malformed is not None:
            await consumer.hold(delivery)  # its claim-check object outlives retention
            await session.record_dead_letter(consumer.group, delivery, incoming.malformed, 0)
            stats.malformed += 1
            stats.dead_lettered += 1
            return 200, {"result": "dead-lettered", "error": incoming.malformed}, {}
        failures = self._failures.get(delivery.id, 0)
        try:
            delivery = await consumer.unwrap(delivery)
        except Unreadable as exc:
            await consumer.hold(delivery)  # its claim-check object outlives retention
            await session.record_dead_letter(consumer.group, delivery, str(exc), 0)
            stats.malformed += 1
            stats.dead_lettered += 1
            return 200, {"result": "dead-lettered", "error": str(exc)}, {}
        except Exception as exc:  # noqa: BLE001 -- the object store or KMS may answer later
            # As `consume` treats it: a failed attempt of the message, retried after its
            # backoff, a dead letter after max_attempts; not a database error, which is
            # answered 503 for ever and never dead-lettered.
            return await self._unavailable(session, delivery, failures, exc)
        attempt = dataclasses.replace(delivery, attempt=failures + 1)
        try:
            [result] = await session.apply(
                consumer.group,
                [attempt],
                consumer._timed_handler,
                hold_keys=consumer.abandoned_blocks_key,
            )
        except BatchFailed as failure:
            if failure.index is None or session.lost(failure):
                stats.database_errors += 1
                if session.lost(failure):
                    await _reopen(session)
                return 503, {"error": f"database error: {failure}"}, {"retry-after": "1"}
            failures += 1
            stats.failed += 1
            error = describe(failure.cause)
            if failures >= consumer.max_attempts:
                await consumer.hold(delivery)  # its claim-check object outlives retention
                await session.record_dead_letter(consumer.group, delivery, error, failures)
                self._failures.pop(delivery.id, None)
                stats.dead_lettered += 1
                logger.error(
                    "webhook %s is a dead letter after %d attempts: %s",
                    delivery.id,
                    failures,
                    error,
                )
                return 200, {"result": "dead-lettered", "error": error}, {}
            self._remember(delivery.id, failures)
            delay = consumer.backoff.delay(failures)
            return (
                503,
                {"error": error, "attempt": failures},
                {"retry-after": str(max(1, round(delay)))},
            )
        self._failures.pop(delivery.id, None)
        stats.transactions += 1
        if result is Result.APPLIED:
            stats.applied += 1
        elif result is Result.DUPLICATE:
            stats.duplicates += 1
        else:
            stats.held += 1
            stats.dead_lettered += 1
            await consumer.hold_committed(delivery)
        return 200, {"result": result.value}, {}

    async def _unavailable(
        self, session: Session, delivery: Any, failures: int, exc: Exception
    ) -> tuple[int, dict[str, Any], dict[str, str]]:
        """The message's payload could not be fetched or decrypted for now (the claim-check
        store did not answer in time, or lacks the object; the KMS is down): one failed
        attempt, as ``consume`` counts it (see ``Consumer.fetch_failed``)."""
        from outboxer.claimcheck import ObjectNotFoundError, ObjectReadTimeoutError

        consumer = self.consumer
        failures += 1
        consumer.stats.failed += 1
        consumer.fetch_failed(exc)
        error = describe(exc)
        if isinstance(exc, ObjectReadTimeoutError):
            what = "the claim-check store did not answer in time"
        elif isinstance(exc, ObjectNotFoundError):
            what = "its claim-check object is missing"
        else:
            what = "its payload could not be read"
        if failures >= consumer.max_attempts:
            await consumer.hold(delivery)  # its claim-check object outlives retention
            await session.record_dead_letter(consumer.group, delivery, error, failures)
            self._failures.pop(delivery.id, None)
            consumer.stats.dead_lettered += 1
            logger.error(
                "webhook %s is a dead letter after %d attempts: %s: %s",
                delivery.id,
                failures,
                what,
                error,
            )
            return 200, {"result": "dead-lettered", "error": error}, {}
        self._remember(delivery.id, failures)
        delay = consumer.backoff.delay(failures)
        logger.warning(
            "webhook %s: %s (attempt %d of %d), retry after %.1fs: %s",
            delivery.id,
            what,
            failures,
            consumer.max_attempts,
            delay,
            error,
        )
        return (
            503,
            {"error": error, "attempt": failures},
            {"retry-after": str(max(1, round(delay)))},
        )

    def _remember(self, message_id: Any, failures: int) -> None:
        self._failures[message_id] = failures
        self._failures.move_to_end(message_id)
        while len(self._failures) > _REMEMBERED:
            self._failures.popitem(last=False)


_Work = asyncio.Future[tuple[int, dict[str, Any], dict[str, str]]]
#: The answer to a request the receiver does not take any more: the relay sends it again.
_CLOSING: tuple[int, dict[str, Any], dict[str, str]] = (
    503,
    {"error": "the webhook receiver is shutting down"},
    {"retry-after": "5"},
)


#: Closes the connection after the answer: its request's body was not read (whole).
_CLOSE: dict[str, str] = {"connection": "close"}


def _closing_now() -> tuple[int, dict[str, Any], dict[str, str]]:
    """``_CLOSING`` for a request whose body was not read: its connection closes too."""
    status, body, extra = _CLOSING
    return status, body, {**extra, **_CLOSE}


class _Closed(Exception):
    """A request reached a receiver that close() stopped."""


async def _checkout(sessions: asyncio.Queue[Session], stopping: asyncio.Event) -> Session | None:
    """A session from ``sessions``, or None once ``stopping`` is set (close() detached the
    queue: a request waiting on it would wait for ever, or get a closed connection)."""
    getter = asyncio.ensure_future(sessions.get())
    waiter = asyncio.ensure_future(stopping.wait())
    try:
        await asyncio.wait({getter, waiter}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        # Cancelled: a session got meanwhile goes back, or it would be lost to the others.
        if getter.done() and not getter.cancelled():
            sessions.put_nowait(getter.result())
        raise
    finally:
        got = getter.done() and not getter.cancelled()
        getter.cancel()  # a task: cancelled when it next runs, not now
        waiter.cancel()
    if not got:
        return None
    if stopping.is_set():
        sessions.put_nowait(getter.result())
        return None
    return getter.result()


def _redacted(
    answer: tuple[int, dict[str, Any], dict[str, str]],
) -> tuple[int, dict[str, Any], dict[str, str]]:
    """``answer`` with its error text redacted: a handler's or driver's error may carry a
    URL with its password, and the answer goes to whoever sent the request."""
    status, body, extra = answer
    if isinstance(body.get("error"), str):
        body = {**body, "error": redact_text(body["error"])}
    return status, body, extra


async def _reopen(session: Session) -> None:
    try:
        await session.close()
    except Exception as exc:  # noqa: BLE001 -- it is broken anyway
        logger.debug("closing a broken connection: %s", exc)
    try:
        await session.open()
    except Exception as exc:  # noqa: BLE001 -- the next request tries again
        logger.warning("reconnecting to the database failed: %s", exc)


def _envelope(headers: Mapping[str, str]) -> dict[str, str]:
    """The request's headers as the envelope and user headers every receiver decodes."""
    carried: dict[str, str] = {}
    for name, value in headers.items():
        if name.startswith(RESERVED_PREFIX.lower()):
            carried[decode_header_value(name[len(RESERVED_PREFIX) :])] = decode_header_value(value)
        elif name not in _TRANSPORT and name not in _ENVELOPE:
            carried[name] = decode_header_value(value)
    carried["outboxer-id"] = headers.get(HEADER_ID.lower(), "")
    for header, envelope in (
        (HEADER_TOPIC, ENVELOPE_TOPIC),
        (HEADER_KEY, ENVELOPE_KEY),
        (HEADER_CREATED_AT, ENVELOPE_CREATED_AT),
    ):
        if header.lower() in headers:
            carried[envelope] = decode_header_value(headers[header.lower()])
    return carried


async def _respond(
    send: Send, status: int, body: Mapping[str, Any], headers: Mapping[str, str] | None = None
) -> None:
    data = json.dumps(body).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    raw += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": data})


__all__ = ["WebhookReceiver"]
