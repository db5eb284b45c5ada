"""``memory://NAME``: the consumer side of the in-process broker, for tests and embedding.

Each group reads the broker's list from its own position. A message handed out stays
unacknowledged until acked; closing the receiver hands every unacknowledged message back,
and the group's next receiver delivers those first, in their order (as RabbitMQ requeues).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from outboxer.brokers.base import parse_options
from outboxer.brokers.memory import MemoryBroker, memory_broker
from outboxer.receivers.base import Incoming, Receiver, decode

_POLL = 0.005


@dataclass
class GroupState:
    """Where a group is in a memory broker's list."""

    position: int = 0
    #: Positions handed out and not acked yet.
    unacked: set[int] = field(default_factory=set)
    #: Positions handed back, delivered again before anything new.
    returned: list[int] = field(default_factory=list)
    acked: set[int] = field(default_factory=set)


_groups: dict[tuple[str, str], GroupState] = {}


def group_state(broker: str, group: str) -> GroupState:
    return _groups.setdefault((broker, group), GroupState())


class MemoryReceiver(Receiver):
    schemes = ("memory",)
    all_topics = "*"

    def __init__(self, url: str, **options: Any) -> None:
        super().__init__(url, **options)
        parts, _ = parse_options(url)
        self.broker: MemoryBroker = memory_broker(
            parts.netloc or parts.path.strip("/") or "default"
        )
        self.state = group_state(self.broker.name, self.group)
        self._mine: set[int] = set()

    async def _connect(self) -> None:
        if not self.broker.available:
            raise ConnectionRefusedError(f"memory broker {self.broker.name!r} is unavailable")

    async def _close(self) -> None:
        # Unacknowledged messages go back to the group, in their order.
        self.state.returned = sorted(set(self.state.returned) | self._mine)
        self.state.unacked -= self._mine
        self._mine = set()

    def _wanted(self, position: int) -> bool:
        topic = self.broker.messages[position].topic
        return "*" in self.topics or topic in self.topics

    async def _receive(self, limit: int, timeout: float) -> list[Incoming]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            if not self.broker.available:
                raise ConnectionResetError(f"memory broker {self.broker.name!r} went away")
            positions: list[int] = []
            while self.state.returned and len(positions) < limit:
                positions.append(self.state.returned.pop(0))
            while self.state.position < len(self.broker.messages) and len(positions) < limit:
                if self._wanted(self.state.position):
                    positions.append(self.state.position)
                self.state.position += 1
            if positions or loop.time() >= deadline:
                break
            await asyncio.sleep(_POLL)
        received = []
        for position in positions:
            message = self.broker.messages[position]
            incoming = decode(message.envelope_headers(), message.payload)
            incoming.token = position
            self.state.unacked.add(position)
            self._mine.add(position)
            received.append(incoming)
        return received

    async def lag(self, timeout: float = 5.0) -> int | None:
        """The group's messages not handed out: those handed back, and the broker's list
        from the group's position on (of its topics)."""
        if not self._connected or not self.broker.available:
            return None
        ahead = range(self.state.position, len(self.broker.messages))
        return len(self.state.returned) + sum(1 for p in ahead if self._wanted(p))

    async def _ack(self, incomings: Sequence[Incoming]) -> None:
        for incoming in incomings:
            self.state.unacked.discard(incoming.token)
            self._mine.discard(incoming.token)
            self.state.acked.add(incoming.token)


__all__ = ["GroupState", "MemoryReceiver", "group_state"]
