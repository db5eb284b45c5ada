"""Envelopes: what of a message travels to a destination.

``full`` (internal destinations): every field the outbox holds for the message.
``stripped`` (external destinations, partners): the message id (for their
deduplication), topic, key, content type, creation time, payload and the user's
headers, minus any header whose name starts with ``internal-`` or ``x-internal-``,
which stay inside the organisation.
"""

from __future__ import annotations

import dataclasses

from outboxer.message import Message

INTERNAL_HEADER_PREFIXES = ("internal-", "x-internal-")


def strip_envelope(message: Message) -> Message:
    headers = {
        name: value
        for name, value in message.headers.items()
        if not name.lower().startswith(INTERNAL_HEADER_PREFIXES)
    }
    return dataclasses.replace(message, headers=headers)
