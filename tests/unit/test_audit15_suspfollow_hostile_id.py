"""A hostile message id in the inbox's error. ``Inbox.claim`` put the repr of any id that is
not a UUID into its PayloadError, whole: a megabyte of id off the wire became a megabyte of
error text (and of every log line that carries it). Now the id is shown as the FastStream
middleware shows it (``outboxer.redact.shown_value``, shared): cut to a bounded length that
says how long it was, its control characters escaped."""

from __future__ import annotations

import asyncio
import sqlite3

import pytest

from outboxer.errors import PayloadError
from outboxer.inbox import Inbox

HOSTILE = "\n\x1b[2J" + "A" * 1_000_000 + "\nforged log line"


@pytest.mark.parametrize("variant", ["claim", "claim_async"])
def test_an_id_of_a_megabyte_with_control_characters_is_cut_and_escaped(variant: str) -> None:
    conn = sqlite3.connect(":memory:")
    try:
        with pytest.raises(PayloadError) as caught:
            if variant == "claim":
                Inbox().claim(conn, "billing", HOSTILE)
            else:
                asyncio.run(Inbox().claim_async(conn, "billing", HOSTILE))
    finally:
        conn.close()
    text = str(caught.value)
    assert len(text) < 300, f"{len(text)} characters of error"
    assert "\n" not in text and "\x1b" not in text
    assert "\\n\\x1b[2J" in text, "the control characters are shown escaped"
    assert f"({len(repr(HOSTILE))} characters)" in text, "the cut says how long the id was"
    assert text.startswith("message_id is not a UUID: ")


def test_the_faststream_middleware_shows_ids_with_the_same_helper() -> None:
    pytest.importorskip("faststream")
    from outboxer.contrib import faststream
    from outboxer.redact import SHOWN_VALUE_CHARS, shown_value

    # One bound for both: an id shown by the inbox and by the middleware reads alike.
    assert faststream.shown_value is shown_value
    assert faststream.SHOWN_ID_CHARS == SHOWN_VALUE_CHARS
