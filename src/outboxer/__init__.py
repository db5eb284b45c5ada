"""outboxer: the transactional outbox and inbox for Python.

Write your rows and ``enqueue`` a message in one transaction; ``outboxer relay``
publishes it to your broker, at least once and in order per key.
"""

from typing import TYPE_CHECKING, Any

from outboxer.brokers import Publisher, create_publisher
from outboxer.brokers.base import Outcome, OutcomeKind
from outboxer.claimcheck import (
    ClaimCheck,
    ClaimCheckError,
    ClaimCheckStoreError,
    FileObjectStore,
    ObjectNotFoundError,
    ObjectStore,
    S3ObjectStore,
    create_object_store,
    fetch_payload,
    fetch_payload_async,
)
from outboxer.config import DestinationSettings, Settings, load_settings
from outboxer.crypto import (
    DecryptionError,
    EncryptionError,
    EnqueueKeyUnavailableError,
    FileSubjectKeys,
    KeyNotFoundError,
    KeyRing,
    MemorySubjectKeys,
    SubjectKeyDeletedError,
    decrypt,
    encrypt_message,
)
from outboxer.enqueue import (
    Outbox,
    configure,
    enqueue,
    enqueue_async,
    enqueue_many,
    enqueue_many_async,
)
from outboxer.errors import (
    BrokerUnavailableError,
    ConfigError,
    DuplicateMessageError,
    MissingDependencyError,
    OutboxerError,
    PayloadError,
    PublishError,
    SchemaError,
    StoreError,
)
from outboxer.inbox import Inbox
from outboxer.message import Message, Status, uuid7
from outboxer.relay import Relay, RelayStats
from outboxer.retry import Backoff
from outboxer.stores import Store, create_store

if TYPE_CHECKING:
    from outboxer.consumer import Consumer, ConsumerStats, Delivery

#: Loaded on first use, so that the relay and the CLI do not import the consumer runner.
_LAZY = {"Consumer", "ConsumerStats", "Delivery"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from outboxer import consumer

        return getattr(consumer, name)
    raise AttributeError(f"module 'outboxer' has no attribute {name!r}")


__version__ = "0.1.0.dev0"

__all__ = [
    "Backoff",
    "BrokerUnavailableError",
    "ClaimCheck",
    "ClaimCheckError",
    "ClaimCheckStoreError",
    "ConfigError",
    "Consumer",
    "ConsumerStats",
    "DecryptionError",
    "Delivery",
    "DestinationSettings",
    "DuplicateMessageError",
    "EncryptionError",
    "EnqueueKeyUnavailableError",
    "FileObjectStore",
    "FileSubjectKeys",
    "Inbox",
    "KeyNotFoundError",
    "KeyRing",
    "MemorySubjectKeys",
    "Message",
    "MissingDependencyError",
    "ObjectNotFoundError",
    "ObjectStore",
    "Outbox",
    "OutboxerError",
    "Outcome",
    "OutcomeKind",
    "PayloadError",
    "PublishError",
    "Publisher",
    "Relay",
    "RelayStats",
    "S3ObjectStore",
    "SchemaError",
    "Settings",
    "Status",
    "Store",
    "StoreError",
    "SubjectKeyDeletedError",
    "configure",
    "create_object_store",
    "create_publisher",
    "create_store",
    "decrypt",
    "encrypt_message",
    "enqueue",
    "enqueue_async",
    "enqueue_many",
    "enqueue_many_async",
    "fetch_payload",
    "fetch_payload_async",
    "load_settings",
    "uuid7",
]
