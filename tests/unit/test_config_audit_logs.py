"""Log lines carry hostile text (topics, keys, broker and handler errors): a line must
stay one line of valid output, its bytes encodable, and no control sequence raw.

(In tests/unit with the config audit's prefix: logs are part of the settings, logs,
metrics and tracing area.)
"""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from outboxer.logjson import JsonFormatter, fields
from outboxer.redact import TextFormatter, get_logger

TEXT_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # outboxer.cli's


@pytest.fixture
def log() -> Iterator[tuple[logging.Logger, logging.StreamHandler[io.StringIO]]]:
    """An outboxer logger (with its redacting filter) writing to a string."""
    handler = logging.StreamHandler(io.StringIO())
    logger = get_logger("outboxer.test_config_audit_logs")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    yield logger, handler
    logger.removeHandler(handler)
    logger.propagate = True


def written(handler: logging.StreamHandler[io.StringIO]) -> str:
    return handler.stream.getvalue()


def test_a_json_line_with_a_lone_surrogate_is_valid_utf8_and_reads_back(
    log: tuple[logging.Logger, logging.StreamHandler[io.StringIO]],
) -> None:
    """A topic decoded from JSON ("\\udc80" is valid JSON) or from invalid UTF-8 with
    surrogateescape holds a lone surrogate: a UTF-8 log file (FileHandler, a shipper's
    pipe) could not encode the line, and logging dropped it ("--- Logging error ---")."""
    logger, handler = log
    handler.setFormatter(JsonFormatter())
    topic = "orders\udc80\ud800"
    logger.warning("message on %s failed", topic, extra=fields(topic=topic))
    line = written(handler)
    line.encode("utf-8")  # raised UnicodeEncodeError
    (entry,) = [json.loads(text) for text in line.splitlines()]
    assert entry["message"] == f"message on {topic} failed"
    assert entry["topic"] == topic


def test_a_json_line_shows_no_c1_control_nor_bidi_override_raw(
    log: tuple[logging.Logger, logging.StreamHandler[io.StringIO]],
) -> None:
    """JSON lines reach terminals too (``kubectl logs``): json.dumps escapes C0 controls
    but leaves C1 (U+009B is a CSI) and the bidirectional overrides as they are."""
    logger, handler = log
    handler.setFormatter(JsonFormatter())
    key = "k\x9b2J\u202etxt.exe\u2028x"
    logger.warning("key %s", key, extra=fields(destination=key))
    line = written(handler)
    for char in ("\x9b", "\u202e", "\u2028"):
        assert char not in line
    (entry,) = [json.loads(text) for text in line.splitlines()]
    assert entry["message"] == f"key {key}" and entry["destination"] == key


def test_a_text_traceback_shows_no_escape_sequence_raw(
    log: tuple[logging.Logger, logging.StreamHandler[io.StringIO]],
) -> None:
    """The text format escaped the message but not the traceback: an exception whose text
    came from a broker, a webhook's answer or a message reached the terminal with its ESC
    and CR (which rewrites the start of the line on screen)."""
    logger, handler = log
    handler.setFormatter(TextFormatter(TEXT_LOG_FORMAT))
    try:
        raise RuntimeError("refused \x1b[2J\x1b]0;pwned\x07 by peer\rFAKE LINE \u202e")
    except RuntimeError:
        logger.exception("publish failed")
    output = written(handler)
    for char in ("\x1b", "\x07", "\r", "\u202e"):
        assert char not in output
    assert "\\x1b[2J" in output and "RuntimeError: refused" in output
    assert "Traceback (most recent call last):\n" in output  # a traceback keeps its lines


def test_a_text_line_holds_no_unicode_line_separator(
    log: tuple[logging.Logger, logging.StreamHandler[io.StringIO]],
) -> None:
    """U+2028 and U+2029 end a line for str.splitlines() (log shippers written in Python)
    and for JavaScript log viewers: a topic holding one forged a second record there."""
    logger, handler = log
    handler.setFormatter(TextFormatter(TEXT_LOG_FORMAT))
    topic = "orders\u20282026-01-01 00:00:00 ERROR outboxer.relay: FAKE\u2029x"
    logger.warning("message on %s failed", topic)
    output = written(handler)
    assert len(output.splitlines()) == 1
    assert "\\u2028" in output and "\\u2029" in output
