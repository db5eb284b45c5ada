"""The Publisher base class's own behaviour, on the in-process memory broker."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from outboxer import OutcomeKind, PublishError, create_publisher
from outboxer.brokers.base import waves
from outboxer.brokers.memory import memory_broker
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
