"""The README's framework examples, run as they are written (only the database URL swapped)."""

from __future__ import annotations

import asyncio
import json
import pathlib
import re
import sys
import time
import types
import uuid

from tests.contrib.helpers import claim_all, sqlalchemy_url
from tests.services import require

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def readme_example(name: str) -> str:
    """The fenced code block that follows ``<!-- example: NAME ... -->`` in the README."""
    match = re.search(
        rf"<!-- example: {re.escape(name)}\b[^>]*-->\n```\w*\n(.*?)\n```", README.read_text(), re.S
    )
    assert match, f"README has no example {name!r}"
    return match.group(1)


def run_example(name: str, replacements: dict[str, str]) -> dict[str, object]:
    code = readme_example(name)
    for old, new in replacements.items():
        assert old in code, f"the {name} example no longer contains {old!r}"
        code = code.replace(old, new)
    # A module of its own: SQLAlchemy resolves annotations through sys.modules.
    module = types.ModuleType(f"readme_{name.replace('-', '_')}")
    sys.modules[module.__name__] = module
    try:
        exec(compile(code, f"README.md:{name}", "exec"), module.__dict__)
    finally:
        del sys.modules[module.__name__]
    return module.__dict__


def test_sqlalchemy_example(pg_url: str) -> None:
    namespace = run_example(
        "sqlalchemy", {"postgresql+psycopg://localhost/app": sqlalchemy_url(pg_url)}
    )
    engine = namespace["engine"]
    [message] = claim_all(pg_url)
    assert (message.topic, message.key) == ("order.placed", "customer-7")
    assert json.loads(message.payload) == {"id": 1}
    engine.dispose()  # type: ignore[attr-defined]


async def test_faststream_example(pg_url: str) -> None:
    import aio_pika
    import psycopg

    import outboxer
    from tests.rabbit import AMQP_URL

    require("rabbitmq")
    name = f"test-{uuid.uuid4().hex[:10]}"
    with psycopg.connect(pg_url) as conn:
        conn.execute("CREATE TABLE shipments (order_id int NOT NULL)")
        message = outboxer.enqueue(conn, "order.placed", {"id": 42}, key="order-42")
    module = run_example(
        "faststream",
        {
            "postgresql+asyncpg://localhost/shipping": sqlalchemy_url(pg_url, asynchronous=True),
            'RabbitExchange("outboxer"': f'RabbitExchange("{name}"',
            'RabbitQueue("shipping"': f'RabbitQueue("{name}"',
            "amqp://guest:guest@localhost:5672/": AMQP_URL,
        },
    )
    broker, engine = module["broker"], module["engine"]
    await broker.start()  # type: ignore[attr-defined]
    try:
        settings = outboxer.load_settings(
            {"db": pg_url, "broker": f"{AMQP_URL}?exchange={name}", "exit_when_idle": True}
        )
        await outboxer.Relay.from_settings(settings).run()
        deadline = time.monotonic() + 20
        while shipped(pg_url) != [42] and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
    finally:
        await broker.stop()  # type: ignore[attr-defined]
        await engine.dispose()  # type: ignore[attr-defined]
        connection = await aio_pika.connect(AMQP_URL)
        async with connection:
            channel = await connection.channel()
            await channel.queue_delete(name)
            await channel.exchange_delete(name)
    assert shipped(pg_url) == [42]
    with psycopg.connect(pg_url) as conn:
        inbox = conn.execute("SELECT consumer, message_id FROM outboxer.inbox").fetchall()
    assert inbox == [("shipping", message.id)]


def shipped(pg_url: str) -> list[int]:
    import psycopg

    with psycopg.connect(pg_url) as conn:
        return [row[0] for row in conn.execute("SELECT order_id FROM shipments")]


def test_django_example_is_the_model_the_django_tests_run() -> None:
    models = README.parent / "tests/contrib/django_project/shop/models.py"
    assert readme_example("django-models") in models.read_text()


def test_django_consume_example_is_the_handler_the_django_tests_run() -> None:
    handlers = README.parent / "tests/contrib/django_project/shop/handlers.py"
    assert readme_example("django-consume") in handlers.read_text()
