"""outboxer.malloc: asyncio's 256 KiB socket reads reuse heap memory instead of each
mapping fresh pages (minor page faults per read, counted in a fresh interpreter)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from outboxer.malloc import tune_malloc

READS = """
import asyncio, resource, socket, sys
if sys.argv[1] == "tuned":
    from outboxer.malloc import tune_malloc
    assert tune_malloc()

async def main():
    loop = asyncio.get_running_loop()
    ours, theirs = socket.socketpair()
    arrived = asyncio.Queue()

    class Reader(asyncio.Protocol):
        def data_received(self, data):
            arrived.put_nowait(len(data))

    await loop.create_connection(Reader, sock=ours)
    for _ in range(200):  # the heap settles first
        theirs.send(b"x" * 300)
        await arrived.get()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(3000):  # a small reply at a time, as a relay reads its database's
        theirs.send(b"x" * 300)
        await arrived.get()
    print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 3000)

asyncio.run(main())
"""


def faults_per_read(mode: str) -> float:
    done = subprocess.run(
        [sys.executable, "-c", READS, mode], capture_output=True, text=True, check=True
    )
    return float(done.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_small_reads_fault_in_no_fresh_pages_once_tuned() -> None:
    if not tune_malloc():
        pytest.skip("the C library is not glibc")
    plain = faults_per_read("plain")
    if plain < 0.5:
        pytest.skip(f"this allocator maps no fresh pages per read anyway ({plain:.2f} faults)")
    tuned = faults_per_read("tuned")
    assert tuned < 0.05, f"{tuned:.2f} page faults per read once tuned, {plain:.2f} before"
