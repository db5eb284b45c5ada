"""NatsPublisher against the real NATS JetStream on 127.0.0.1:4222: the contract plus NATS specifics."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import nats
import nats.errors
import nats.js.errors
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy

from outboxer.brokers import create_publisher
from outboxer.brokers.base import OutcomeKind, Publisher
from outboxer.brokers.nats import MSG_ID_HEADER, NatsPublisher, api_error
from outboxer.errors import ConfigError
from outboxer.message import HEADER_ID, HEADER_KEY, HEADER_TOPIC, Message
from outboxer.testing import Consumer, PublisherContract, Received, TcpProxy, make_message
from tests.services import PORTS, require, start, stop

URL = "nats://127.0.0.1:4222"
TAG = uuid.uuid4().hex[:8]
STREAM = f"OUTBOXER_TEST_{TAG}"
PREFIX = f"t{TAG}."


async def with_js(action: Callable[[JetStreamContext], Awaitable[Any]]) -> Any:
    nc = await nats.connect(URL)
    try:
        return await action(nc.jetstream())
    finally:
        await nc.close()


async def drop_stream(js: JetStreamContext, name: str) -> None:
    with contextlib.suppress(nats.js.errors.NotFoundError):
        await js.delete_stream(name)


@pytest.fixture(scope="module", autouse=True)
def _stream() -> Iterator[None]:
    require("nats")
    asyncio.run(
        with_js(
            lambda js: js.add_stream(name=STREAM, subjects=[f"{PREFIX}>"], duplicate_window=120)
        )
    )
    yield
    asyncio.run(with_js(lambda js: drop_stream(js, STREAM)))


class StreamConsumer(Consumer):
    """An ordered consumer on one subject of the test stream: what arrives after it started."""

    def __init__(self, subject: str) -> None:
        self.subject = subject
        self.nc: Any = None
        self.sub: Any = None

    async def start(self) -> StreamConsumer:
        self.nc = await nats.connect(URL)
        self.sub = await self.nc.jetstream().subscribe(
            self.subject, stream=STREAM, ordered_consumer=True, deliver_policy=DeliverPolicy.NEW
        )
        return self

    async def messages(self, count: int, wait: float) -> list[Any]:
        found: list[Any] = []
        deadline = time.monotonic() + wait
        while len(found) < count:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                found.append(await self.sub.next_msg(timeout=remaining))
            except nats.errors.TimeoutError:
                break
        return found

    async def receive(self, count: int, timeout: float = 10.0) -> list[Received]:
        return [
            Received(
                id=msg.headers[HEADER_ID],
                topic=msg.headers[HEADER_TOPIC],
                key=msg.headers.get(HEADER_KEY),
                headers=dict(msg.headers),
                payload=msg.data,
            )
            for msg in await self.messages(count, timeout)
        ]

    async def close(self) -> None:
        if self.nc is not None:
            await self.nc.close()


def nats_pid() -> int | None:
    found = subprocess.run(
        ["pgrep", "-x", "nats-server"], capture_output=True, text=True
    ).stdout.split()
    return int(found[0]) if found else None


def stop_nats() -> None:
    stop(nats_pid(), PORTS["nats"])


class TestNatsPublisherContract(PublisherContract):
    def make_publisher(self) -> Publisher:
        return NatsPublisher(f"{URL}?subject_prefix={PREFIX}&stream={STREAM}")

    def make_unreachable_publisher(self) -> Publisher:
        return NatsPublisher("nats://127.0.0.1:1")

    async def start_consumer(self, topic: str) -> Consumer:
        return await StreamConsumer(PREFIX + topic).start()

    def rejected_message(self, topic: str) -> Message:
        return make_message(topic, b"x" * (1024 * 1024 + 1))  # above the default max_payload

    async def restart_server(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(None, stop_nats)
        finally:
            await loop.run_in_executor(None, start, "nats")
        deadline = time.monotonic() + 30
        while True:  # the port answers before JetStream has recovered its streams
            try:
                await with_js(lambda js: js.stream_info(STREAM))
                return
            except (nats.errors.Error, OSError):
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)


# ----- NATS specifics --------------------------------------------------------------------------


async def test_same_message_twice_is_stored_once() -> None:
    topic = f"dup.{uuid.uuid4().hex[:8]}"
    consumer = await StreamConsumer(PREFIX + topic).start()
    message = make_message(topic, {"n": 1}, key="k")
    async with NatsPublisher(URL, subject_prefix=PREFIX, stream=STREAM) as publisher:
        first = await publisher.publish_batch([message])
        again = await publisher.publish_batch([message])  # a relay's re-publish after a crash
    assert first[0].published and again[0].published
    got = await consumer.messages(2, 2.0)
    await consumer.close()
    assert len(got) == 1
    assert got[0].headers[MSG_ID_HEADER] == str(message.id)
    info = await with_js(lambda js: js.stream_info(STREAM, subjects_filter=PREFIX + topic))
    assert info.state.subjects == {PREFIX + topic: 1}


async def test_headers_carry_the_envelope() -> None:
    topic = f"hdr.{uuid.uuid4().hex[:8]}"
    consumer = await StreamConsumer(PREFIX + topic).start()
    message = make_message(topic, "text", key="order-1", headers={"trace": "t-9"})
    async with NatsPublisher(URL, subject_prefix=PREFIX) as publisher:
        assert (await publisher.publish_batch([message]))[0].published
    [got] = await consumer.messages(1, 5)
    await consumer.close()
    assert got.subject == PREFIX + topic
    assert got.data == b"text"
    assert got.headers == {
        MSG_ID_HEADER: str(message.id),
        HEADER_ID: str(message.id),
        HEADER_TOPIC: topic,
        HEADER_KEY: "order-1",
        "content-type": "text/plain; charset=utf-8",
        "trace": "t-9",
    }


async def test_subject_without_stream_fails_retryably() -> None:
    message = make_message(f"nostream.{uuid.uuid4().hex[:8]}")
    async with NatsPublisher(URL) as publisher:
        [outcome] = await publisher.publish_batch([message])
        assert publisher.connected
    assert outcome.kind is OutcomeKind.FAILED and outcome.retryable
    assert "no JetStream stream" in (outcome.error or "")


@pytest.fixture(params=["raises", "returns"])
def from_error(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """nats-py's ``APIError.from_error`` raises the typed error in some releases (2.16 here)
    and returns it in others: the refusal tests run with both."""
    if request.param == "returns":
        raising = nats.js.errors.APIError.from_error.__func__  # type: ignore[attr-defined]

        def returning(cls: type[nats.js.errors.APIError], err: dict[str, Any]) -> Any:
            try:
                raising(cls, err)
            except nats.js.errors.APIError as exc:
                return exc
            raise AssertionError("from_error was expected to raise")

        monkeypatch.setattr(nats.js.errors.APIError, "from_error", classmethod(returning))
    return str(request.param)


@pytest.mark.usefixtures("from_error")
async def test_stream_refusal_is_permanent_and_headers_count_towards_max_payload() -> None:
    name = f"OUTBOXER_SMALL_{uuid.uuid4().hex[:8]}"
    prefix = f"s{uuid.uuid4().hex[:8]}."
    await with_js(lambda js: js.add_stream(name=name, subjects=[f"{prefix}>"], max_msg_size=1000))
    try:
        async with NatsPublisher(URL, subject_prefix=prefix) as publisher:
            limit = publisher._nc.max_payload
            outcomes = await publisher.publish_batch(
                [
                    make_message("a", b"y" * 2000),  # the stream's max_msg_size
                    make_message("a", b"z" * (limit - 20)),  # fits alone, not with its headers
                    make_message("a", b"small"),
                ]
            )
    finally:
        await with_js(lambda js: drop_stream(js, name))
    assert outcomes[0].kind is OutcomeKind.FAILED and not outcomes[0].retryable
    assert "10054" in (outcomes[0].error or "")
    assert outcomes[1].kind is OutcomeKind.FAILED and not outcomes[1].retryable
    assert "max_payload" in (outcomes[1].error or "")
    assert outcomes[2].published


@pytest.mark.usefixtures("from_error")
async def test_expected_stream_mismatch_is_permanent() -> None:
    async with NatsPublisher(URL, subject_prefix=PREFIX, stream="SOME_OTHER_STREAM") as publisher:
        [outcome] = await publisher.publish_batch([make_message("x")])
    assert outcome.kind is OutcomeKind.FAILED and not outcome.retryable, outcome
    assert "JetStream refused" in (outcome.error or "") and "10060" in (outcome.error or "")


@pytest.mark.parametrize(
    ("error", "kind", "code"),
    [
        (
            {"code": 400, "err_code": 10060, "description": "expected stream does not match"},
            nats.js.errors.BadRequestError,
            400,
        ),
        ({"code": 503, "description": "unavailable"}, nats.js.errors.ServiceUnavailableError, 503),
        (
            {"code": 409, "err_code": 1, "description": "x", "a_future_field": 1},
            nats.js.errors.APIError,
            409,
        ),
        ({"description": "no code"}, nats.js.errors.APIError, None),
        ("not an object", nats.js.errors.APIError, None),
    ],
)
@pytest.mark.usefixtures("from_error")
def test_jetstream_errors_become_typed_errors(error: object, kind: type, code: int | None) -> None:
    made = api_error(error)
    assert type(made) is kind and made.code == code, made


async def test_invalid_subject_or_header_name_is_refused_before_sending() -> None:
    topic = f"ok.{uuid.uuid4().hex[:8]}"
    async with NatsPublisher(URL, subject_prefix=PREFIX, stream=STREAM) as publisher:
        outcomes = await publisher.publish_batch(
            [
                make_message("with space"),
                make_message(topic, headers={"bad name": "x"}),
                make_message(topic, headers={"good-name": "x"}),
            ]
        )
        assert publisher._replies == {}
    assert (outcomes[0].kind, outcomes[0].retryable) == (OutcomeKind.FAILED, False)
    # A header name NATS cannot carry travels escaped (Outboxer-Header-bad%20name).
    assert outcomes[1].published and outcomes[2].published


async def test_create_stream_when_missing() -> None:
    name = f"OUTBOXER_NEW_{uuid.uuid4().hex[:8]}"
    prefix = f"n{uuid.uuid4().hex[:8]}."
    url = f"{URL}?subject_prefix={prefix}&stream={name}&create_stream=true&duplicate_window=30"
    try:
        async with create_publisher(url) as publisher:
            assert (await publisher.publish_batch([make_message("orders")]))[0].published
        async with create_publisher(url) as publisher:  # exists now: left as it is
            assert (await publisher.publish_batch([make_message("orders")]))[0].published
        info = await with_js(lambda js: js.stream_info(name))
        assert info.config.subjects == [f"{prefix}>"]
        assert info.config.duplicate_window == 30
        assert info.state.messages == 2
    finally:
        await with_js(lambda js: drop_stream(js, name))


async def test_wave_is_published_concurrently(monkeypatch: pytest.MonkeyPatch) -> None:
    in_flight = peak = 0
    send, answer = Client.publish, NatsPublisher._on_reply

    async def sending(self: Client, subject: str, *args: Any, **kwargs: Any) -> None:
        nonlocal in_flight, peak
        if subject.startswith(PREFIX):
            in_flight += 1
            peak = max(peak, in_flight)
        await send(self, subject, *args, **kwargs)

    async def answered(self: NatsPublisher, msg: Any) -> None:
        nonlocal in_flight
        in_flight -= 1
        await answer(self, msg)

    monkeypatch.setattr(Client, "publish", sending)
    monkeypatch.setattr(NatsPublisher, "_on_reply", answered)
    topic = f"conc.{uuid.uuid4().hex[:8]}"
    batch = [make_message(topic, {"n": n}, key=f"k{n % 100}") for n in range(300)]
    async with NatsPublisher(URL, subject_prefix=PREFIX, stream=STREAM) as publisher:
        outcomes = await publisher.publish_batch(batch)
    assert all(o.published for o in outcomes)
    assert in_flight == 0
    assert peak == 100  # one wave = the 100 keys, all sent before the first PubAck is handled


async def test_connection_lost_mid_wave_fails_fast() -> None:
    subject = f"silent.{uuid.uuid4().hex[:8]}"
    listener = await nats.connect(URL)
    await listener.subscribe(subject)  # takes the publish, never acknowledges it
    proxy = await TcpProxy("127.0.0.1", 4222).start()
    publisher = NatsPublisher(f"nats://127.0.0.1:{proxy.port}", publish_timeout=30)
    try:
        await publisher.connect()

        async def cut_later() -> float:
            await asyncio.sleep(0.5)
            await proxy.cut()
            return time.monotonic()

        outcomes, cut_at = await asyncio.wait_for(
            asyncio.gather(
                publisher.publish_batch([make_message(subject) for _ in range(5)]), cut_later()
            ),
            10,
        )
        assert time.monotonic() - cut_at < 5
        assert all(o.kind is OutcomeKind.FAILED and o.retryable for o in outcomes), outcomes
        assert not publisher.connected
        await proxy.restore()
        await publisher.connect()
        assert publisher.connected
    finally:
        await publisher.close()
        await proxy.stop()
        await listener.close()


def test_options() -> None:
    publisher = NatsPublisher(
        "nats://u:p@a:4222,b:4223?subject_prefix=app.&stream=APP"
        "&create_stream=yes&duplicate_window=300"
    )
    assert publisher.servers == ["nats://u:p@a:4222", "nats://b:4223"]
    assert (publisher.subject_prefix, publisher.stream, publisher.create_stream) == (
        "app.",
        "APP",
        True,
    )
    assert publisher.subjects == ["app.>"] and publisher.duplicate_window == 300
    assert publisher.subject_for(make_message("orders")) == "app.orders"
    keyword = NatsPublisher(
        f"{URL}?stream=APP&create_stream=true&subjects=a.*,b.>",
        create_stream=False,
        duplicate_window=5,
    )
    assert keyword.subjects == ["a.*", "b.>"] and not keyword.create_stream
    assert keyword.duplicate_window == 5
    assert NatsPublisher(URL).stream is None
    with pytest.raises(ConfigError, match="subjects"):
        NatsPublisher(f"{URL}?stream=APP&create_stream=true")
    with pytest.raises(ConfigError, match="stream name"):
        NatsPublisher(f"{URL}?subject_prefix=x.&create_stream=true")
    with pytest.raises(ConfigError, match="create_stream"):
        NatsPublisher(f"{URL}?create_stream=maybe")
    # The settings' duration syntax, as every duration option.
    assert NatsPublisher(f"{URL}?duplicate_window=2m").duplicate_window == 120
    with pytest.raises(ConfigError, match="duplicate_window"):
        NatsPublisher(f"{URL}?duplicate_window=2 fortnights")
