"""Several relay processes on one MariaDB outbox (test_store_audit_sqlite_kills: one SQLite file), SIGKILLed at random
while they hold rows: every message is published, every key's messages are first published
in order, no row is left PROCESSING. The workers drive the store directly (claim, publish
to a shared log, settle), so what is checked is the store's leases and recovery."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.relaying import enqueue, rows

KEYS = [f"k{k}" for k in range(8)]
MESSAGES = 320
#: Short, so that the rows a killed worker held are recovered within the test.
LOCK_SECONDS = 1.0
KILLS = 6

#: One worker: claims batches of 4, "publishes" each message by appending a line to the
#: log (one write of O_APPEND: whole lines, in the order they happened), then settles.
#: "C" lines mark a claim, "S" lines its settle: a kill between them held rows.
WORKER = """
import asyncio, os, sys, time
import outboxer

url, name, log = sys.argv[1], sys.argv[2], sys.argv[3]
fd = os.open(log, os.O_WRONLY | os.O_APPEND)

def line(text):
    os.write(fd, (text + "\\n").encode())

async def main():
    async with outboxer.create_store(url) as store:
        while True:
            claim = await store.claim("default", name, 4, LOCK_SECONDS, True, max_attempts=1000)
            if not claim:
                await asyncio.sleep(0.02)
                continue
            line(f"C {name} {len(claim)}")
            for message in claim:
                time.sleep(0.01)
                line(f"P {name} {message.stored_seq} {message.key}")
            result = await store.settle("default", claim.lease, [m.stored_seq for m in claim],
                                        [], [], 1000)
            line(f"S {name} {result.published}")

asyncio.run(main())
""".replace("LOCK_SECONDS", repr(LOCK_SECONDS))


def _spawn(url: str, name: str, log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", WORKER, url, name, str(log)])


def _held_rows_when_killed(lines: list[str], name: str) -> bool:
    """Whether the worker's last claim had no settle when it was killed."""
    own = [text for text in lines if text.split()[1] == name and text[0] in "CS"]
    return bool(own) and own[-1][0] == "C"


async def run_kills(url: str, tmp_path: Path) -> None:
    chooser = random.Random(7)
    for start in range(0, MESSAGES, 40):
        enqueue(url, *[("t", KEYS[n % len(KEYS)]) for n in range(start, start + 40)])
    log = tmp_path / "deliveries.log"
    log.touch()
    workers: dict[str, subprocess.Popen[bytes]] = {}
    count = 0

    def spawn() -> None:
        nonlocal count
        count += 1
        workers[f"w{count}"] = _spawn(url, f"w{count}", log)

    killed_holding = 0
    try:
        for _ in range(3):
            spawn()
        read = 0
        claimed: dict[str, int] = {}  # per worker, the rows its last claim took and not published
        for _ in range(KILLS):
            # Kill a worker that has just published a row of its batch and has more to go:
            # it holds rows (it settles only after its last one).
            victim = None
            deadline = time.monotonic() + 10
            while victim is None and time.monotonic() < deadline:
                lines = log.read_text().splitlines()
                for text in lines[read:]:
                    kind, name, *rest = text.split()
                    if kind == "C":
                        claimed[name] = int(rest[0])
                    elif kind == "P":
                        claimed[name] -= 1
                        if claimed[name] > 0 and name in workers and chooser.random() < 0.3:
                            victim = name
                read = len(lines)
                if victim is not None and claimed[victim] <= 0:
                    victim = None  # it finished its batch in the lines read since
                if victim is None:
                    await asyncio.sleep(0.002)
            if victim is None:
                break  # nothing more is published: the others drained the outbox
            os.kill(workers[victim].pid, signal.SIGKILL)
            workers.pop(victim).wait()
            killed_holding += _held_rows_when_killed(log.read_text().splitlines(), victim)
            spawn()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            found = await rows(url)
            if {row["status"] for row in found} == {"PUBLISHED"}:
                break
            await asyncio.sleep(0.2)
    finally:
        for worker in workers.values():
            worker.kill()
            worker.wait()

    found = await rows(url)
    assert len(found) == MESSAGES
    statuses = {str(row["seq"]): row["status"] for row in found}
    assert set(statuses.values()) == {"PUBLISHED"}, sorted(
        (seq, status) for seq, status in statuses.items() if status != "PUBLISHED"
    )
    assert killed_holding >= KILLS // 2, f"{killed_holding} kills while holding rows"
    deliveries = [text.split() for text in log.read_text().splitlines() if text[0] == "P"]
    first: dict[str, list[int]] = {}
    seen_seqs: set[int] = set()
    for _, _, seq, key in deliveries:
        if int(seq) not in seen_seqs:
            seen_seqs.add(int(seq))
            first.setdefault(key, []).append(int(seq))
    assert seen_seqs == {int(seq) for seq in statuses}
    for key, seqs in first.items():
        assert seqs == sorted(seqs), f"key {key} first published out of order: {seqs}"
    # A recovered row counts the attempt that died: the kills show up as retried rows.
    assert any(int(str(row["attempts"])) > 0 for row in found)


@pytest.mark.timeout(120)
async def test_mysql_relays_killed_holding_rows(mysql_url: str, tmp_path: Path) -> None:
    await run_kills(mysql_url, tmp_path)
