"""``file:///path/events.jsonl``: the consumer side of the JSON-lines broker (the demo's).

Reads the lines :class:`FilePublisher` appends, from where the group left off: the number
of lines acknowledged lives beside the file, in ``<file>.<group>.offset``, written once
every line before it is acknowledged (lines finish out of order across keys). A line is
acknowledged once the transaction that applied it committed; a consumer started again
reads on from the first line not acknowledged.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from outboxer.brokers.base import describe, parse_options
from outboxer.errors import ConfigError
from outboxer.message import (
    HEADER_CONTENT_TYPE,
    HEADER_CREATED_AT,
    HEADER_ID,
    HEADER_KEY,
    HEADER_TOPIC,
)
from outboxer.receivers.base import Incoming, Receiver, Watermark, decode, unreadable

_POLL = 0.05


def _body(record: dict[str, Any]) -> bytes:
    """The payload bytes back from ``Message.to_json`` (JSON value, text, or hex)."""
    content_type = str(record.get("content_type") or "")
    payload = record.get("payload")
    if content_type == "application/json":
        return json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()
    if content_type.startswith("text/"):
        return str(payload).encode()
    return bytes.fromhex(str(payload))


class FileReceiver(Receiver):
    schemes = ("file",)
    all_topics = "*"

    def __init__(self, url: str, **options: Any) -> None:
        super().__init__(url, **options)
        parts, _ = parse_options(url)
        if not parts.path:
            raise ConfigError(f"file broker URL needs a path: {url!r} (file:///tmp/events.jsonl)")
        self.path = Path(parts.path)
        self.offset_path = self.path.with_name(f"{self.path.name}.{self.group}.offset")
        self._file: IO[str] | None = None
        self._line = 0
        self._acks = Watermark(0)

    async def _connect(self) -> None:
        await self._close()
        done = int(self.offset_path.read_text()) if self.offset_path.exists() else 0
        # Bytes that are not UTF-8 make that line unreadable, not the whole file.
        self._file = self.path.open(encoding="utf-8", errors="replace")
        for _ in range(done):
            self._file.readline()
        self._line, self._acks = done, Watermark(done)

    async def _close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    async def _receive(self, limit: int, timeout: float) -> list[Incoming]:
        if self._file is None:
            raise ConnectionError("the file receiver is not open")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        received: list[Incoming] = []
        while len(received) < limit:
            position = self._file.tell()
            line = self._file.readline()
            if not line.endswith("\n"):  # nothing new, or a line still being written
                self._file.seek(position)
                if received or loop.time() >= deadline:
                    break
                await asyncio.sleep(_POLL)
                continue
            try:
                incoming = self._incoming(line)
            except Exception as exc:  # noqa: BLE001 -- one bad line must not fail the rest
                # Raised, it would read as a lost connection, and the reconnect reads on from
                # the offset: this line would come first every time, forever.
                incoming = unreadable(
                    f"line {self._line + 1} cannot be read: {describe(exc)}", line.encode()
                )
            incoming.token = self._line
            self._line += 1
            received.append(incoming)
        return received

    def _incoming(self, line: str) -> Incoming:
        record = json.loads(line)
        if not isinstance(record, dict):
            raise TypeError(f"a line holds a JSON object, not {type(record).__name__}")
        headers = record.get("headers", {})
        # A message's headers are text (Message.headers): a hand-written line's numbers or
        # lists would reach the handler, the trace extraction and the dead letters as is.
        if not isinstance(headers, dict) or not all(
            isinstance(value, str) for value in headers.values()
        ):
            raise TypeError("headers must be a JSON object of strings")
        headers = dict(headers)
        for name, field in (
            (HEADER_ID, "id"),
            (HEADER_TOPIC, "topic"),
            (HEADER_KEY, "key"),
            (HEADER_CONTENT_TYPE, "content_type"),
            (HEADER_CREATED_AT, "created_at"),
        ):
            if record.get(field) is not None:
                headers[name] = str(record[field])
        return decode(headers, _body(record))

    async def lag(self, timeout: float = 5.0) -> int | None:
        """Whole lines of the file not handed out yet (the demo's broker: read in full)."""
        if not self._connected or self._file is None:
            return None
        try:
            lines = await asyncio.wait_for(asyncio.to_thread(self._lines), timeout)
        except (OSError, TimeoutError):
            return None
        # Counted before the receives meanwhile moved on: never below nothing.
        return max(0, lines - self._line)

    def _lines(self) -> int:
        # Read as _receive reads: a line still being written (no newline yet) waits.
        with self.path.open(encoding="utf-8", errors="replace") as file:
            return sum(1 for line in file if line.endswith("\n"))

    async def _ack(self, incomings: Sequence[Incoming]) -> None:
        moved = False
        for incoming in incomings:
            moved = self._acks.complete(incoming.token) or moved
        if moved:
            partial = self.offset_path.with_suffix(".partial")
            partial.write_text(str(self._acks.next))
            os.replace(partial, self.offset_path)  # the whole number or the old one, never half


__all__ = ["FileReceiver"]
