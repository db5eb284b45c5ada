"""A forced stop after a batch's first wave was confirmed by Redis: after the restart, the
stream holds each confirmed message of that batch once.

The relay publishes through a gate in front of the real Redis that lets the first wave's
XADD replies through and holds every reply after them: the second wave is in flight
(Redis appended it, the relay never hears so) when two SIGTERMs stop the relay. The first
wave's rows are PUBLISHED then, not given back to be published again by the next relay;
the second wave's are given back untried (their duplicates on the stream are what
at-least-once allows for a message whose fate the relay never learnt).
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections import Counter

import redis.asyncio as aioredis

from tests.integration.test_audit11_wave_partial_timeout import gate, split_resp
from tests.relaying import drained, enqueue, relay, rows, until
from tests.services import PORTS, require

#: An XADD's reply: the new entry's id, as a bulk string.
ENTRY_ID = re.compile(rb"\$\d+\r\n\d+-\d+\r\n")


async def test_a_forced_stop_after_the_first_wave_publishes_it_once(pg_url: str) -> None:
    require("redis")
    stream = f"audit17fs{uuid.uuid4().hex[:8]}"
    # Wave 0: k1's first, k2's first, the keyless one; wave 1: k1's and k2's second.
    sent = enqueue(
        pg_url, (stream, "k1"), (stream, "k2"), (stream, None), (stream, "k1"), (stream, "k2")
    )
    first_wave = {str(m.id) for m in sent[:3]}
    counts = lambda packet: ENTRY_ID.fullmatch(packet) is not None  # noqa: E731
    client = aioredis.Redis(port=PORTS["redis"])
    try:
        async with gate(PORTS["redis"], split_resp, counts, downstream=True) as proxy:
            proxy.hold_after(len(first_wave))
            cut = relay(
                pg_url, f"redis://127.0.0.1:{proxy.port}/0", publish_timeout=10.0, batch_size=10
            )
            running = asyncio.create_task(cut.run())
            await until(lambda: proxy.held > 0, "the second wave's replies were held", 5)
            cut.signalled()  # SIGTERM: finish the batch ...
            cut.signalled()  # ... a second one: stop now
            await asyncio.wait_for(running, 5)
        status = {str(row["id"]): row["status"] for row in await rows(pg_url)}
        assert {status[i] for i in first_wave} == {"PUBLISHED"}, status
        assert {s for i, s in status.items() if i not in first_wave} == {"PENDING"}, status

        again = relay(pg_url, f"redis://127.0.0.1:{PORTS['redis']}/0")
        running = asyncio.create_task(again.run())
        try:
            await until(lambda: drained(pg_url), "the restarted relay published the rest", 5)
        finally:
            again.stop()
            await asyncio.wait_for(running, 5)
        entries = await client.xrange(stream)
    finally:
        await client.delete(stream)
        await client.aclose()
    seen = Counter(fields[b"id"].decode() for _, fields in entries)
    assert {i: seen[i] for i in first_wave} == dict.fromkeys(first_wave, 1), seen
    assert set(seen) == {str(m.id) for m in sent}, seen
    # Per key, the first deliveries in order.
    firsts = list(dict.fromkeys(fields[b"id"].decode() for _, fields in entries))
    for key in ("k1", "k2"):
        mine = [str(m.id) for m in sent if m.key == key]
        assert [i for i in firsts if i in mine] == mine, firsts
