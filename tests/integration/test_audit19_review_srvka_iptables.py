"""The fault-injection helper ``vanished`` never leaves its DROP rule behind, and never hides
the failure of the block it wraps.

A rule left behind drops the packets of whatever loopback connection reuses that client port
to the server next (the ephemeral range is reused within minutes): some later test, or
anything else on the host, hangs for no visible reason. cd9d7f5's helper inserted the rule
before its ``try``: Ctrl-C while iptables ran (the rule in, ``subprocess.run`` interrupted)
left it. And its removal, ``check=True`` in the ``finally``, raised CalledProcessError when
the rule was already gone, which replaced the block's own assertion in the report.

Port 9 to port 9 (discard): no connection of this host's uses that pair.
"""

from __future__ import annotations

import subprocess
from typing import Any

import pytest

from tests.integration.test_audit19_serverkeepalive_consumer import require_iptables, vanished

PORT = 9


def _our_rules(iptables: str) -> list[str]:
    listed = subprocess.run(
        [iptables, "-w", "5", "-S", "INPUT"], check=True, capture_output=True, text=True
    ).stdout
    return [
        line
        for line in listed.splitlines()
        if f"--sport {PORT} --dport {PORT}" in line and "outboxer-test-" in line
    ]


def _remove(iptables: str, line: str) -> None:
    spec = line.split()
    assert spec[0] == "-A", line
    # The comment is quoted in -S's listing; its words carry no blanks.
    spec = [word.strip('"') for word in spec[1:]]
    subprocess.run([iptables, "-w", "5", "-D", *spec], check=False, capture_output=True)


@pytest.fixture
def iptables() -> Any:
    found = require_iptables()
    assert not _our_rules(found), "a rule of an earlier run is left: remove it first"
    yield found
    for line in _our_rules(found):  # what the old helper left
        _remove(found, line)


def test_an_interrupt_while_the_rule_goes_in_leaves_no_rule(
    iptables: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = subprocess.run

    def interrupted_insert(args: list[str], **kwargs: Any) -> Any:
        done = run(args, **kwargs)
        if "-I" in args:
            raise KeyboardInterrupt  # Ctrl-C once iptables put the rule in
        return done

    monkeypatch.setattr(subprocess, "run", interrupted_insert)
    with pytest.raises(KeyboardInterrupt), vanished(PORT, PORT):
        pytest.fail("the block must not run")  # pragma: no cover
    monkeypatch.undo()
    assert _our_rules(iptables) == []


def test_the_blocks_own_failure_is_reported_when_the_rule_is_gone(iptables: str) -> None:
    with pytest.raises(AssertionError, match="the block's own"), vanished(PORT, PORT):
        [line] = _our_rules(iptables)
        _remove(iptables, line)  # gone already, as after someone else's cleanup
        raise AssertionError("the block's own")
    assert _our_rules(iptables) == []
