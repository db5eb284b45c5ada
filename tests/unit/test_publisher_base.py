"""The Publisher base class's own behaviour, on the in-process memory broker."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from outboxer import OutcomeKind, PublishError, create_publisher
from outboxer.brokers.base import AckedPublisher, waves
from outboxer.brokers.memory import memory_broker
from outboxer.message import Message
from outboxer.testing import make_message


@pytest.fixture
def broker_name() -> str:
    return f"unit-{uuid.uuid4().hex[:8]}"


def test_waves_hold_one_message_per_key_in_order() -> None:
    batch = [make_message("t", key=k) for k in ["a", "a", None, "b", "a", None, "b"]]
    assert waves(batch) == [[0, 2, 3, 5], [1, 6], [4]]


async def test_failure_skips_the_rest_of_its_key_only(broker_name: str) -> None:
    broker = memory_broker(broker_name)
    batch = [make_message("t", {"n": n}, key=k) for n, k in enumerate(["a", "b", "a", "b", None])]
    broker.fail = lambda m: PublishError("nope") if m.id == batch[0].id else None
    async with create_publisher(f"memory://{broker_name}") as publisher:
        outcomes = await publisher.publish_batch(batch)
    assert [o.kind for o in outcomes] == [
        OutcomeKind.FAILED,
        OutcomeKind.PUBLISHED,
        OutcomeKind.SKIPPED,
        OutcomeKind.PUBLISHED,
        OutcomeKind.PUBLISHED,
    ]
    assert [m.id for m in broker.messages] == [batch[1].id, batch[4].id, batch[3].id]
    assert outcomes[0].retryable and "nope" in (outcomes[0].error or "")


async def test_permanent_failures_and_connection_loss_are_classified(broker_name: str) -> None:
    broker = memory_broker(broker_name)
    batch = [make_message("t", {"n": n}) for n in range(2)]
    broker.fail = lambda m: (
        PublishError("too large", retryable=False)
        if m.id == batch[0].id
        else ConnectionResetError("gone")
    )
    publisher = create_publisher(f"memory://{broker_name}")
    await publisher.connect()
    outcomes = await publisher.publish_batch(batch)
    assert (outcomes[0].kind, outcomes[0].retryable) == (OutcomeKind.FAILED, False)
    assert (outcomes[1].kind, outcomes[1].retryable) == (OutcomeKind.FAILED, True)
    assert not publisher.connected, "a connection error makes the relay reconnect"
    again = await publisher.publish_batch(batch)
    assert all(o.kind is OutcomeKind.FAILED and "not connected" in (o.error or "") for o in again)


async def test_unconfirmed_wave_times_out_as_retryable(broker_name: str) -> None:
    memory_broker(broker_name).latency = 5
    publisher = create_publisher(f"memory://{broker_name}", publish_timeout=0.1)
    await publisher.connect()
    started = asyncio.get_running_loop().time()
    [outcome] = await publisher.publish_batch([make_message("t")])
    assert asyncio.get_running_loop().time() - started < 2
    assert (
        outcome.kind is OutcomeKind.FAILED
        and outcome.retryable
        and "did not confirm" in (outcome.error or "")
    )


async def test_unreachable_broker_raises_on_connect(broker_name: str) -> None:
    from outboxer import BrokerUnavailableError

    memory_broker(broker_name).available = False
    with pytest.raises(BrokerUnavailableError):
        await create_publisher(f"memory://{broker_name}").connect()


def test_unknown_scheme_and_missing_extra_are_config_errors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys

    from outboxer import ConfigError, MissingDependencyError

    with pytest.raises(ConfigError, match="unknown broker URL scheme"):
        create_publisher("carrier-pigeon://coop")
    monkeypatch.setitem(sys.modules, "aio_pika", None)
    with pytest.raises(MissingDependencyError, match=r"pip install 'outboxer\[rabbitmq\]'"):
        create_publisher("amqp://localhost/")


def test_safe_url_hides_the_password() -> None:
    publisher = create_publisher("memory://x")
    publisher.url = "amqp://user:secret@host:5672/vhost"
    assert "secret" not in publisher.safe_url and "host:5672" in publisher.safe_url


class ScriptedAcks(AckedPublisher[str]):
    """An AckedPublisher whose broker is a script: per payload, how ``_send`` behaves."""

    def __init__(self) -> None:
        super().__init__("scripted://")
        self.lost: asyncio.Event | None = asyncio.Event()
        self.acks: dict[bytes, asyncio.Future[str]] = {}

    async def _connect(self) -> None:
        pass

    async def _close(self) -> None:
        pass

    def _connection_lost_event(self) -> asyncio.Event | None:
        return self.lost

    async def _send(self, message: Message) -> asyncio.Future[str]:
        if message.payload == b"refused":
            raise PublishError("refused", retryable=False)
        if message.payload == b"cut":
            raise ConnectionResetError("cut")
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.acks[message.payload] = future
        return future

    def _ack_error(self, message: Message, ack: str) -> BaseException | None:
        return None if ack == "ok" else PublishError(f"nack: {ack}")

    def _connection_error(self, detail: str) -> BaseException:
        return ConnectionError(f"the connection {detail}")


async def wave_awaiting_acks(
    publisher: ScriptedAcks, *payloads: bytes, sent: int
) -> asyncio.Future[list[BaseException | None]]:
    """The publisher's wave of these payloads, once ``sent`` of them await their acks."""
    messages = [Message(id=uuid.uuid4(), topic="t", payload=payload) for payload in payloads]
    wave = asyncio.ensure_future(publisher._publish_wave(messages))
    while len(publisher.acks) < sent:
        await asyncio.sleep(0)
    return wave


async def test_acked_wave_sends_everything_then_reads_each_ack() -> None:
    publisher = ScriptedAcks()
    wave = await wave_awaiting_acks(publisher, b"a", b"refused", b"b", b"c", sent=3)
    publisher.acks[b"c"].set_result("no")
    publisher.acks[b"a"].set_result("ok")
    publisher.acks[b"b"].set_result("ok")
    a, refused, b, c = await wave
    assert (a, b) == (None, None)
    assert isinstance(refused, PublishError) and not refused.retryable
    assert isinstance(c, PublishError) and "nack: no" in str(c)


async def test_acked_wave_stops_sending_at_a_connection_failure_and_ends_when_lost() -> None:
    publisher = ScriptedAcks()
    wave = await wave_awaiting_acks(publisher, b"a", b"b", b"cut", b"d", sent=2)
    publisher.acks[b"a"].set_result("ok")
    assert publisher.lost is not None
    publisher.lost.set()  # b's ack never comes
    a, b, cut, d = await asyncio.wait_for(wave, 1)
    assert a is None
    assert str(b) == "the connection was lost before the ack"
    assert isinstance(cut, ConnectionResetError)
    assert str(d) == "the connection was lost before publishing"
    assert b"d" not in publisher.acks, "nothing is sent after a connection failure"
    assert publisher.acks[b"b"].cancelled()


async def test_acked_wave_without_a_connection_sends_nothing() -> None:
    publisher = ScriptedAcks()
    publisher.lost = None
    results = await (await wave_awaiting_acks(publisher, b"a", b"b", sent=0))
    assert [str(r) for r in results] == ["the connection is not open"] * 2
    assert publisher.acks == {}


async def test_acked_batch_counts_no_attempt_for_messages_the_wave_never_sent() -> None:
    """NATS and MQTT publish through AckedPublisher: a message behind a connection failure in
    its wave was never sent, so the relay must give it back untried; one that was sent and
    lost its ack was attempted."""
    publisher = ScriptedAcks()
    await publisher.connect()
    messages = [
        Message(id=uuid.uuid4(), topic="t", payload=payload, key=key)
        for payload, key in ((b"a", "k1"), (b"b", "k2"), (b"cut", "k3"), (b"d", "k4"))
    ]
    batch = asyncio.ensure_future(publisher.publish_batch(messages))
    while len(publisher.acks) < 2:
        await asyncio.sleep(0)
    publisher.acks[b"a"].set_result("ok")
    assert publisher.lost is not None
    publisher.lost.set()
    a, b, cut, d = await asyncio.wait_for(batch, 1)
    assert a.kind is OutcomeKind.PUBLISHED
    assert (b.kind, b.attempted) == (OutcomeKind.FAILED, True), "sent: its ack was lost"
    assert (cut.kind, cut.attempted) == (OutcomeKind.FAILED, True), "the send itself failed"
    assert (d.kind, d.attempted) == (OutcomeKind.FAILED, False), "never sent"
    assert d.error is not None and "lost before publishing" in d.error
