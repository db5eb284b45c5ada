"""``outboxer dead-letters purge`` against a claim-check store that stops answering (an S3
endpoint that accepts connections and never answers): the dead letters are purged, and the
release of their holds is given up after ``claim_check_read_timeout`` with a warning
(before, the command waited on the store for ever, after its commit)."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest

from outboxer.cli import main
from tests.integration.test_audit12_ccretain_dead_letter_hold import dead_lettered
from tests.s3 import CREDENTIALS, REGION, silent_listener


async def test_a_purge_whose_store_hangs_ends_within_the_read_timeout(
    pg_url: str,
    sqlite_url: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OUTBOXER_CLAIM_CHECK_READ_TIMEOUT", "0.5s")
    await dead_lettered(pg_url, sqlite_url, f"file://{tmp_path / 'claims'}")
    with silent_listener() as endpoint, caplog.at_level(logging.WARNING):
        hung = (
            f"s3://bucket/claims?endpoint_url=http://{endpoint}&region={REGION}"
            f"&access_key_id={CREDENTIALS['access_key_id']}"
            f"&secret_access_key={CREDENTIALS['secret_access_key']}"
        )
        began = time.monotonic()
        code = await asyncio.wait_for(
            asyncio.to_thread(
                main,
                [
                    "dead-letters",
                    "purge",
                    "--all",
                    "--db",
                    sqlite_url,
                    "--group",
                    "g",
                    "--claim-check-store",
                    hung,
                ],
            ),
            10,
        )
        took = time.monotonic() - began
    assert code == 0
    assert took < 4, took
    warned = [r.getMessage() for r in caplog.records if "holds on 1 claim-check" in r.getMessage()]
    assert warned and "no answer within 0.5 s" in warned[0], caplog.text
    assert CREDENTIALS["secret_access_key"] not in caplog.text
