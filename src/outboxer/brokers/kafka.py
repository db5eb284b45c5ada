"""``kafka://host:9092[,host2:9092]?option=value``: Apache Kafka through confluent-kafka (librdkafka).

A message counts as published once its delivery report says the partition
leader appended it with ``acks=all`` (every in-sync replica has it). The
producer is idempotent, so librdkafka's own retries neither duplicate nor
reorder messages within a partition while many are in flight.

librdkafka is a threaded C library: ``produce()`` only enqueues, and delivery
reports are served by ``poll()``. A background thread polls and hands every
report to the event loop with ``call_soon_threadsafe``; the event loop never
blocks on the client.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any
from urllib.parse import unquote

from confluent_kafka import KafkaError, KafkaException, Producer

from outboxer.brokers.base import NotSent, Publisher, check_url_repeats, parse_options
from outboxer.config import duration_option
from outboxer.errors import ConfigError, PublishError
from outboxer.message import Message
from outboxer.redact import get_logger, redact_url

logger = get_logger("outboxer.kafka")

#: The consumer's own URL options (outboxer.receivers.kafka), not librdkafka's: one URL
#: serves the relay and the consumers.
CONSUMER_OPTIONS = ("offset_reset", "suspect_window")
#: Settings the delivery guarantee depends on; a different value is a ConfigError.
ENFORCED = {"acks": ("all", "-1"), "enable.idempotence": ("true",)}

#: Error codes a later attempt cannot fix: the broker refuses this message for good.
PERMANENT_ERRORS = frozenset(
    getattr(KafkaError, name)
    for name in (
        "MSG_SIZE_TOO_LARGE",
        "INVALID_MSG",
        "INVALID_MSG_SIZE",
        "INVALID_RECORD",
        "INVALID_TIMESTAMP",
        "INVALID_REQUIRED_ACKS",
        "RECORD_LIST_TOO_LARGE",
        "TOPIC_AUTHORIZATION_FAILED",
        "CLUSTER_AUTHORIZATION_FAILED",
        "TOPIC_EXCEPTION",
        "POLICY_VIOLATION",
        "UNSUPPORTED_FOR_MESSAGE_FORMAT",
        "_INVALID_ARG",
        "_BAD_MSG",
    )
    if hasattr(KafkaError, name)
)

#: Permanent error codes a broker answers for a whole record batch when one record of it is
#: at fault (above the topic's max.message.bytes, keyless on a compacted topic…): librdkafka
#: reports the error for every message the batch held, so only a message refused when sent
#: alone is refused for good.
BATCH_REFUSALS = frozenset(
    getattr(KafkaError, name)
    for name in (
        "MSG_SIZE_TOO_LARGE",
        "INVALID_MSG",
        "INVALID_MSG_SIZE",
        "INVALID_RECORD",
        "INVALID_TIMESTAMP",
        "RECORD_LIST_TOO_LARGE",
    )
    if hasattr(KafkaError, name)
)

#: Error codes that mean no broker could be reached (the relay reconnects first).
CONNECTION_ERRORS = frozenset(
    getattr(KafkaError, name)
    for name in (
        "_TRANSPORT",
        "_ALL_BROKERS_DOWN",
        "_MSG_TIMED_OUT",
        "_TIMED_OUT",
        "_TIMED_OUT_QUEUE",
        "_RESOLVE",
        "_SSL",
        "_AUTHENTICATION",
        "NETWORK_EXCEPTION",
        "_DESTROY",
        "_FATAL",
        "_PURGE_QUEUE",
        "_PURGE_INFLIGHT",
    )
    if hasattr(KafkaError, name)
)


#: librdkafka logs of the offline configuration check go nowhere.
_quiet = get_logger("outboxer.kafka.config-check")
_quiet.propagate = False
_quiet.addHandler(logging.NullHandler())


class KafkaPublishError(PublishError):
    """A message Kafka did not confirm, with librdkafka's error code and name."""

    def __init__(self, error: KafkaError) -> None:
        code = error.code()
        self.error = error
        self.code = code
        self.name = error.name()
        # produce() on a producer that hit a fatal error raises _FATAL, not flagged fatal.
        self.fatal = error.fatal() or code == KafkaError._FATAL
        #: No broker reachable, or the producer is unusable: reconnect before going on.
        self.connection = self.fatal or code in CONNECTION_ERRORS
        retryable = self.fatal or code not in PERMANENT_ERRORS
        super().__init__(f"{self.name}: {error.str()}", retryable=retryable)


#: Kafka's rule for topic names (as the receiver checks its own).
_TOPIC_NAME = re.compile(r"[A-Za-z0-9._-]{1,249}")


def kafka_error(exc: BaseException) -> BaseException:
    """Turn what ``produce()`` raised into a PublishError (a bad argument is permanent)."""
    if isinstance(exc, KafkaException) and exc.args and isinstance(exc.args[0], KafkaError):
        return KafkaPublishError(exc.args[0])
    if isinstance(exc, TypeError | ValueError):
        return PublishError(f"kafka cannot carry this message: {exc}", retryable=False)
    return exc


class KafkaPublisher(Publisher):
    """Publishes each message to the Kafka topic ``destination_for(message)``.

    Options (URL query string or keyword arguments; keywords win):

    - ``connect_timeout`` (seconds, default 10): how long ``connect()`` waits
      for the cluster's metadata before it reports the broker unreachable.
    - any librdkafka producer property, e.g. ``?linger.ms=20&compression.type=lz4``,
      or as a ``config`` dict. ``message.timeout.ms`` defaults to
      ``publish_timeout``; ``acks=all`` and ``enable.idempotence=true`` are fixed.
    """

    schemes = ("kafka",)

    def __init__(
        self,
        url: str,
        *,
        routes: Mapping[str, str] | None = None,
        publish_timeout: float = 30.0,
        connect_timeout: float | None = None,
        config: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(url, routes=routes, publish_timeout=publish_timeout)
        # librdkafka would get the last value only (acks=1&acks=all passed the check).
        check_url_repeats(url, "kafka:// broker")
        parts, options = parse_options(url)
        userinfo, _, hosts = parts.netloc.rpartition("@")
        if not hosts:
            raise ConfigError(
                f"kafka URL needs bootstrap servers: {redact_url(url)!r} (kafka://host:9092)"
            )
        # connect_timeout is outboxer's, and the consumer's own options are not the
        # producer's (one URL serves both); every other query parameter goes to librdkafka.
        url_timeout = options.pop("connect_timeout", "10")
        for name in CONSUMER_OPTIONS:
            options.pop(name, None)
        self.connect_timeout = duration_option(
            connect_timeout if connect_timeout is not None else url_timeout,
            "kafka option connect_timeout",
            0.001,
            3600,
        )

        settings: dict[str, Any] = {"bootstrap.servers": hosts}
        if userinfo:
            username, _, password = userinfo.partition(":")
            settings["sasl.username"] = unquote(username)
            settings["sasl.password"] = unquote(password)
        settings["message.timeout.ms"] = max(1, int(publish_timeout * 1000))
        settings.update(options)
        settings.update(config or {})
        for name, allowed in ENFORCED.items():
            value = str(settings.get(name, allowed[0])).lower()
            if value not in allowed:
                raise ConfigError(
                    f"kafka option {name}={settings[name]!r} is not allowed: outboxer needs "
                    f"{name}={allowed[0]} to count a message as published only once every "
                    "in-sync replica has it, in order"
                )
            settings[name] = allowed[0]
        if str(settings.get("transactional.id") or ""):
            # A transactional producer refuses every produce() outside a transaction
            # (_STATE): each message would fail, retryably, until its attempts ran out.
            raise ConfigError(
                "kafka option transactional.id is not supported: the relay publishes with "
                "the idempotent producer, outside Kafka transactions"
            )
        settings["logger"] = logger
        _check_config(settings)
        #: The librdkafka configuration, as passed to ``confluent_kafka.Producer``.
        self.config = settings
        self._producer: Producer | None = None
        self._poller: threading.Thread | None = None
        self._stop = threading.Event()
        self._fatal: KafkaError | None = None
        #: librdkafka reported every broker connection down (it goes on reconnecting); the
        #: next connect asks the cluster afresh (see ``_transport_lost``).
        self._brokers_down = False

    # ----- connection ------------------------------------------------------------------------

    async def _connect(self) -> None:
        # Before the check: brokers going down again during or after it are still seen.
        self._brokers_down = False
        if self._producer is not None and self._fatal is None:
            # librdkafka reconnects by itself: keep the producer (and what it still
            # holds in flight), only check that the cluster answers again.
            await self._check_cluster(self._producer)
            return
        await self._close()
        self._fatal = None
        producer = Producer({**self.config, "error_cb": self._on_error})
        self._producer = producer
        self._stop = threading.Event()
        self._poller = threading.Thread(
            target=_poll_until,
            args=(producer, self._stop, self._on_error),
            name="outboxer-kafka-poll",
            daemon=True,
        )
        self._poller.start()
        await self._check_cluster(producer)

    async def _check_cluster(self, producer: Producer) -> None:
        """A fresh metadata request (cached answers do not count): is a broker up?"""
        try:
            await asyncio.to_thread(producer.list_topics, None, self.connect_timeout)
        except KafkaException as exc:
            raise ConnectionError(
                f"no Kafka broker answered within {self.connect_timeout}s: {exc}"
            ) from exc

    async def _close(self) -> None:
        producer, poller = self._producer, self._poller
        self._producer = self._poller = None
        if producer is None:
            return
        self._stop.set()
        await asyncio.to_thread(_shutdown, producer, poller)

    def _on_error(self, error: KafkaError) -> None:
        """librdkafka's error callback (poll thread): client-level errors, e.g. all brokers down."""
        if error.fatal():
            self._fatal = error
            logger.error("kafka producer hit a fatal error, it will be rebuilt: %s", error)
        else:
            if error.code() == KafkaError._ALL_BROKERS_DOWN:
                # Seen while idle too: the relay checks the cluster (connect) before its next
                # claim rather than claim rows that would wait message.timeout.ms and fail.
                self._brokers_down = True
            logger.info("kafka: %s", error)

    def _transport_lost(self) -> bool:
        return self._fatal is not None or self._brokers_down

    # ----- publishing ------------------------------------------------------------------------

    async def _publish_wave(self, messages: Sequence[Message]) -> list[BaseException | None]:
        producer = self._producer
        if producer is None:
            raise ConnectionError("kafka publisher is not connected")
        if self._fatal is not None:  # nothing reaches the broker: no attempt is counted
            return [NotSent(KafkaPublishError(self._fatal))] * len(messages)
        loop = asyncio.get_running_loop()
        # The wave ends before the relay's own publish_timeout does: that one fails the whole
        # wave, messages the broker confirmed included (published again on retry, for as
        # long as one batch-mate's partition stays unreachable). Each message gets its own
        # outcome instead; librdkafka's own timeout (message.timeout.ms = publish_timeout)
        # is checked about once a second, so its report would always come too late.
        deadline = loop.time() + self.publish_timeout - min(1.0, self.publish_timeout / 10)
        refused: set[int] = set()
        results = await self._send(producer, messages, deadline, refused)
        for result in results:
            if isinstance(result, KafkaPublishError) and result.fatal and self._fatal is None:
                self._fatal = result.error
        for index, result in enumerate(results):
            # The report may be the verdict on a batch this message only shared: sent again
            # alone, its own report decides. No duplicate: a refused batch is not appended.
            # One at a time, after the whole wave: the wave's messages are independent.
            if (
                index not in refused
                and isinstance(result, KafkaPublishError)
                and result.code in BATCH_REFUSALS
            ):
                [results[index]] = await self._send(producer, [messages[index]], deadline, set())
        return results

    async def _send(
        self, producer: Producer, messages: Sequence[Message], deadline: float, refused: set[int]
    ) -> list[BaseException | None]:
        """Produce independent messages and wait for their reports until ``deadline``; the
        indexes of those ``produce()`` refused (never in flight) are added to ``refused``.

        A message still unanswered when the wait ends (the deadline, or a cancellation: a
        lost lease, a forced stop) is dropped from librdkafka's queue before the wave ends:
        left there, librdkafka kept sending it until message.timeout.ms, after the relay had
        handed its row on (retried after backoff, or given back to the next lease holder),
        so a stale copy could land after the retry and after the key's next message. A
        message another wave's purge took from the queue is produced again (it was not
        this wave's to drop)."""
        loop = asyncio.get_running_loop()
        results: list[BaseException | None] = [None] * len(messages)
        todo = list(range(len(messages)))
        while todo:
            if loop.time() >= deadline:  # no time left to hear back: not sent, retried later
                for index in todo:
                    results[index] = self._timed_out()
                break
            futures: dict[int, asyncio.Future[None]] = {}
            try:
                for index in todo:
                    future: asyncio.Future[None] = loop.create_future()
                    try:
                        await self._produce(
                            producer, messages[index], functools.partial(_deliver, loop, future)
                        )
                    except (KafkaException, TypeError, ValueError) as exc:  # not in flight
                        results[index] = self._refused(exc)
                        refused.add(index)
                        continue
                    futures[index] = future
                await self._reports(futures.values(), deadline)
            finally:
                if not all(future.done() for future in futures.values()):
                    self._purge_queued(producer)
                for future in futures.values():
                    future.cancel()  # a late report is dropped (_resolve)
            todo = []
            for index, future in futures.items():
                if future.cancelled():
                    results[index] = self._timed_out()
                elif (error := future.exception()) is not None and self._purged_by_another(
                    producer, error
                ):
                    todo.append(index)
                else:
                    results[index] = error
        return results

    async def _reports(self, futures: Collection[asyncio.Future[None]], deadline: float) -> None:
        """Wait for the delivery reports until ``deadline``."""
        pending = [future for future in futures if not future.done()]
        if pending:
            await asyncio.wait(
                pending, timeout=max(0.0, deadline - asyncio.get_running_loop().time())
            )

    def _purge_queued(self, producer: Producer) -> None:
        """Drop what librdkafka has not sent yet, of every wave (there is no per-message
        purge): the others' purged messages are produced again (``_purged_by_another``).
        What is in flight stays: its report, whoever listens, is the broker's answer."""
        if self._producer is not producer:  # closed (a forced stop purged it) or replaced
            return
        try:
            # Not blocking: the partition queues are emptied in this call; a broker thread
            # empties its transmit queue on its next turn (a batch it sends first is in flight).
            producer.purge(in_queue=True, in_flight=False, blocking=False)
        except Exception:  # a broken producer holds nothing that can be sent
            logger.debug("kafka producer purge failed", exc_info=True)

    def _purged_by_another(self, producer: Producer, error: BaseException) -> bool:
        """Whether another wave's purge took this message (see ``_send``): the producer is
        still this publisher's, and usable; ``_close``'s purge replaces it first."""
        return (
            isinstance(error, KafkaPublishError)
            and error.code == KafkaError._PURGE_QUEUE
            and self._producer is producer
            and self._fatal is None
        )

    def _timed_out(self) -> TimeoutError:
        """Retryable, and a connection error: the relay checks the cluster before going on."""
        return TimeoutError(f"kafka did not confirm within {self.publish_timeout}s")

    def _refused(self, exc: BaseException) -> BaseException:
        """The error of a message ``produce()`` refused (it is not in flight)."""
        error = kafka_error(exc)
        if isinstance(error, KafkaPublishError) and error.fatal:
            # The producer is unusable: the message never left, and only a new producer
            # (the next connect) can send it.
            if self._fatal is None:
                self._fatal = error.error
            return NotSent(error)
        return error

    async def _produce(
        self,
        producer: Producer,
        message: Message,
        on_delivery: Callable[[KafkaError | None, Any], None],
    ) -> None:
        topic = self.destination_for(message)
        if _TOPIC_NAME.fullmatch(topic) is None:
            # Refused here, for good (ValueError: see kafka_error): librdkafka asks the
            # cluster first, whose answer (TOPIC_EXCEPTION, permanent) could come as a local
            # "Unknown topic" (retryable) when its metadata cache answered before the broker.
            raise ValueError(
                f"{topic!r:.300} is not a Kafka topic name: 1 to 249 of a-z A-Z 0-9 . _ -"
            )
        headers: list[tuple[str, str | bytes | None]] = [
            (name, value.encode("utf-8")) for name, value in message.envelope_headers().items()
        ]
        key = message.key.encode("utf-8") if message.key is not None else None
        while True:
            try:
                producer.produce(
                    topic,
                    message.payload,
                    key,
                    headers=headers,
                    on_delivery=on_delivery,
                )
                return
            except BufferError:  # the local queue is full: let the poll thread drain it
                await asyncio.sleep(0.01)

    def is_connection_error(self, exc: BaseException) -> bool:
        if self._fatal is not None:  # whatever failed: the relay must reconnect (a new producer)
            return True
        if isinstance(exc, KafkaPublishError):
            return exc.connection
        return super().is_connection_error(exc)


def _deliver(
    loop: asyncio.AbstractEventLoop,
    future: asyncio.Future[None],
    error: KafkaError | None,
    _message: Any,
) -> None:
    """Delivery report (poll thread): resolve the message's future on the event loop."""
    with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
        loop.call_soon_threadsafe(_resolve, future, error)


def _resolve(future: asyncio.Future[None], error: KafkaError | None) -> None:
    if future.done():  # the wave timed out and was cancelled
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(KafkaPublishError(error))


def _poll_until(
    producer: Producer, stop: threading.Event, on_fatal: Callable[[KafkaError], None]
) -> None:
    while not stop.is_set():
        try:
            producer.poll(0.1)
        except KafkaException as exc:
            # confluent-kafka 2.x raises a fatal error out of poll(), and error_cb never gets
            # it: unrecorded, the relay would reconnect to this dead producer for ever.
            error = exc.args[0] if exc.args else None
            if isinstance(error, KafkaError) and error.fatal():
                on_fatal(error)
            else:
                logger.exception("kafka poll failed")
        except Exception:  # a callback raised; keep serving the others
            logger.exception("kafka poll failed")


def _shutdown(producer: Producer, poller: threading.Thread | None) -> None:
    """Stop polling and drop what is still queued (the relay retries it), then destroy."""
    if poller is not None:
        poller.join()
    try:
        producer.purge(in_queue=True, in_flight=True, blocking=False)
        producer.flush(1.0)  # serves the purged messages' delivery reports
        close = getattr(producer, "close", None)  # confluent-kafka >= 2.x; else garbage collected
        if close is not None:
            close()
    except Exception:  # closing a broken producer must not raise
        logger.debug("kafka producer did not close cleanly", exc_info=True)


def _check_config(settings: Mapping[str, Any]) -> None:
    """Let librdkafka validate the configuration now, without connecting anywhere."""
    offline = {
        k: v
        for k, v in settings.items()
        if k != "bootstrap.servers" and not k.startswith("test.mock.")
    }
    offline["logger"] = _quiet
    try:
        producer = Producer(offline)
    except KafkaException as exc:
        raise ConfigError(f"invalid kafka configuration: {kafka_error(exc)}") from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"invalid kafka configuration: {exc}") from None
    close = getattr(producer, "close", None)
    if close is not None:
        close()


__all__ = ["KafkaPublishError", "KafkaPublisher", "kafka_error"]
