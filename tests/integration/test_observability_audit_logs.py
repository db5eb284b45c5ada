"""The relay's text log lines on the real databases, a webhook answering hostile text:
each record stays one line, with no escape sequence raw."""

from __future__ import annotations

import asyncio
import io
import logging

from outboxer.redact import TextFormatter, get_logger
from outboxer.testing import eventually
from tests.receiver import Delivery, Receiver
from tests.relaying import db, enqueue, relay, rows

__all__ = ["db"]  # the fixture, imported: every test taking ``db`` runs on each database

TEXT_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # outboxer.cli's
FORGED = "2026-01-01 00:00:00,000 ERROR outboxer.relay: FORGED"


async def test_a_hostile_answer_and_topic_forge_no_log_line(db: str) -> None:
    """The answer's text goes into the failure's log line; U+2028 and U+2029 (line breaks
    for str.splitlines() and JavaScript log viewers) went through raw."""

    def hostile(_: Delivery) -> tuple[int, bytes]:
        body = f"bad\u2028{FORGED}\u2029\x1b[2J\x1b]0;title\x07 upstream"
        return 500, body.encode()

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(TextFormatter(TEXT_LOG_FORMAT))
    logger = get_logger("outboxer")
    logger.addHandler(handler)
    previous = logger.level
    logger.setLevel(logging.INFO)
    receiver = Receiver(answer=hostile).start()
    try:
        enqueue(db, (f"order\u2028{FORGED}", "k"))
        hook = relay(db, receiver.url, max_attempts=1)
        task = asyncio.create_task(hook.run())
        try:

            async def abandoned() -> bool:
                return {r["status"] for r in await rows(db)} == {"ABANDONED"}

            await eventually(abandoned, timeout=20)
        finally:
            hook.stop()
            await asyncio.wait_for(task, 30)
    finally:
        receiver.stop()
        logger.removeHandler(handler)
        logger.setLevel(previous)
    output = stream.getvalue()
    assert "upstream" in output, output  # the failure was logged, with the answer's text
    lines = output.splitlines()
    assert not [line for line in lines if line.startswith(FORGED)], output
    assert len(lines) == len(output.split("\n")) - 1, "a record holds a line break"
    for char in ("\x1b", "\x07", "\u2028", "\u2029"):
        assert char not in output
