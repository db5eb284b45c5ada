"""inbox_retention has a floor of an hour. 0 (or a few seconds) was taken: the cleanup then
deleted the inbox entries of messages just applied, and the redelivery the inbox exists for
(a crash between COMMIT and the ack, redelivered after ack_wait or claim_idle) was applied
a second time."""

from __future__ import annotations

import pytest

from outboxer.config import load_settings
from outboxer.errors import ConfigError


@pytest.mark.parametrize("value", ["0", "10s", "59m"])
def test_an_inbox_retention_under_an_hour_is_refused(value: str) -> None:
    with pytest.raises(ConfigError, match="inbox-retention must be at least 1h"):
        load_settings({"inbox_retention": value}, environ={})


def test_an_hour_and_more_is_taken() -> None:
    assert load_settings({"inbox_retention": "1h"}, environ={}).inbox_retention == 3600.0
    assert load_settings({}, environ={}).inbox_retention == 30 * 86400.0
    # The other retentions keep 0 (delete finished rows at the next run).
    assert load_settings({"published_retention": "0"}, environ={}).published_retention == 0.0
