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

from outboxer.brokers.base import Publisher, option_bool, parse_options
from outboxer.errors import ConfigError, PublishError
from outboxer.message import Message
from outboxer.redact import redact_url


def _line(message: Message, destination: str) -> str:
    record = message.to_json()
    record["destination_topic"] = destination
    return json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n"


def _lines(
    publisher: Publisher, messages: Sequence[Message]
) -> tuple[str, list[BaseException | None]]:
    """The lines of a wave, and per message None or why it has no line.

    A payload that its content type misdescribes (labelled JSON but not JSON, text but not
    UTF-8) has no line and never will: it fails for good, alone, so the rest of its wave is
    still written rather than failing with it on every attempt.
    """
    lines: list[str] = []
    results: list[BaseException | None] = []
    for message in messages:
        try:
            lines.append(_line(message, publisher.destination_for(message)))
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
            results.append(
                PublishError(
                    f"payload is not what its content type {message.content_type!r} says: {exc}",
                    retryable=False,
                )
            )
        else:
            results.append(None)
    return "".join(lines), results


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
        # The words of every yes/no option: "off" meant on, and a typo passed as on.
        self.fsync = option_bool(options, "fsync", None, True)
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
        text, results = _lines(self, messages)
        if text:
            await asyncio.to_thread(self._write, text)
        return results

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
        text, results = _lines(self, messages)
        sys.stdout.write(text)
        sys.stdout.flush()
        return results
