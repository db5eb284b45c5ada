"""``outboxer consume`` takes the claim-check read timeout from its settings
(``claim_check_read_timeout``, ``OUTBOXER_CLAIM_CHECK_READ_TIMEOUT``): the consumer's
``object_store_timeout`` was a library argument only, 30 s whatever the deployment said."""

from __future__ import annotations

from pathlib import Path

import pytest

from outboxer.consume_cli import build_consumer, load_consume_settings
from outboxer.errors import ConfigError


def test_the_consume_command_passes_its_claim_check_read_timeout(tmp_path: Path) -> None:
    store = tmp_path / "claims"
    store.mkdir()
    environ = {
        "OUTBOXER_CLAIM_CHECK_STORE": store.as_uri(),
        "OUTBOXER_CLAIM_CHECK_READ_TIMEOUT": "2.5s",
    }
    settings, own = load_consume_settings(
        {"db": f"sqlite:///{tmp_path / 'x.db'}", "broker": "memory://ccread"},
        {"group": "g", "handler": "json:dumps"},
        environ=environ,
    )
    consumer = build_consumer(settings, own)
    assert consumer.object_store is not None
    assert consumer.object_store_timeout == 2.5
    settings, own = load_consume_settings(
        {"db": f"sqlite:///{tmp_path / 'x.db'}", "broker": "memory://ccread"},
        {"group": "g", "handler": "json:dumps"},
        environ={"OUTBOXER_CLAIM_CHECK_STORE": store.as_uri()},
    )
    assert build_consumer(settings, own).object_store_timeout == 30.0


@pytest.mark.parametrize("value", ["0", "-1s", "abc"])
def test_a_claim_check_read_timeout_that_is_no_positive_duration_is_refused(value: str) -> None:
    with pytest.raises(ConfigError, match="OUTBOXER_CLAIM_CHECK_READ_TIMEOUT"):
        load_consume_settings(
            {}, {"group": "g"}, environ={"OUTBOXER_CLAIM_CHECK_READ_TIMEOUT": value}
        )
