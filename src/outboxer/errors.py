"""One exception hierarchy, so callers can catch ``OutboxerError`` or one branch of it."""

from __future__ import annotations

from collections.abc import Sequence


class OutboxerError(Exception):
    """Base class of every error outboxer raises on purpose."""


class ConfigError(OutboxerError, ValueError):
    """A setting, URL or configuration file is invalid."""


class MissingDependencyError(ConfigError, ImportError):
    """An optional driver is not installed; the message names the extra to install."""

    def __init__(self, package: str, extra: str) -> None:
        super().__init__(
            f"{package} is not installed; install it with: pip install 'outboxer[{extra}]'"
        )
        self.package = package
        self.extra = extra


class PayloadError(OutboxerError, ValueError):
    """A message's payload, headers, topic or key cannot be stored as given.

    Raised by the write path before any SQL runs, so nothing is half-written.
    """


class DuplicateMessageError(OutboxerError):
    """A message with this id already exists for this destination."""


class AdminRequestError(OutboxerError, ValueError):
    """An operator's purge, replay or requeue is refused as asked (a bad filter, no filter
    where one is needed, PROCESSING rows to purge): nothing was read or changed."""


class ReplayError(OutboxerError):
    """A PUBLISHED message cannot be copied for replay (its payload is encrypted or in the
    claim-check store, and the keys or the store are not configured, or its object is
    gone): the replay's transaction rolled back, nothing was written."""


class StoreError(OutboxerError):
    """The database rejected or could not run an outbox statement."""


class SlotInvalidatedError(OutboxerError):
    """A WAL outbox slot was invalidated (``pg_replication_slots.wal_status = 'lost'``): the
    server removed WAL it still needed, past ``max_slot_wal_keep_size``, and it can never be
    read again. Messages written since its last confirmed position may be lost for its
    destination.

    Not a StoreError (an outage the relay waits out): waiting cannot bring the WAL back, so
    the stream relay stops for good, and the slot must be dropped and created again.
    """

    def __init__(self, message: str, *, slot: str) -> None:
        super().__init__(message)
        self.slot = slot


class InsecureConnectionError(ConfigError, StoreError):
    """A database URL requires TLS (a MySQL ``ssl_mode`` but ``disabled``, ``preferred``) and
    the server did not offer it: TLS is off on the server, or something in between removed it.

    Fatal when the relay or a consumer starts, as SchemaError: trying again would not make
    the server offer TLS, and connecting anyway would send the data in clear.
    """


class SchemaError(ConfigError):
    """The outbox schema is missing or older than this version of outboxer needs.

    The relay refuses to start rather than fail on every claim: the fix is
    ``outboxer schema apply`` (or applying ``outboxer schema sql`` by hand).
    """


class PublishError(OutboxerError):
    """A broker did not confirm a message.

    ``retryable`` tells the relay whether to try again later (FAILED with
    backoff) or to give up at once (ABANDONED): a broker that rejects a message
    as too large will reject it again.
    """

    def __init__(
        self, message: str, *, retryable: bool = True, retry_after: float | None = None
    ) -> None:
        super().__init__(message)
        self.retryable = retryable
        #: Seconds the broker asked us to wait before trying again (HTTP Retry-After), if any.
        self.retry_after = retry_after


class BrokerUnavailableError(PublishError):
    """The broker cannot be reached; every message of the batch is retryable."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retryable=True)


class ConsumerShutdownError(OutboxerError):
    """The consumer stopped with handlers that had not returned (``shutdown_timeout`` passed,
    or a second SIGTERM/SIGINT): their messages were not acked, their transactions not
    committed, and the broker delivers them again.

    ``message_ids`` names them; ``hung`` says whether any still runs (a sync handler's thread,
    which cannot be interrupted, or an async one that ignored its cancellation): then only the
    process's exit ends it (``outboxer consume`` exits 1 without waiting for it).
    """

    def __init__(self, message: str, *, message_ids: Sequence[str], hung: bool) -> None:
        super().__init__(message)
        self.message_ids = list(message_ids)
        self.hung = hung
