"""`outboxer consume` on MQTT with a handler that kills the process on one message.

tests/acceptance/test_audit14_crash_consumer_rabbitmq.py on Mosquitto, with its helpers: the
test is the supervisor, starting the consumer again after each death. The consumer's
session (one client id across restarts) makes the broker send the unacknowledged messages
again with DUP set; before the receiver carried that flag to ``Incoming.redelivered``, the
killer came back after every restart as a first delivery, for ever (a crash loop).

Every message's outboxer topic is the one literal ``crash.*`` the helper's ``--topic``
subscribes to (``*`` is no wildcard in MQTT); ``topic_prefix`` keeps the test's own.
"""

from __future__ import annotations

import asyncio
import sqlite3
import uuid
from pathlib import Path

from outboxer.message import Message
from outboxer.receivers import create_receiver
from outboxer.receivers.base import Incoming, Receiver
from outboxer.testing import make_message
from tests.acceptance.test_audit14_crash_consumer_rabbitmq import (
    SUSPECT_LOG,
    SUSPECT_TRIGGERS,
    consume,
    killer_dead_lettered,
    publish,
    query,
)
from tests.services import require

TOPIC = "crash.*"


def message(payload: dict[str, object], key: str) -> Message:
    return make_message(TOPIC, payload, key=key)


def session_receiver(broker: str, group: str) -> Receiver:
    """A receiver under the consumer's own client id (the broker URL's ``client_id``)."""
    return create_receiver(broker, group=group, topics=[TOPIC])


async def subscribe(broker: str, group: str) -> None:
    """The session and subscription the consumer makes on its first connect, made already:
    messages published before that would have nowhere to go."""
    receiver = session_receiver(broker, group)
    await receiver.connect()
    await receiver.close()


async def left_in_session(broker: str, publisher: str, group: str) -> list[Incoming]:
    """What the consumer's session still held: a sentinel published last comes after it."""
    receiver = session_receiver(broker, group)
    await receiver.connect()
    try:
        sentinel = message({"n": -1}, key="sentinel")
        await publish(publisher, [sentinel])
        held: list[Incoming] = []
        while not any(i.delivery.id == sentinel.id for i in held):
            got = await receiver.receive(10, 5.0)
            assert got, "the sentinel never came"
            held += got
        await receiver.ack(held)
        return [i for i in held if i.delivery.id != sentinel.id]
    finally:
        await receiver.close()


def test_a_message_that_kills_the_mqtt_consumer_is_dead_lettered_after_max_attempts_deaths(
    sqlite_url: str, tmp_path: Path
) -> None:
    require("mosquitto")
    path = Path(sqlite_url.removeprefix("sqlite:///"))
    with sqlite3.connect(path) as lite:
        lite.execute("CREATE TABLE applied (message_id TEXT, key TEXT, n INTEGER)")
        lite.execute(SUSPECT_LOG)
        lite.executescript(SUSPECT_TRIGGERS)
    suffix = uuid.uuid4().hex[:8]
    group = f"g{suffix}"
    publisher = f"mqtt://127.0.0.1:1883?topic_prefix=crash-{suffix}/"
    # One client id for every run: each restart takes the last one's session up again. Not
    # the publisher's: it would connect under it with Clean Start, ending the session.
    broker = f"{publisher}&session_expiry=60&client_id=outboxer-crash-{suffix}"
    log = tmp_path / "consumer.log"
    asyncio.run(subscribe(broker, group))

    # First deliveries only.
    firsts = [message({"n": n}, key=f"f{n % 3}") for n in range(30)]
    asyncio.run(publish(publisher, firsts))
    assert consume(sqlite_url, broker, group, log) == 0, log.read_text()
    assert query(path, "SELECT count(*) FROM applied") == [(30,)]
    # No DUP on a first delivery: the normal path writes nothing to the suspects table.
    assert query(path, "SELECT count(*) FROM suspect_log") == [(0,)]

    killer = message({"die": True}, key="k")
    after = [message({"n": 100 + n}, key="k") for n in range(3)]
    others = [message({"n": 200 + n}, key="j") for n in range(3)]
    asyncio.run(publish(publisher, [message({"n": 99}, key="k"), killer]))
    asyncio.run(publish(publisher, [*after, *others]))
    killer_dead_lettered(sqlite_url, broker, group, log, path, killer.id)
    assert asyncio.run(left_in_session(broker, publisher, group)) == []
