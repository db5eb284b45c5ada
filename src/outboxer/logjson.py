"""JSON log lines (``--log-format json``): one object per line, for log shippers.

Each line holds ``time`` (UTC, ISO 8601 with milliseconds), ``level``, ``logger`` and
``message``, then whichever of ``message_id``, ``database``, ``destination``, ``topic``,
``attempt``, ``error_class`` and ``relay_id`` the call passed (``database``: the relay of one
of several databases adds it to each of its lines, outboxer.relay.DatabaseLog) (``logger.warning(..., extra=fields(...))``),
and ``exception`` with the traceback when there is one.

Redaction stays what ``outboxer.redact`` makes it: the message, every text field and the
traceback go through ``redact_text`` here too, so a record that reached this formatter
without passing a redacting filter (a driver's logger, a field given in ``extra``) shows no
secret either.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from datetime import UTC, datetime
from typing import Any

from outboxer.redact import redact_text

#: The structured fields a record may carry (``extra=``), in the order lines show them.
FIELDS = ("message_id", "database", "destination", "topic", "attempt", "error_class", "relay_id")

#: What json.dumps(ensure_ascii=False) leaves raw but a line must not hold: C1 controls
#: (U+009B is a terminal's CSI), line and paragraph separators, bidirectional marks and
#: overrides, and lone surrogates (from surrogateescape or a JSON "\udc80"), which a UTF-8
#: stream cannot encode: logging would drop the line. Written as \uXXXX, each reads back.
_RAW_UNSAFE = re.compile(
    "[\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff]"
)

#: ``describe()`` writes errors as ``Type: text``; this finds the type again.
_ERROR_CLASS = re.compile(r"^([A-Za-z_][\w.]{0,99}): ")


def error_class(error: str | None) -> str | None:
    """The exception class name an error text starts with (``"TimeoutError: …"``), if any."""
    if not error:
        return None
    match = _ERROR_CLASS.match(error)
    return match.group(1) if match else None


def fields(
    *,
    message_id: uuid.UUID | str | None = None,
    destination: str | None = None,
    topic: str | None = None,
    attempt: int | None = None,
    error: str | None = None,
    error_class_name: str | None = None,
    relay_id: str | None = None,
) -> dict[str, Any]:
    """The ``extra`` mapping of a log call: only the fields given (None is left out).

    ``error`` is an error text as recorded in ``last_error``; its class becomes
    ``error_class`` unless ``error_class_name`` names it.
    """
    given = {
        "message_id": str(message_id) if message_id is not None else None,
        "destination": destination,
        "topic": topic,
        "attempt": attempt,
        "error_class": error_class_name or error_class(error),
        "relay_id": relay_id,
    }
    return {name: value for name, value in given.items() if value is not None}


class JsonFormatter(logging.Formatter):
    """Formats a record as one line of JSON (see the module docstring for its fields)."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": redact_text(record.getMessage()),
        }
        for name in FIELDS:
            value = record.__dict__.get(name)
            if value is None:
                continue
            entry[name] = (
                value if isinstance(value, int | float | bool) else redact_text(str(value))
            )
        if record.exc_info and record.exc_info[1] is not None:
            entry.setdefault("error_class", type(record.exc_info[1]).__name__)
        # The redacting filter caches a redacted traceback in exc_text; format it otherwise.
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            entry["exception"] = redact_text(record.exc_text)
        if record.stack_info:
            entry["stack"] = redact_text(self.formatStack(record.stack_info))
        # Every such character is inside a string of the JSON text: its escape is valid there.
        return _RAW_UNSAFE.sub(
            lambda match: f"\\u{ord(match.group(0)):04x}",
            json.dumps(entry, ensure_ascii=False, default=str),
        )


__all__ = ["FIELDS", "JsonFormatter", "error_class", "fields"]
