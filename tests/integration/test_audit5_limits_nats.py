"""Broker-side limits of NATS JetStream and what the publisher makes of them: a publish the
server refuses because the account's JetStream storage is full, or because the stream is
full with ``discard: new``, is a failed attempt that is tried again (never published, never
abandoned for good); limits that make JetStream drop what it acknowledged (``discard: old``,
interest retention without consumers) are the user's, and the docs say what they do."""

from __future__ import annotations

import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest
from nats.js.api import DiscardPolicy, RetentionPolicy

from outboxer.brokers.base import OutcomeKind
from outboxer.brokers.nats import NatsPublisher
from outboxer.testing import make_message
from tests.chaos.servers import free_port, missing_tool
from tests.services import port_open, require

URL = "nats://127.0.0.1:4222"
DOCS = Path(__file__).resolve().parents[2] / "docs" / "brokers" / "nats.md"


@pytest.fixture
def small_account(tmp_path: Path) -> Iterator[str]:
    """A private nats-server whose one account may store 20 kB in JetStream; its URL."""
    binary = shutil.which("nats-server") or shutil.which("nats-server", path="/usr/sbin")
    if binary is None:
        missing_tool("nats-server is not installed")
    assert binary is not None
    port = free_port()
    config = tmp_path / "nats.conf"
    config.write_text(
        f"listen: 127.0.0.1:{port}\n"
        f'jetstream {{ store_dir: "{tmp_path / "js"}" }}\n'
        "accounts { A: { jetstream: { max_file: 20000, max_mem: 20000 },"
        " users: [ { user: a, password: a } ] } }\n"
    )
    server = subprocess.Popen(
        [binary, "-c", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        for _ in range(100):
            if port_open(port):
                break
            if server.poll() is not None:
                raise RuntimeError(f"private nats-server exited with {server.returncode}")
            time.sleep(0.05)  # a port to poll: no event to await
        yield f"nats://a:a@127.0.0.1:{port}"
    finally:
        server.kill()
        server.wait()


async def test_a_full_account_is_a_retryable_refusal(small_account: str) -> None:
    """JetStream answers 400 err_code 10002 ("resource limits exceeded for account") when the
    account's storage is used up. Space comes back (messages age out, a work queue is
    consumed, the operator raises the limit), so the message must wait, not be abandoned at
    its first attempt as a 4xx refusal of the message itself would be."""
    nc = await nats.connect(small_account)
    js = nc.jetstream()
    try:
        await js.add_stream(name="FULL", subjects=["full.>"])
        async with NatsPublisher(f"{small_account}?subject_prefix=full.&stream=FULL") as publisher:
            messages = [make_message("t", payload=b"x" * 4000) for _ in range(8)]
            outcomes = await publisher.publish_batch(messages)
            refused = [m for m, o in zip(messages, outcomes, strict=True) if not o.published]
            assert outcomes[0].published and refused, outcomes
            for outcome in outcomes:
                if not outcome.published:
                    assert outcome.kind is OutcomeKind.FAILED, outcome
                    assert "10002" in (outcome.error or ""), outcome
                    assert outcome.retryable, outcome
            await js.purge_stream("FULL")  # consumed, aged out: the space is back
            again = await publisher.publish_batch(refused[:2])
            assert all(o.published for o in again), again
    finally:
        await nc.close()


async def test_a_full_stream_with_discard_new_is_a_retryable_refusal() -> None:
    require("nats")
    tag = uuid.uuid4().hex[:8]
    stream = f"AUDIT5_LIMITS_{tag}"
    nc = await nats.connect(URL)
    js = nc.jetstream()
    try:
        await js.add_stream(
            name=stream, subjects=[f"l{tag}.>"], max_msgs=2, discard=DiscardPolicy.NEW
        )
        async with NatsPublisher(f"{URL}?subject_prefix=l{tag}.&stream={stream}") as publisher:
            outcomes = await publisher.publish_batch([make_message("t") for _ in range(4)])
        assert [o.kind for o in outcomes] == [OutcomeKind.PUBLISHED] * 2 + [OutcomeKind.FAILED] * 2
        assert all(o.retryable and "10077" in (o.error or "") for o in outcomes[2:]), outcomes
        assert (await js.stream_info(stream)).state.messages == 2
    finally:
        await js.delete_stream(stream)
        await nc.close()


async def test_limits_that_drop_acknowledged_messages_are_documented() -> None:
    """``discard: old`` (JetStream's default) removes the oldest messages once the stream is
    full, and an interest-retention stream keeps nothing for which no consumer exists: both
    acknowledge the publish, so outboxer counts it published. The docs must say so, and
    what a stream outboxer creates gets."""
    require("nats")
    tag = uuid.uuid4().hex[:8]
    nc = await nats.connect(URL)
    js = nc.jetstream()
    kept: dict[str, int] = {}
    try:
        for name, limits in (
            ("old", {"max_msgs": 2}),
            ("interest", {"retention": RetentionPolicy.INTEREST}),
        ):
            stream = f"AUDIT5_LIMITS_{name}_{tag}"
            await js.add_stream(name=stream, subjects=[f"l{tag}.{name}.>"], **limits)
            try:
                async with NatsPublisher(
                    f"{URL}?subject_prefix=l{tag}.{name}.&stream={stream}"
                ) as publisher:
                    outcomes = await publisher.publish_batch([make_message("t") for _ in range(4)])
                assert all(o.published for o in outcomes), outcomes
                kept[name] = (await js.stream_info(stream)).state.messages
            finally:
                await js.delete_stream(stream)
        created = f"AUDIT5_LIMITS_created_{tag}"
        async with NatsPublisher(
            f"{URL}?subject_prefix=l{tag}.c.&stream={created}&create_stream=true"
        ):
            pass
        config = (await js.stream_info(created)).config
        await js.delete_stream(created)
    finally:
        await nc.close()
    assert kept == {"old": 2, "interest": 0}
    assert config.retention == RetentionPolicy.LIMITS
    assert (config.max_msgs, config.max_bytes, config.max_age) in ((-1, -1, 0), (-1, -1, None))
    docs = " ".join(DOCS.read_text("utf-8").split())
    for said in (
        "resource limits exceeded for account",
        "`discard: new`",
        "`discard: old`",
        "interest retention",
        "no limits",
    ):
        assert said in docs, said
