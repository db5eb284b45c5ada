"""A NATS consumer's ``durable`` option, checked when the consumer is built, on the real
NATS JetStream.

nats-py refuses a consumer name holding ``.``, ``*``, ``>``, ``/``, ``\\`` or white space
with a ValueError inside ``connect``: before, the consumer took that for a broker outage
and retried for ever ("cannot consume from nats://…; retrying"), a typo in the settings
file never reported as one.
"""

from __future__ import annotations

import uuid

import pytest

from outboxer.errors import BrokerUnavailableError, ConfigError
from outboxer.receivers import create_receiver
from tests.services import require

NATS = "nats://127.0.0.1:4222"


@pytest.mark.parametrize("durable", ["orders.eu", "orders eu", "orders>", "a/b"])
def test_a_durable_name_nats_refuses_is_a_configuration_error(durable: str) -> None:
    with pytest.raises(ConfigError, match="nats option durable"):
        create_receiver(NATS, group="g", topics=["t"], durable=durable)


async def test_a_valid_durable_name_still_connects() -> None:
    require("nats")
    import nats

    tag = uuid.uuid4().hex[:8]
    url = f"{NATS}?stream=S{tag}&create_stream=true&subjects=t{tag}.>"
    receiver = create_receiver(url, group="g", topics=[f"t{tag}.x"], durable=f"orders-eu_{tag}")
    try:
        await receiver.connect()
    except BrokerUnavailableError as exc:  # what an invalid name used to raise
        pytest.fail(str(exc))
    finally:
        await receiver.close()
        nc = await nats.connect(NATS)
        await nc.jetstream().delete_stream(f"S{tag}")
        await nc.close()
