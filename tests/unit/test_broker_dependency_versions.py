"""The drivers whose internals the RabbitMQ and MQTT publishers use are pinned to the
ranges they were tested with, and the installed ones are inside those ranges."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
#: Extra -> the distributions of it whose internals (not only their public API) are used.
INTERNALS = {"rabbitmq": ("aio-pika", "aiormq", "pamqp"), "mqtt": ("aiomqtt", "paho-mqtt")}
PINNED = [(extra, name) for extra, names in INTERNALS.items() for name in names]


def declared(extra: str) -> dict[str, Requirement]:
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    return {Requirement(text).name: Requirement(text) for text in extras[extra]}


@pytest.mark.parametrize(("extra", "name"), PINNED)
def test_pinned_with_a_lower_and_an_upper_bound(extra: str, name: str) -> None:
    requirement = declared(extra).get(name)
    assert requirement is not None, f"outboxer[{extra}] must declare {name}"
    operators = {spec.operator for spec in requirement.specifier}
    assert ">=" in operators and "<" in operators, f"{requirement}: needs >= and < bounds"
    assert str(declared("all")[name]) == str(requirement), f"outboxer[all] must pin {requirement}"


@pytest.mark.parametrize(("extra", "name"), PINNED)
def test_installed_version_is_in_the_tested_range(extra: str, name: str) -> None:
    requirement = declared(extra)[name]
    installed = importlib.metadata.version(name)
    assert requirement.specifier.contains(installed, prereleases=True), (
        f"{name} {installed} is installed, but outboxer[{extra}] was tested with "
        f"{requirement}: the publisher uses {name}'s internals, so run the broker tests "
        f"against {name} {installed} and widen the range in pyproject.toml only if they pass"
    )


def test_the_rabbitmq_wave_writes_are_verified_for_the_pinned_aiormq() -> None:
    pytest.importorskip("aio_pika")
    from outboxer.brokers.rabbitmq import WAVE_AIORMQ_RANGE

    bounds = {
        spec.operator: Version(spec.version) for spec in declared("rabbitmq")["aiormq"].specifier
    }
    low, high = (Version(".".join(map(str, release))) for release in WAVE_AIORMQ_RANGE)
    assert bounds == {">=": low, "<": high}


def test_the_rabbitmq_internals_read_for_alarms_and_hostile_frames_exist() -> None:
    """The publisher waits on aiormq's own connection.unblocked event, the receiver takes
    aiormq's consumer-cancel callbacks and lets pamqp's decoders fall back on bytes that are
    not UTF-8 (brokers/rabbitmq.py, receivers/rabbitmq.py): present in every pinned release
    (the lowest-driver run checks the lowest)."""
    pytest.importorskip("aio_pika")
    import inspect

    import aiormq
    import pamqp.decode

    # Read from the source: making a Connection needs a running event loop.
    assert "self.__connection_unblocked: asyncio.Event" in inspect.getsource(
        aiormq.Connection.__init__
    )
    assert "on_consumer_cancel_callbacks" in inspect.getsource(aiormq.Channel.__init__)
    assert callable(pamqp.decode.METHODS["shortstr"]) and callable(pamqp.decode.METHODS["table"])
    assert callable(pamqp.decode.TABLE_MAPPING[b"F"]) and callable(pamqp.decode.embedded_value)
