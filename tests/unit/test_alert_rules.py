"""deploy/prometheus/outboxer-alerts.yml: valid for promtool, its unit tests pass, and every
metric it reads is one outboxer exports."""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import yaml  # PyYAML, which mkdocs brings

from outboxer.metrics import Metrics
from outboxer.relay import RelayStats
from outboxer.stores import DestinationStatus
from tests.services import IN_CI

RULES_DIR = pathlib.Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
RULES = RULES_DIR / "outboxer-alerts.yml"
RULE_TESTS = RULES_DIR / "outboxer-alerts.test.yml"
INSTALLER = RULES_DIR.parents[1] / "scripts" / "promtool"

# The first test may install promtool (apt-get) under CI.
pytestmark = pytest.mark.timeout(900)


def promtool() -> str:
    """promtool's path. Missing, it is installed under CI (``scripts/promtool``, Debian's
    prometheus package) and the test is skipped locally with that command."""
    path = shutil.which("promtool")
    if path is None and IN_CI:
        subprocess.run([str(INSTALLER), "--version"], check=True, timeout=900)
        path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is not installed: scripts/promtool --version installs it")
    return path


def run_promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool(), *args], capture_output=True, text=True, timeout=60, check=False
    )


def test_promtool_accepts_the_rules() -> None:
    result = run_promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 12 rules found" in result.stdout


def test_the_alerts_unit_tests_pass() -> None:
    result = run_promtool("test", "rules", str(RULE_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_promtool_test_rules_fails_when_an_alert_does_not_fire_as_tested(
    tmp_path: pathlib.Path,
) -> None:
    # The unit tests can fail: raising the lag threshold breaks the lag alert's test.
    (tmp_path / RULES.name).write_text(
        RULES.read_text().replace("outboxer_oldest_pending_age_seconds) > 300", "> 3000)")
    )
    (tmp_path / RULE_TESTS.name).write_text(RULE_TESTS.read_text())
    result = run_promtool("test", "rules", str(tmp_path / RULE_TESTS.name))
    assert result.returncode != 0
    assert "OutboxerLagHigh" in result.stdout + result.stderr


@dataclass
class _Relay:
    stats: RelayStats = field(default_factory=RelayStats)
    destination_stats: dict[str, RelayStats] = field(
        default_factory=lambda: {"default": RelayStats()}
    )

    def health_problems(self) -> list[str]:
        return []


def test_every_metric_the_rules_read_is_exported() -> None:
    metrics = Metrics(["default"])
    metrics.watch_relay(_Relay())
    metrics.observe_store_status([DestinationStatus("default", {}, None)])
    body, _ = metrics.render()
    exported = set(re.findall(r"^([a-z_]+)[{ ]", body.decode(), re.MULTILINE))
    # The stream relay's own metrics (OutboxerWalSlotNearInvalidation).
    from tests.unit.test_audit10_walwarn_alert import stream_exported

    exported |= stream_exported()
    exported |= consumer_exported()
    expressions = [
        rule["expr"]
        for group in yaml.safe_load(RULES.read_text())["groups"]
        for rule in group["rules"]
    ]
    used = {name for expr in expressions for name in re.findall(r"\b(outboxer_[a-z_]+)\b", expr)}
    assert used  # the pattern finds them
    assert used <= exported, used - exported


def consumer_exported() -> set[str]:
    """The series names ``outboxer consume --http`` exports (ConsumerCollector)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from outboxer.consumer import ConsumerCollector, ConsumerStats, LatencyHistogram

    consumer = SimpleNamespace(
        group="g",
        stats=ConsumerStats(),
        _receiver=None,
        in_flight=0,
        lag=7,
        delivery_latency=LatencyHistogram(),
    )
    registry = CollectorRegistry()
    registry.register(ConsumerCollector([consumer]))  # type: ignore[list-item]
    body = generate_latest(registry).decode()
    return set(re.findall(r"^([a-z_]+)[{ ]", body, re.MULTILINE))
