"""The publisher contract on the brokers that need no server: ``memory://`` and ``file://``.

These are the relay's real publishers for embedding, the demo and debugging, so they keep the
same promises as RabbitMQ or NATS; and a run with every service down still tests the
contract itself (``scripts/test tests/integration -k "memory or file"``).
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import time
import uuid

import pytest

from outboxer.brokers import create_publisher
from outboxer.brokers.base import Publisher
from outboxer.brokers.memory import MemoryBroker, memory_broker
from outboxer.errors import PublishError
from outboxer.message import JSON, Message, uuid7
from outboxer.testing import Consumer, PublisherContract, Received, make_message


class MemoryConsumer(Consumer):
    """The messages of one topic that reach a memory broker after the consumer started."""

    def __init__(self, broker: MemoryBroker, topic: str) -> None:
        self.broker = broker
        self.topic = topic
        self.position = len(broker.messages)

    async def receive(self, count: int, timeout: float = 10.0) -> list[Received]:
        deadline = time.monotonic() + timeout
        while True:
            found = [m for m in self.broker.messages[self.position :] if m.topic == self.topic]
            if len(found) >= count or time.monotonic() > deadline:
                return [
                    Received(str(m.id), m.topic, m.key, dict(m.headers), m.payload)
                    for m in found[:count]
                ]
            await asyncio.sleep(0.01)


class TestMemoryPublisherContract(PublisherContract):
    @pytest.fixture(autouse=True)
    def _broker(self) -> None:
        self.name = f"contract-{uuid.uuid4().hex[:12]}"
        self.broker = memory_broker(self.name)

    def make_publisher(self) -> Publisher:
        return create_publisher(f"memory://{self.name}")

    def make_unreachable_publisher(self) -> Publisher:
        down = f"{self.name}-down"
        memory_broker(down).available = False
        return create_publisher(f"memory://{down}")

    async def start_consumer(self, topic: str) -> Consumer:
        return MemoryConsumer(self.broker, topic)

    def rejected_message(self, topic: str) -> Message:
        refused = make_message(topic, {"refused": True})

        def fail(message: Message) -> BaseException | None:
            if message.id == refused.id:
                return PublishError("refused for good", retryable=False)
            return None

        self.broker.fail = fail
        return refused

    async def restart_server(self) -> None:
        # Down for a moment: a publish meanwhile breaks the connection, connects are refused,
        # and the publisher must connect again once the broker is back.
        self.broker.available = False
        asyncio.get_running_loop().call_later(0.3, setattr, self.broker, "available", True)


class FileConsumer(Consumer):
    """The lines of one topic appended to a JSON-lines file after the consumer started."""

    def __init__(self, path: pathlib.Path, topic: str) -> None:
        self.path = path
        self.topic = topic
        self.offset = path.stat().st_size if path.exists() else 0

    def lines(self) -> list[dict[str, object]]:
        if not self.path.exists():
            return []
        with self.path.open("rb") as file:
            file.seek(self.offset)
            text = file.read().decode("utf-8")
        # Only whole lines: a line being written has no newline yet.
        records = [json.loads(line) for line in text.split("\n")[:-1]]
        return [r for r in records if r["destination_topic"] == self.topic]

    async def receive(self, count: int, timeout: float = 10.0) -> list[Received]:
        deadline = time.monotonic() + timeout
        found = self.lines()
        while len(found) < count and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
            found = self.lines()
        return [received(record) for record in found[:count]]


def received(record: dict[str, object]) -> Received:
    """A file line as a consumer sees it; the payload back as the bytes that were published.

    A line holds a JSON payload as JSON and text as text, so both are encoded again here the
    way enqueue encodes them (compact JSON, UTF-8); anything else is hex.
    """
    payload = record["payload"]
    content_type = str(record["content_type"])
    if content_type == JSON:
        body = json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()
    elif content_type.startswith("text/"):
        body = str(payload).encode()
    else:
        body = bytes.fromhex(str(payload))
    key = record["key"]
    headers = record["headers"]
    assert isinstance(headers, dict)
    return Received(
        id=str(record["id"]),
        topic=str(record["topic"]),
        key=None if key is None else str(key),
        headers={str(name): str(value) for name, value in headers.items()},
        payload=body,
    )


def misdescribed_message(topic: str) -> Message:
    """Labelled JSON but not JSON: its line cannot be written as the format promises, and
    never will be, while the batch's other messages can."""
    return Message(id=uuid7(), topic=topic, payload=b"{not json", content_type=JSON)


class TestFilePublisherContract(PublisherContract):
    @pytest.fixture(autouse=True)
    def _path(self, tmp_path: pathlib.Path) -> None:
        self.path = tmp_path / "events" / "out.jsonl"
        self.tmp_path = tmp_path

    def make_publisher(self) -> Publisher:
        return create_publisher(f"file://{self.path}")

    def make_unreachable_publisher(self) -> Publisher:
        # The file's directory would have to be a regular file: opening it can never succeed.
        blocker = self.tmp_path / "not-a-directory"
        blocker.write_text("")
        return create_publisher(f"file://{blocker}/out.jsonl")

    async def start_consumer(self, topic: str) -> Consumer:
        return FileConsumer(self.path, topic)

    def rejected_message(self, topic: str) -> Message:
        return misdescribed_message(topic)

    async def restart_server(self) -> None:
        pytest.skip("a file has no server to restart: each write goes to the open file")


async def test_stdout_fails_a_misdescribed_payload_alone(
    capsys: pytest.CaptureFixture[str],
) -> None:
    bad = misdescribed_message("t")
    good = make_message("t", {"ok": True})
    async with create_publisher("stdout://") as publisher:
        outcomes = await publisher.publish_batch([bad, good])
    assert (outcomes[0].published, outcomes[0].retryable) == (False, False), outcomes[0]
    assert outcomes[1].published, outcomes[1]
    [line] = capsys.readouterr().out.splitlines()
    assert json.loads(line)["id"] == str(good.id)
