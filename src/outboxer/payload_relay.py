"""What the relay does with protected payloads, per destination, before publishing.

``decrypt`` (the default): an encrypted row is published in plaintext: payload, content type
and sealed headers restored, the encryption headers gone. ``forward``: the ciphertext is
published as stored, with its encryption headers and ``outboxer-destination`` (the
destination it is bound to, which a consumer needs for ``outboxer.decrypt``).

Claim-checked rows are published as references in both modes (the message carries the
reference, the object stays where it is; consumers use ``outboxer.fetch_payload``, then
``outboxer.decrypt`` when the outbox encrypts): the relay never moves large payloads, and
never writes a plaintext object. Claim-check a destination only when its consumers reach
the object store (and, if encrypted, hold the keys).

A message that cannot be decrypted fails alone, never the relay: a missing or wrong key, a
shredded subject or an altered ciphertext is a permanent failure (the row is ABANDONED at
once, readable again only once the key is back and the row requeued); a key source (KMS)
that does not answer is a retryable one: a key fetch still unanswered after
``key_fetch_timeout`` fails its message (the consumer's bound, ``object_store_timeout``),
and is left to finish in a daemon thread of its own, which never holds up the process's
exit. The later messages of its key in the batch are skipped, so a retry is never
overtaken by its successor.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from outboxer.brokers.base import SKIPPED, Outcome, OutcomeKind, Publisher
from outboxer.claimcheck import is_claim_checked
from outboxer.crypto import (
    HEADER_DESTINATION,
    HEADER_KEY_ID,
    MAX_ABANDONED_FETCHES,
    DecryptionError,
    KeyRing,
    KeyRingUnavailableError,
    decrypt,
    fetch_key_bounded,
    is_encrypted,
)
from outboxer.envelope import strip_envelope
from outboxer.errors import ConfigError
from outboxer.message import Message
from outboxer.redact import get_logger

logger = get_logger("outboxer.payload")

PayloadMode = Literal["decrypt", "forward"]

#: Seconds the relay waits for a key from a callable key ring (a KMS) before the message
#: fails, retryably: the consumer's bound for the same fetch (``object_store_timeout``,
#: from ``claim_check_read_timeout``), with its default. Rings built from the settings
#: hold their keys and never fetch.
KEY_FETCH_TIMEOUT = 30.0


async def _fetch_key(keyring: KeyRing, key_id: str, timeout: float) -> None:
    """Load ``key_id`` into ``keyring`` in a daemon thread, waiting at most ``timeout``
    seconds (``crypto.fetch_key_bounded``, shared with the consumer: at most
    MAX_ABANDONED_FETCHES given-up calls per ring, late outcomes logged here)."""
    await fetch_key_bounded(keyring, key_id, timeout, waiter="the relay", log=logger)


@dataclass(frozen=True)
class PayloadHandling:
    """One destination's handling: its mode and the key ring (None: this relay has none)."""

    destination: str
    mode: PayloadMode = "decrypt"
    keyring: KeyRing | None = None
    #: ``stripped``: internal headers are dropped after decryption, so a sealed internal
    #: header never leaves with the plaintext (outboxer.envelope).
    envelope: str = "full"
    #: Seconds a key fetch from a callable key ring (a KMS) may take: past it, the message
    #: fails retryably (KeyRingUnavailableError) and the relay goes on.
    key_fetch_timeout: float = KEY_FETCH_TIMEOUT

    def __post_init__(self) -> None:
        if not self.key_fetch_timeout > 0:  # NaN too
            raise ConfigError(f"key_fetch_timeout must be positive; got {self.key_fetch_timeout}")

    async def prepare(self, message: Message) -> Message:
        """``message`` as it is published; raises DecryptionError (permanent) or
        KeyRingUnavailableError (retryable)."""
        return await self._prepare(message, {})

    async def _prepare(
        self, message: Message, unavailable: dict[str, KeyRingUnavailableError]
    ) -> Message:
        """``prepare``; ``unavailable`` holds the key ids whose fetch failed in this batch:
        their later messages fail with the same error at once, where each waited out
        ``key_fetch_timeout`` again (a batch of 500 behind a silent KMS: four hours)."""
        if not is_encrypted(message):
            return message
        if self.mode == "forward" or is_claim_checked(message):
            headers = {**message.headers, HEADER_DESTINATION: message.destination}
            return dataclasses.replace(message, headers=headers)
        if self.keyring is None:
            raise DecryptionError(
                f"message {message.id} is encrypted and this relay has no encryption keys: "
                f"set OUTBOXER_ENCRYPTION_KEYS (or encryption_key_file), or payload = "
                f"'forward' for destination {self.destination!r}"
            )
        key_id = message.headers.get(HEADER_KEY_ID)
        if key_id and not self.keyring.has_key(key_id):
            # A header read from the row: a JSON list there is no dict key (the ring
            # refuses it, for good).
            remembered = isinstance(key_id, str)
            if remembered and key_id in unavailable:
                raise unavailable[key_id]
            # A callable ring fetches from a KMS: off the event loop, once per key, bounded.
            try:
                await _fetch_key(self.keyring, key_id, self.key_fetch_timeout)
            except KeyRingUnavailableError as exc:
                if remembered:
                    unavailable[key_id] = exc
                raise
        # The row's destination, never an ``outboxer-destination`` header from the row: that
        # header would let another destination's ciphertext, copied into this row, decrypt
        # here and go out in plaintext to a party it was not encrypted for.
        return decrypt(message, self.keyring, destination=message.destination)

    async def publish(
        self,
        publisher: Publisher,
        batch: Sequence[Message],
        known: list[Outcome | None] | None = None,
    ) -> list[Outcome]:
        """Prepare each message, publish those prepared; one Outcome per message, in order.

        ``known`` (one None per message) gets each outcome as it is known: a failure to
        prepare at once, a publish once its wave has ended (Publisher.publish_batch). A
        caller cancelled mid-batch records those and gives back the rest."""
        if known is not None and len(known) != len(batch):
            raise ValueError(f"known holds {len(known)} entries for {len(batch)} messages")
        outcomes: list[Outcome | None] = known if known is not None else [None] * len(batch)
        ready: list[tuple[int, Message]] = []
        failed_keys: set[str] = set()
        unavailable: dict[str, KeyRingUnavailableError] = {}
        for index, message in enumerate(batch):
            if message.key is not None and message.key in failed_keys:
                outcomes[index] = SKIPPED
                continue
            try:
                prepared = await self._prepare(message, unavailable)
                ready.append(
                    (index, strip_envelope(prepared) if self.envelope == "stripped" else prepared)
                )
                continue
            except KeyRingUnavailableError as exc:
                outcomes[index] = Outcome(OutcomeKind.FAILED, str(exc), retryable=True)
            except DecryptionError as exc:
                outcomes[index] = Outcome(OutcomeKind.FAILED, str(exc), retryable=False)
            except Exception as exc:  # noqa: BLE001 -- a subject store's disk error: retry
                outcomes[index] = Outcome(
                    OutcomeKind.FAILED, f"{type(exc).__name__}: {exc}", retryable=True
                )
            if message.key is not None:
                failed_keys.add(message.key)
        if ready:
            answered: list[Outcome | None] = [None] * len(ready)
            try:
                published = await publisher.publish_batch(
                    [message for _, message in ready], answered
                )
            except asyncio.CancelledError:
                # Cut short: the waves that ended before are known, in the batch's places.
                for (index, _), outcome in zip(ready, answered, strict=True):
                    outcomes[index] = outcome
                raise
            for (index, _), outcome in zip(ready, published, strict=True):
                outcomes[index] = outcome
        return [outcome if outcome is not None else SKIPPED for outcome in outcomes]


__all__ = ["KEY_FETCH_TIMEOUT", "MAX_ABANDONED_FETCHES", "PayloadHandling", "PayloadMode"]
