"""``memory://NAME``: an in-process broker for tests and embedding.

Every publisher with the same NAME appends to the same list, which
``memory_broker(NAME)`` returns. A message is confirmed once it is in the list.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from outboxer.brokers.base import Publisher, parse_options
from outboxer.errors import PublishError
from outboxer.message import Message


@dataclass
class MemoryBroker:
    name: str
    messages: list[Message] = field(default_factory=list)
    #: Fault injection for tests: return an exception to fail that message.
    fail: Callable[[Message], BaseException | None] | None = None
    #: Simulated confirm latency in seconds.
    latency: float = 0.0
    available: bool = True

    def clear(self) -> None:
        self.messages.clear()
        self.fail = None
        self.latency = 0.0
        self.available = True


_brokers: dict[str, MemoryBroker] = {}


def memory_broker(name: str = "default") -> MemoryBroker:
    """The shared in-process broker called ``name`` (created on first use)."""
    broker = _brokers.get(name)
    if broker is None:
        broker = _brokers[name] = MemoryBroker(name)
    return broker


class MemoryPublisher(Publisher):
    schemes = ("memory",)

    def __init__(
        self, url: str, *, routes: Mapping[str, str] | None = None, publish_timeout: float = 30.0
    ) -> None:
        super().__init__(url, routes=routes, publish_timeout=publish_timeout)
        parts, _ = parse_options(url)
        self.broker = memory_broker(parts.netloc or parts.path.strip("/") or "default")

    async def _connect(self) -> None:
        if not self.broker.available:
            raise ConnectionRefusedError(f"memory broker {self.broker.name!r} is unavailable")

    async def _close(self) -> None:
        return None

    async def _publish_wave(self, messages: Sequence[Message]) -> list[BaseException | None]:
        # One await per wave, not a task per message: this broker isolates the relay's own cost.
        if self.broker.latency:
            await asyncio.sleep(self.broker.latency)
        if not self.broker.available:
            raise ConnectionResetError(f"memory broker {self.broker.name!r} went away")
        results: list[BaseException | None] = []
        for message in messages:
            error = self.broker.fail(message) if self.broker.fail is not None else None
            if error is None:
                self.broker.messages.append(message)
            results.append(error)
        return results


__all__ = ["MemoryBroker", "MemoryPublisher", "PublishError", "memory_broker"]
