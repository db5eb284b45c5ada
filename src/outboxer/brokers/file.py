"""``file:///path.jsonl`` and ``stdout://``: JSON lines, for the demo and for debugging.

A message is confirmed once its line is flushed (and, for files, fsynced):
a crash after that cannot lose it.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

from outboxer.brokers.base import Publisher, parse_options
from outboxer.errors import ConfigError
from outboxer.message import Message
from outboxer.redact import redact_url


def _line(message: Message, destination: str) -> str:
    record = message.to_json()
    record["destination_topic"] = destination
    return json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n"


class FilePublisher(Publisher):
    schemes = ("file",)

    def __init__(
        self, url: str, *, routes: Mapping[str, str] | None = None, publish_timeout: float = 30.0
    ) -> None:
        super().__init__(url, routes=routes, publish_timeout=publish_timeout)
        parts, options = parse_options(url)
        if not parts.path:
            raise ConfigError(
                f"file broker URL needs a path: {redact_url(url)!r} (file:///tmp/events.jsonl)"
            )
        self.path = Path(parts.path)
        self.fsync = options.get("fsync", "true").lower() not in ("0", "false", "no")
        self._file: IO[str] | None = None

    async def _connect(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")

    async def _close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    async def _publish_wave(self, messages: Sequence[Message]) -> list[BaseException | None]:
        if self._file is None:
            raise ConnectionError("file publisher is not open")
        text = "".join(_line(message, self.destination_for(message)) for message in messages)
        await asyncio.to_thread(self._write, text)
        return [None] * len(messages)

    def _write(self, text: str) -> None:
        assert self._file is not None
        self._file.write(text)
        self._file.flush()
        if self.fsync:
            os.fsync(self._file.fileno())


class StdoutPublisher(Publisher):
    schemes = ("stdout",)

    async def _connect(self) -> None:
        return None

    async def _close(self) -> None:
        return None

    async def _publish_wave(self, messages: Sequence[Message]) -> list[BaseException | None]:
        sys.stdout.write(
            "".join(_line(message, self.destination_for(message)) for message in messages)
        )
        sys.stdout.flush()
        return [None] * len(messages)
