"""examples/orders end to end: orders placed over HTTP with their domain events, the relay
killed with SIGKILL while it works and started again, every order shipped exactly once."""

from __future__ import annotations

import pathlib
import uuid

import pytest

from examples.orders.run import Example
from tests.services import require


@pytest.mark.timeout(240)
def test_every_order_ships_exactly_once_although_the_relay_is_killed(
    tmp_path: pathlib.Path,
) -> None:
    require("postgresql")
    require("rabbitmq")
    example = Example(orders=30, name=f"orders_t_{uuid.uuid4().hex[:10]}", logs=tmp_path)
    try:
        report = example.run()
    finally:
        example.drop_databases()
    assert report.relay_kills == 1
    assert len(report.placed) == 30
    assert report.exactly_once, f"{report.summary()}\nlogs: {tmp_path}"
    # The copies the restarted relay sent again are the inbox's to skip: never more of them
    # than it took over (RabbitMQ itself redelivers nothing here: every ack reached it).
    assert report.skipped_copies <= report.taken_over
