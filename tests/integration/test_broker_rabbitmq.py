"""RabbitMQPublisher against the real RabbitMQ on 127.0.0.1:5672: the contract plus AMQP specifics."""

from __future__ import annotations

import asyncio
import importlib.metadata
import shutil
import subprocess
import time
import uuid
from datetime import UTC, datetime
from typing import Any

import aio_pika
import aiormq
import pytest
from aio_pika.abc import AbstractIncomingMessage

from outboxer.brokers import create_publisher, rabbitmq
from outboxer.brokers.base import OutcomeKind, Publisher
from outboxer.brokers.rabbitmq import RabbitMQPublisher
from outboxer.errors import ConfigError, PublishError
from outboxer.message import HEADER_KEY, HEADER_TOPIC, Message
from outboxer.testing import Consumer, PublisherContract, Received, TcpProxy, make_message
from tests.services import port_open, require

HOST, PORT = "127.0.0.1", 5672
URL = f"amqp://guest:guest@{HOST}:{PORT}/"
EXCHANGE = "outboxer-test"
#: An internal exchange: RabbitMQ refuses every basic.publish to it with 403 ACCESS_REFUSED.
INTERNAL_EXCHANGE = "outboxer-test-internal"
REJECTED_TOPIC = "contract.rejected"
#: Takes every contract topic and keeps nothing (x-max-length 0), so that a contract test's
#: message published before its consumer exists is routable: with mandatory=True RabbitMQ
#: would otherwise return it, which the adapter reports as a (retryable) failure.
SINK_QUEUE = "outboxer-test-sink"


async def declare(*exchanges: tuple[str, dict[str, Any]], sink: bool = False) -> None:
    connection = await aio_pika.connect(URL)
    async with connection:
        channel = await connection.channel()
        for name, options in exchanges:
            await channel.declare_exchange(name, options.pop("type", "topic"), **options)
        if sink:
            queue = await channel.declare_queue(
                SINK_QUEUE, durable=True, arguments={"x-max-length": 0}
            )
            await queue.bind(EXCHANGE, "contract.#")


async def delete_exchange(name: str) -> None:
    connection = await aio_pika.connect(URL)
    async with connection:
        channel = await connection.channel()
        await channel.exchange_delete(name)


@pytest.fixture(autouse=True)
async def _rabbitmq() -> None:
    require("rabbitmq")
    await declare(
        (EXCHANGE, {"durable": True}),
        (INTERNAL_EXCHANGE, {"durable": True, "internal": True}),
        sink=True,
    )


@pytest.fixture(autouse=True, params=["waves", "per-message"])
def write_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs on both ways of writing: a wave in one go through aiormq 7.2's channel
    state, and a ``basic_publish`` per message (what other aiormq versions get)."""
    monkeypatch.setattr(RabbitMQPublisher, "_wave_writes", request.param == "waves")
    return str(request.param)


def count_basic_publish_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A one-item list counting the calls of aiormq's ``basic_publish`` from now on."""
    calls = [0]
    basic_publish = aiormq.Channel.basic_publish

    async def counting(self: aiormq.Channel, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return await basic_publish(self, *args, **kwargs)

    monkeypatch.setattr(aiormq.Channel, "basic_publish", counting)
    return calls


def header_text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class QueueConsumer(Consumer):
    """A fresh exclusive queue bound to ``exchange`` with ``binding`` as routing key."""

    def __init__(self) -> None:
        self.inbox: asyncio.Queue[AbstractIncomingMessage] = asyncio.Queue()
        self.raw: list[AbstractIncomingMessage] = []
        self.connection: aio_pika.abc.AbstractConnection | None = None
        self.queue_name = ""

    @classmethod
    async def start(cls, exchange: str, binding: str, *, queue: str = "") -> QueueConsumer:
        consumer = cls()
        consumer.connection = await aio_pika.connect(URL)
        channel = await consumer.connection.channel()
        declared = await channel.declare_queue(queue, exclusive=True)
        consumer.queue_name = declared.name
        if exchange:
            await declared.bind(exchange, binding)
        await declared.consume(consumer._on_message, no_ack=True)
        return consumer

    async def _on_message(self, message: AbstractIncomingMessage) -> None:
        await self.inbox.put(message)

    async def messages(self, count: int, timeout: float) -> list[AbstractIncomingMessage]:
        got: list[AbstractIncomingMessage] = []
        deadline = time.monotonic() + timeout
        while len(got) < count:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                got.append(await asyncio.wait_for(self.inbox.get(), remaining))
            except TimeoutError:
                break
        self.raw.extend(got)
        return got

    async def ids_until(self, expected: set[str], timeout: float = 10.0) -> set[str]:
        """Message ids seen until all of ``expected`` arrived (duplicates may come too)."""
        seen: set[str] = set()
        deadline = time.monotonic() + timeout
        while not expected <= seen and time.monotonic() < deadline:
            got = await self.messages(1, deadline - time.monotonic())
            seen.update(str(m.message_id) for m in got)
        return seen

    async def receive(self, count: int, timeout: float = 10.0) -> list[Received]:
        received = []
        for message in await self.messages(count, timeout):
            headers = {name: header_text(value) for name, value in message.headers.items()}
            received.append(
                Received(
                    id=str(message.message_id),
                    topic=headers.get(HEADER_TOPIC, message.routing_key or ""),
                    key=headers.get(HEADER_KEY),
                    headers=headers,
                    payload=message.body,
                )
            )
        return received

    async def close(self) -> None:
        if self.connection is not None:
            await self.connection.close()


def run_ctl(*args: str) -> None:
    if shutil.which("rabbitmqctl") is None:
        pytest.skip("rabbitmqctl is not available to restart RabbitMQ")
    done = subprocess.run(
        ["rabbitmqctl", *args], capture_output=True, text=True, timeout=60, check=False
    )
    if done.returncode != 0:
        pytest.skip(f"rabbitmqctl {' '.join(args)} failed: {done.stderr.strip()[:200]}")


class TestRabbitMQContract(PublisherContract):
    def make_publisher(self) -> Publisher:
        return RabbitMQPublisher(
            URL,
            exchange=EXCHANGE,
            publish_timeout=10.0,
            routes={REJECTED_TOPIC: f"{INTERNAL_EXCHANGE}/refused"},
        )

    def make_unreachable_publisher(self) -> Publisher:
        return RabbitMQPublisher(f"amqp://guest:guest@{HOST}:1/", connect_timeout=2.0)

    async def start_consumer(self, topic: str) -> Consumer:
        return await QueueConsumer.start(EXCHANGE, topic)

    def rejected_message(self, topic: str) -> Message:
        # Routed to an internal exchange: RabbitMQ closes the channel with 403 ACCESS_REFUSED.
        return make_message(REJECTED_TOPIC, {"refused": True})

    async def restart_server(self) -> None:
        # stop_app/start_app restarts the RabbitMQ application (every connection is dropped,
        # the listener closes) without restarting the Erlang node: about 2 s here.
        await asyncio.to_thread(run_ctl, "stop_app")
        try:
            assert not port_open(PORT), "RabbitMQ still listens after stop_app"
        finally:
            await asyncio.to_thread(run_ctl, "start_app")
            deadline = time.monotonic() + 60
            while not port_open(PORT):
                assert time.monotonic() < deadline, "RabbitMQ did not come back"
                await asyncio.sleep(0.2)


# ----- RabbitMQ specifics --------------------------------------------------------------------


def fresh(prefix: str = "rmq") -> str:
    return f"{prefix}.{uuid.uuid4().hex[:12]}"


async def test_unroutable_message_is_a_retryable_failure() -> None:
    topic = fresh()  # nothing is bound for it
    bound = fresh()
    consumer = await QueueConsumer.start(EXCHANGE, bound)
    lost, kept = make_message(topic), make_message(bound)
    async with RabbitMQPublisher(URL, exchange=EXCHANGE) as publisher:
        outcomes = await publisher.publish_batch([lost, kept])
        assert publisher.connected
    assert outcomes[0].kind is OutcomeKind.FAILED and outcomes[0].retryable, outcomes[0]
    assert "unroutable" in (outcomes[0].error or ""), outcomes[0]
    assert outcomes[1].published, outcomes[1]
    assert [r.id for r in await consumer.receive(1, 5)] == [str(kept.id)]
    await consumer.close()


async def test_mandatory_false_lets_rabbitmq_drop_unroutable_messages() -> None:
    async with RabbitMQPublisher(f"{URL}?exchange={EXCHANGE}&mandatory=false") as publisher:
        [outcome] = await publisher.publish_batch([make_message(fresh())])
    assert outcome.published, outcome


async def test_amqp_properties_carry_the_envelope() -> None:
    topic = fresh()
    consumer = await QueueConsumer.start(EXCHANGE, topic)
    created = datetime(2024, 5, 1, 12, 30, 15, tzinfo=UTC)
    sent = Message(
        id=uuid.uuid4(),
        topic=topic,
        payload=b"hello",
        key="order-7",
        headers={"trace": "t-1"},
        content_type="text/plain; charset=utf-8",
        created_at=created,
    )
    async with RabbitMQPublisher(URL, exchange=EXCHANGE) as publisher:
        [outcome] = await publisher.publish_batch([sent])
    assert outcome.published, outcome
    [got] = await consumer.messages(1, 5)
    await consumer.close()
    assert got.message_id == str(sent.id)
    assert got.content_type == "text/plain; charset=utf-8"
    assert got.delivery_mode == aio_pika.DeliveryMode.PERSISTENT
    assert got.timestamp is not None and got.timestamp.replace(tzinfo=UTC) == created
    assert got.routing_key == topic and got.exchange == EXCHANGE
    headers = {name: header_text(value) for name, value in got.headers.items()}
    assert headers["trace"] == "t-1"
    assert headers["outboxer-key"] == "order-7"
    assert headers["outboxer-id"] == str(sent.id)
    assert headers["outboxer-topic"] == topic
    assert headers["outboxer-created-at"] == created.isoformat()


async def test_transient_delivery_mode_option() -> None:
    topic = fresh()
    consumer = await QueueConsumer.start(EXCHANGE, topic)
    async with RabbitMQPublisher(f"{URL}?exchange={EXCHANGE}&persistent=false") as publisher:
        [outcome] = await publisher.publish_batch([make_message(topic)])
    assert outcome.published
    [got] = await consumer.messages(1, 5)
    await consumer.close()
    assert got.delivery_mode == aio_pika.DeliveryMode.NOT_PERSISTENT


async def test_exchange_option_is_declared_and_used() -> None:
    exchange, topic = fresh("outboxer-test-x"), fresh()
    publisher = create_publisher(f"{URL}?exchange={exchange}&exchange_type=direct")
    assert isinstance(publisher, RabbitMQPublisher)
    try:
        await publisher.connect()  # declares the durable exchange
        consumer = await QueueConsumer.start(exchange, topic)
        message = make_message(topic)
        [outcome] = await publisher.publish_batch([message])
        assert outcome.published, outcome
        [got] = await consumer.messages(1, 5)
        await consumer.close()
        assert got.exchange == exchange and got.message_id == str(message.id)
    finally:
        await publisher.close()
        await delete_exchange(exchange)


async def test_routes_pick_exchange_and_routing_key() -> None:
    other, topic, queue_topic = fresh("outboxer-test-r"), fresh(), fresh()
    await declare((other, {"durable": False, "auto_delete": False}))
    try:
        to_other = await QueueConsumer.start(other, "renamed.key")
        queue_name = f"outboxer-test-q-{uuid.uuid4().hex[:8]}"
        to_queue = await QueueConsumer.start("", "", queue=queue_name)
        routes = {topic: f"{other}/renamed.key", queue_topic: f"/{queue_name}"}
        async with RabbitMQPublisher(URL, exchange=EXCHANGE, routes=routes) as publisher:
            first, second = make_message(topic), make_message(queue_topic)
            assert publisher.target_for(first) == (other, "renamed.key")
            assert publisher.target_for(second) == ("", queue_name)
            outcomes = await publisher.publish_batch([first, second])
        assert all(o.published for o in outcomes), outcomes
        assert [m.message_id for m in await to_other.messages(1, 5)] == [str(first.id)]
        assert [m.message_id for m in await to_queue.messages(1, 5)] == [str(second.id)]
        await to_other.close()
        await to_queue.close()
    finally:
        await delete_exchange(other)


async def test_missing_exchange_is_retryable_and_spares_the_others() -> None:
    topic, lost_topic = fresh(), fresh()
    consumer = await QueueConsumer.start(EXCHANGE, topic)
    routes = {lost_topic: f"outboxer-test-missing-{uuid.uuid4().hex[:8]}/x"}
    good = [make_message(topic, {"n": n}) for n in range(20)]
    lost = make_message(lost_topic)
    async with RabbitMQPublisher(URL, exchange=EXCHANGE, routes=routes) as publisher:
        outcomes = await publisher.publish_batch([*good[:10], lost, *good[10:]])
        assert publisher.connected
    assert outcomes[10].kind is OutcomeKind.FAILED and outcomes[10].retryable, outcomes[10]
    assert "NOT_FOUND" in (outcomes[10].error or "")
    assert all(o.published for i, o in enumerate(outcomes) if i != 10), outcomes
    expected = {str(m.id) for m in good}
    received = await consumer.ids_until(expected)
    await consumer.close()
    assert received == expected  # the missing exchange's message went nowhere


async def test_refused_messages_amid_a_large_wave() -> None:
    """Several refused messages in one pipelined wave: only they fail, the rest goes through."""
    topic = fresh()
    consumer = await QueueConsumer.start(EXCHANGE, topic)
    routes = {REJECTED_TOPIC: f"{INTERNAL_EXCHANGE}/refused"}
    batch = [make_message(topic, {"n": n}) for n in range(300)]
    bad_at = {5, 150, 299}
    for index in bad_at:
        batch[index] = make_message(REJECTED_TOPIC, {"bad": index})
    async with RabbitMQPublisher(URL, exchange=EXCHANGE, routes=routes) as publisher:
        outcomes = await publisher.publish_batch(batch)
        assert publisher.connected
        [after] = await publisher.publish_batch([make_message(topic, {"after": True})])
        assert after.published, after
    for index, outcome in enumerate(outcomes):
        if index in bad_at:
            assert outcome.kind is OutcomeKind.FAILED and not outcome.retryable, outcome
            assert "ACCESS_REFUSED" in (outcome.error or "")
        else:
            assert outcome.published, (index, outcome)
    good = {str(m.id) for i, m in enumerate(batch) if i not in bad_at}
    # A message in flight when the channel closed is sent again: at least once, never lost.
    received = await consumer.ids_until(good)
    await consumer.close()
    assert good <= received


#: Rounds of the refusal hammer below: each round's refusal races a close-ok against the
#: writes of its lane (about 30 ms a round here).
HAMMER_ROUNDS = 200


async def test_concurrent_callers_share_one_publisher() -> None:
    """Relay loops share a publisher: one connection, and a refusal only fails its message.

    Round after round, one lane's wave holds a refused message: RabbitMQ closes that lane's
    channel while its later messages are being written. A frame written on the channel
    after aiormq's close-ok makes RabbitMQ close the connection (504 CHANNEL_ERROR -
    expected 'channel.open'), failing every lane's messages and forcing a reconnect.
    """
    routes = {REJECTED_TOPIC: f"{INTERNAL_EXCHANGE}/refused"}
    publisher = RabbitMQPublisher(URL, exchange=EXCHANGE, routes=routes)
    try:
        await asyncio.gather(*(publisher.connect() for _ in range(3)))
        assert publisher._generation == 1, "concurrent connects must open one connection"
        for round_ in range(HAMMER_ROUNDS):
            # contract.* goes to the sink queue: routable, so every good message is acked.
            batches = [[make_message("contract.hammer") for _ in range(8)] for _ in range(4)]
            batches[round_ % 4][round_ % 7] = make_message(REJECTED_TOPIC, {"round": round_})
            results = await asyncio.gather(*(publisher.publish_batch(b) for b in batches))
            for batch, outcomes in zip(batches, results, strict=True):
                for message, outcome in zip(batch, outcomes, strict=True):
                    if message.topic == REJECTED_TOPIC:
                        assert outcome.kind is OutcomeKind.FAILED, (round_, outcome)
                        assert not outcome.retryable, (round_, outcome)
                    else:
                        assert outcome.published, (round_, outcome)
            assert publisher._generation == 1, f"RabbitMQ closed the connection in round {round_}"
        # Deliveries, with refusals on two lanes at once.
        topic = fresh()
        consumer = await QueueConsumer.start(EXCHANGE, topic)
        batches = [[make_message(topic, {"b": b, "n": n}) for n in range(100)] for b in range(4)]
        batches[0][50] = make_message(REJECTED_TOPIC, {"bad": 0})
        batches[2][10] = make_message(REJECTED_TOPIC, {"bad": 2})
        results = await asyncio.gather(*(publisher.publish_batch(b) for b in batches))
        assert publisher._generation == 1, "RabbitMQ closed the connection"
    finally:
        await publisher.close()
    good: set[str] = set()
    for batch, outcomes in zip(batches, results, strict=True):
        for message, outcome in zip(batch, outcomes, strict=True):
            if message.topic == REJECTED_TOPIC:
                assert outcome.kind is OutcomeKind.FAILED and not outcome.retryable, outcome
            else:
                assert outcome.published, outcome
                good.add(str(message.id))
    assert good <= await consumer.ids_until(good)
    await consumer.close()


async def test_nothing_is_written_on_a_closing_channel() -> None:
    """Between RabbitMQ's channel.close and the moment aiormq reports the channel closed,
    aiormq has already queued its close-ok: a wave must not be written then (RabbitMQ would
    close the connection for it), but fail as never written, retryably."""
    publisher = RabbitMQPublisher(URL, exchange=EXCHANGE)
    try:
        await publisher.connect()
        lane = await publisher._take_lane()
        underlay = await lane.channel.get_underlay_channel()
        refused = publisher._prepare(make_message("contract.closing"))
        # Refused by RabbitMQ (403: an internal exchange): it answers with channel.close.
        refusal = asyncio.ensure_future(
            underlay.basic_publish(
                b"x", exchange=INTERNAL_EXCHANGE, routing_key="x", properties=refused.properties
            )
        )
        # aiormq sets _close_exception as it queues its close-ok; is_closed follows later.
        deadline = time.monotonic() + 5
        while getattr(underlay, "_close_exception", None) is None:
            assert time.monotonic() < deadline, "RabbitMQ did not close the channel"
            await asyncio.sleep(0)
        assert not underlay.is_closed, "the closing window was missed"
        outcomes = await publisher._send_all(lane, [publisher._prepare(make_message("contract.x"))])
        assert isinstance(outcomes[0], aiormq.exceptions.ChannelInvalidStateError), outcomes
        with pytest.raises(aiormq.exceptions.ChannelAccessRefused):
            await refusal
        # The connection is still open: the next wave goes out on it.
        [after] = await publisher.publish_batch([make_message("contract.after")])
        assert after.published, after
        assert publisher._generation == 1, "RabbitMQ closed the connection"
    finally:
        await publisher.close()


async def test_concurrent_waves_are_in_flight_together_on_lanes_of_one_connection() -> None:
    """Callers publishing at once each get a channel of their own on the one connection."""
    topic = fresh()
    consumer = await QueueConsumer.start(EXCHANGE, topic)
    publisher = RabbitMQPublisher(URL, exchange=EXCHANGE)
    try:
        await publisher.connect()
        batches = [[make_message(topic, {"b": b, "n": n}) for n in range(50)] for b in range(3)]
        results = await asyncio.gather(*(publisher.publish_batch(b) for b in batches))
        assert all(o.published for outcomes in results for o in outcomes)
        lanes = list(publisher._idle_lanes)
        assert len({id(channel) for channel in lanes}) == 3, "three waves at once, three lanes"
        assert publisher._generation == 1, "lanes share one connection"
        # Later waves reuse the lanes rather than opening more channels.
        await asyncio.gather(*(publisher.publish_batch([make_message(topic)]) for _ in range(3)))
        assert {id(channel) for channel in publisher._idle_lanes} == {
            id(channel) for channel in lanes
        }
    finally:
        await publisher.close()
    expected = {str(m.id) for batch in batches for m in batch}
    assert expected <= await consumer.ids_until(expected)
    await consumer.close()


async def test_cut_connection_fails_retryably_and_connect_recovers() -> None:
    topic = fresh()
    consumer = await QueueConsumer.start(EXCHANGE, topic)
    proxy = await TcpProxy(HOST, PORT).start()
    publisher = RabbitMQPublisher(
        f"amqp://guest:guest@{HOST}:{proxy.port}/", exchange=EXCHANGE, publish_timeout=10.0
    )
    try:
        await publisher.connect()
        # Hold every byte first, so no confirm can come back before the cut: a wave that
        # finishes inside the sleep on a fast box made this test miss the cut (CI, stop 22).
        await proxy.blackhole()
        wave = [make_message(topic, {"n": n}) for n in range(3000)]
        task = asyncio.create_task(publisher.publish_batch(wave))
        await asyncio.sleep(0.05)
        assert not task.done(), "the wave finished with no confirm from the broker"
        await proxy.cut()
        started = time.monotonic()
        outcomes = await task
        assert time.monotonic() - started < 5, "a cut connection must fail fast, not time out"
        failed = [o for o in outcomes if o.kind is OutcomeKind.FAILED]
        assert len(failed) == len(wave), "no confirm came back, so every message failed"
        assert all(o.retryable for o in failed), failed[:3]
        assert not publisher.connected
        with pytest.raises(PublishError):
            await publisher.connect()  # still cut: refused
        await proxy.restore()
        await publisher.connect()
        message = make_message(topic, {"after": True})
        [outcome] = await publisher.publish_batch([message])
        assert outcome.published, outcome
        assert str(message.id) in await consumer.ids_until({str(message.id)})
    finally:
        await publisher.close()
        await proxy.stop()
        await consumer.close()


async def test_declare_conflict_is_a_permanent_connect_error() -> None:
    exchange = fresh("outboxer-test-c")
    await declare((exchange, {"type": "fanout", "durable": True}))
    try:
        publisher = RabbitMQPublisher(URL, exchange=exchange)  # wants a topic exchange
        with pytest.raises(PublishError) as caught:
            await publisher.connect()
        assert caught.value.retryable is False
        assert "exchange_type" in str(caught.value)
        await publisher.close()
        async with RabbitMQPublisher(URL, exchange=exchange, declare_exchange=False) as publisher:
            assert publisher.connected
    finally:
        await delete_exchange(exchange)


@pytest.mark.parametrize("field", ["routing key", "content type", "header name"])
async def test_overlong_short_strings_are_permanent(field: str) -> None:
    """AMQP short strings hold 255 bytes: refused before anything is sent, the rest goes on."""
    topic, long = fresh(), "é" * 200  # 200 characters, 400 bytes
    consumer = await QueueConsumer.start(EXCHANGE, topic)
    bad = Message(
        id=uuid.uuid4(),
        topic=long if field == "routing key" else topic,
        payload=b"x",
        content_type=long if field == "content type" else "text/plain",
        headers={long: "v"} if field == "header name" else {},
    )
    good = make_message(topic)
    async with RabbitMQPublisher(URL, exchange=EXCHANGE) as publisher:
        outcomes = await publisher.publish_batch([bad, good])
    assert outcomes[0].kind is OutcomeKind.FAILED and not outcomes[0].retryable, outcomes[0]
    assert field in (outcomes[0].error or "")
    assert outcomes[1].published, outcomes[1]
    assert await consumer.ids_until({str(good.id)}) == {str(good.id)}
    await consumer.close()


def test_options_from_url_and_keywords() -> None:
    publisher = RabbitMQPublisher(
        "amqps://u:p@host:5671/vh?exchange=events&declare_exchange=no&persistent=0"
        "&mandatory=off&connect_timeout=2.5&heartbeat=15",
        exchange_type="fanout",
    )
    assert publisher.exchange == "events"
    assert publisher.exchange_type == "fanout"
    assert (publisher.declare_exchange, publisher.persistent, publisher.mandatory) == (
        False,
        False,
        False,
    )
    assert publisher.connect_timeout == 2.5
    assert publisher._driver_url == "amqps://u:p@host:5671/vh?heartbeat=15"
    assert RabbitMQPublisher(f"{URL}?exchange=a", exchange="b").exchange == "b"
    assert RabbitMQPublisher(f"{URL}?exchange=").exchange == ""
    defaults = RabbitMQPublisher(URL)
    assert (
        defaults.exchange,
        defaults.exchange_type,
        defaults.declare_exchange,
        defaults.persistent,
        defaults.mandatory,
    ) == ("outboxer", "topic", True, True, True)


@pytest.mark.parametrize(
    "query",
    [
        "declare_exchange=maybe",
        "persistent=2",
        "connect_timeout=soon",
        "connect_timeout=0",
        "exchange_type=x-unknown",
    ],
)
def test_invalid_options_raise_config_error(query: str) -> None:
    with pytest.raises(ConfigError):
        RabbitMQPublisher(f"{URL}?{query}")


async def test_unreachable_connect_is_bounded() -> None:
    publisher = RabbitMQPublisher(f"amqp://guest:guest@{HOST}:1/", connect_timeout=2.0)
    started = time.monotonic()
    with pytest.raises(PublishError) as caught:
        await publisher.connect()
    assert caught.value.retryable
    assert time.monotonic() - started < 5
    await publisher.close()


async def test_a_wave_goes_out_whole_in_order_with_large_bodies_split(
    monkeypatch: pytest.MonkeyPatch, write_path: str
) -> None:
    """The wave path writes frames itself: the messages arrive intact and in order, a body
    over RabbitMQ's frame size (128 KiB) split into body frames, and aiormq's basic_publish
    is not called for any of them (if a newer aiormq lacked the channel state the wave path
    writes through, this would show the fallback was taken)."""
    calls = count_basic_publish_calls(monkeypatch)
    topic = fresh()
    consumer = await QueueConsumer.start(EXCHANGE, topic)
    batch = [make_message(topic, {"n": n}) for n in range(60)]
    big = bytes(range(256)) * 1500  # 384,000 bytes: three body frames
    batch[30] = Message(
        id=batch[30].id, topic=topic, payload=big, key="k", content_type="application/octet-stream"
    )
    batch[31] = Message(id=batch[31].id, topic=topic, payload=b"", key="k")
    try:
        async with RabbitMQPublisher(URL, exchange=EXCHANGE) as publisher:
            outcomes = await publisher.publish_batch(batch)
            assert all(outcome.published for outcome in outcomes), outcomes
        received = await consumer.receive(len(batch))
    finally:
        await consumer.close()
    # The empty-bodied message reaches this consumer out of its turn on both write paths
    # (aiormq's own basic_publish too), so its place is not checked.
    by_id = {r.id: r for r in received}
    assert by_id[str(batch[31].id)].payload == b""
    assert [r.id for r in received if r.payload] == [str(m.id) for m in batch if m.payload]
    assert by_id[str(batch[30].id)].payload == big
    assert calls[0] == (0 if write_path == "waves" else len(batch))


async def test_an_exchange_name_amqp_cannot_carry_fails_only_its_message() -> None:
    topic = fresh()
    consumer = await QueueConsumer.start(EXCHANGE, topic)
    routes = {"bad.route": "no spaces allowed!/k"}
    batch = [
        make_message(topic, {"n": 0}),
        make_message("bad.route", {}),
        make_message(topic, {"n": 2}),
    ]
    try:
        async with RabbitMQPublisher(URL, exchange=EXCHANGE, routes=routes) as publisher:
            first, bad, last = await publisher.publish_batch(batch)
        received = await consumer.receive(2)
    finally:
        await consumer.close()
    assert first.published and last.published
    assert bad.kind is OutcomeKind.FAILED and not bad.retryable
    assert "no spaces allowed!" in (bad.error or "")
    assert [r.id for r in received] == [str(batch[0].id), str(batch[2].id)]


async def test_falling_back_to_one_message_at_a_time_warns_once_saying_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An aiormq outside the releases the wave writes were verified with gets the
    one-at-a-time path, and the publisher says so once, with the reason."""
    monkeypatch.setattr(RabbitMQPublisher, "_wave_writes", True)
    monkeypatch.setattr(rabbitmq, "WAVE_AIORMQ_RANGE", ((99, 0, 0), (100, 0, 0)))
    calls = count_basic_publish_calls(monkeypatch)
    caplog.set_level("WARNING", logger="outboxer.publisher.rabbitmq")
    async with RabbitMQPublisher(URL, exchange=EXCHANGE) as publisher:
        for _ in range(3):
            outcomes = await publisher.publish_batch([make_message("contract.x") for _ in range(4)])
            assert all(outcome.published for outcome in outcomes), outcomes
    assert calls[0] == 12, "each message goes out through basic_publish"
    warnings = [r.getMessage() for r in caplog.records if r.name == "outboxer.publisher.rabbitmq"]
    assert len(warnings) == 1, warnings
    assert "one message at a time" in warnings[0]
    assert f"aiormq {importlib.metadata.version('aiormq')} is outside" in warnings[0]
    assert ">=99.0.0,<100.0.0" in warnings[0]
