"""The WAL slot alert (OutboxerWalSlotNearInvalidation) reads metrics the stream relay
exports, and its promtool unit tests catch a wrong threshold."""

from __future__ import annotations

import pathlib
import re
from dataclasses import dataclass, field

import yaml

from outboxer.metrics import Metrics
from outboxer.stores.pgstream import Backlog
from outboxer.stream_api import StreamCollector
from outboxer.streamrelay import StreamStats
from tests.unit.test_alert_rules import RULE_TESTS, RULES, run_promtool

ALERT = "OutboxerWalSlotNearInvalidation"


@dataclass
class _StreamRelay:
    """What StreamCollector reads of a WAL stream relay whose last probe saw a slot with
    a limit (max_slot_wal_keep_size)."""

    stats: StreamStats = field(default_factory=StreamStats)
    destination: str = "default"
    mode: str = "wal"
    failing: int = 0

    def health_problems(self) -> list[str]:
        return []


def stream_exported() -> set[str]:
    relay = _StreamRelay()
    relay.stats.backlog = Backlog(
        0,
        wal_retained_bytes=1,
        wal_behind_bytes=1,
        wal_status="unreserved",
        wal_safe_bytes=-1,
        wal_keep_limit_bytes=1024,
    )
    metrics = Metrics(store_gauges=False)
    metrics.registry.register(StreamCollector(relay))  # type: ignore[arg-type]
    body, _ = metrics.render()
    return set(re.findall(r"^([a-z_]+)[{ ]", body.decode(), re.MULTILINE))


def _rule() -> dict[str, object]:
    [rule] = [
        rule
        for group in yaml.safe_load(RULES.read_text())["groups"]
        for rule in group["rules"]
        if rule.get("alert") == ALERT
    ]
    return rule


def test_the_wal_slot_alert_reads_only_what_the_stream_relay_exports() -> None:
    used = set(re.findall(r"\b(outboxer_[a-z_]+)\b", str(_rule()["expr"])))
    assert {"outboxer_stream_wal_safe_bytes", "outboxer_stream_wal_status"} <= used
    assert used <= stream_exported(), used - stream_exported()


def test_its_unit_tests_fail_when_the_threshold_is_wrong(tmp_path: pathlib.Path) -> None:
    assert run_promtool("test", "rules", str(RULE_TESTS)).returncode == 0
    (tmp_path / RULES.name).write_text(
        RULES.read_text().replace(
            "< 0.1 * outboxer_stream_wal_keep_limit_bytes",
            "< 0.01 * outboxer_stream_wal_keep_limit_bytes",
        )
    )
    (tmp_path / RULE_TESTS.name).write_text(RULE_TESTS.read_text())
    result = run_promtool("test", "rules", str(tmp_path / RULE_TESTS.name))
    assert result.returncode != 0
    assert ALERT in result.stdout + result.stderr
