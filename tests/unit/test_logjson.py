"""JSON log lines: one object per line, the relay's fields, and no secret in any of them."""

from __future__ import annotations

import io
import json
import logging
import uuid
from collections.abc import Iterator

import pytest

from outboxer.logjson import JsonFormatter, error_class, fields
from outboxer.redact import MASK, get_logger, register_secret


@pytest.fixture
def lines() -> Iterator[io.StringIO]:
    """Whatever the logger ``outboxer.test_logjson`` writes, as JSON lines."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = get_logger("outboxer.test_logjson")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield stream
    logger.removeHandler(handler)


def parsed(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_a_line_carries_the_message_and_the_relay_fields(lines: io.StringIO) -> None:
    message_id = uuid.uuid4()
    get_logger("outboxer.test_logjson").warning(
        "destination %s: message %s failed",
        "partner",
        message_id,
        extra=fields(
            message_id=message_id,
            destination="partner",
            topic="order.placed",
            attempt=3,
            error="TimeoutError: no confirm within 30s",
        ),
    )
    (entry,) = parsed(lines)
    assert entry["level"] == "WARNING"
    assert entry["logger"] == "outboxer.test_logjson"
    assert entry["message"] == f"destination partner: message {message_id} failed"
    assert entry["message_id"] == str(message_id)
    assert entry["destination"] == "partner"
    assert entry["topic"] == "order.placed"
    assert entry["attempt"] == 3  # a number, not text
    assert entry["error_class"] == "TimeoutError"
    assert str(entry["time"]).endswith("+00:00")
    assert "relay_id" not in entry  # fields not given are left out


def test_an_exception_gives_its_class_and_a_redacted_traceback(lines: io.StringIO) -> None:
    try:
        raise ConnectionError("cannot reach amqp://app:broker-pw-123@mq:5672/")
    except ConnectionError:
        get_logger("outboxer.test_logjson").exception("publish failed")
    (entry,) = parsed(lines)
    assert entry["error_class"] == "ConnectionError"
    assert "Traceback" in str(entry["exception"])
    assert "broker-pw-123" not in json.dumps(entry)
    assert f"app:{MASK}@mq" in str(entry["exception"])


def test_secrets_are_masked_in_the_message_and_the_fields_even_from_foreign_loggers() -> None:
    register_secret("webhook-signing-secret-42")
    record = logging.LogRecord(
        "aio_pika.connection",  # a driver's logger: no redacting filter on it
        logging.ERROR,
        __file__,
        1,
        "connect to %s failed",
        ("amqp://u:pw-0987654@h/",),
        None,
    )
    record.__dict__.update(fields(destination="webhook-signing-secret-42", topic="t"))
    entry = json.loads(JsonFormatter().format(record))
    assert entry["message"] == f"connect to amqp://u:{MASK}@h/ failed"
    assert entry["destination"] == MASK


def test_each_record_is_one_line_whatever_its_text_holds(lines: io.StringIO) -> None:
    logger = get_logger("outboxer.test_logjson")
    logger.info('two\nlines and a \x00 and "quotes" and ünïcode')
    logger.info("second")
    entries = parsed(lines)
    assert [entry["message"] for entry in entries] == [
        'two\nlines and a \x00 and "quotes" and ünïcode',
        "second",
    ]


def test_error_class_reads_the_type_describe_writes() -> None:
    assert error_class("TimeoutError: no confirm") == "TimeoutError"
    assert error_class("aiormq.exceptions.ChannelClosed: 406") == "aiormq.exceptions.ChannelClosed"
    assert error_class("HTTP 503 from receiver") is None
    assert error_class(None) is None
    assert (
        fields(error="HTTP 500", error_class_name="WebhookError")["error_class"] == "WebhookError"
    )


def test_a_relay_of_one_of_several_databases_names_it_on_each_line() -> None:
    from outboxer.relay import DatabaseLog

    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    base = logging.getLogger("outboxer.test.databaselog")
    base.addHandler(Keep())
    base.setLevel(logging.INFO)
    DatabaseLog(base, "billing").warning(
        "destination %s: broker unreachable", "default", extra={"destination": "default"}
    )
    [record] = records
    line = json.loads(JsonFormatter().format(record))
    assert line["message"] == "database billing: destination default: broker unreachable"
    assert (line["database"], line["destination"]) == ("billing", "default")


def test_the_text_log_format_escapes_control_characters_in_the_message() -> None:
    import logging

    from outboxer.redact import TextFormatter

    record = logging.LogRecord(
        "outboxer.relay", logging.ERROR, __file__, 1, "message %s abandoned: %s", None, None
    )
    record.args = ("k\nFAKE line", "\x1b[2Jcleared")
    line = TextFormatter("%(levelname)s %(name)s: %(message)s").format(record)
    assert line == "ERROR outboxer.relay: message k\\x0aFAKE line abandoned: \\x1b[2Jcleared"
