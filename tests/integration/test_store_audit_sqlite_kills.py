"""Several relay processes on one SQLite file, SIGKILLed while they hold rows (the scenario
of test_store_audit_mysql_kills)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.test_store_audit_mysql_kills import run_kills


@pytest.mark.timeout(120)
async def test_sqlite_relays_killed_holding_rows(sqlite_url: str, tmp_path: Path) -> None:
    await run_kills(sqlite_url, tmp_path)
